// Lexer of the chat template engine (roundpipe/models/chat_template.h): template text -> data and
// tag tokens, with jinja2's whitespace rules as transformers configures them (trim_blocks,
// lstrip_blocks, `-`/`+` markers, comments, `{% raw %}`, one trailing newline dropped, \r\n -> \n).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace roundpipe::models::detail {

enum class TokenType {
  kData,        // text between tags (already whitespace-controlled)
  kVarBegin,    // {{
  kVarEnd,      // }}
  kBlockBegin,  // {%
  kBlockEnd,    // %}
  kName,
  kString,      // text = the decoded value
  kInt,
  kFloat,
  kOperator,    // text = the operator: + - * / // % ** ~ == != < <= > >= = . : | , ( ) [ ] { }
  kEof,
};

struct Token {
  TokenType type;
  std::string text;
  int line = 1;
  int64_t int_value = 0;
  double float_value = 0;
};

/// Tokens of `source`, ending with kEof. Throws JinjaError("line N: ...") for an unclosed tag,
/// comment or string, an unbalanced bracket or a character no token starts with.
std::vector<Token> lex_template(std::string_view source);

}  // namespace roundpipe::models::detail
