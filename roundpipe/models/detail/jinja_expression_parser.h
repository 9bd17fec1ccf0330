// Expression parser of the chat template engine (roundpipe/models/chat_template.h): jinja2's
// expression grammar and operator precedence (conditional, or, and, not, comparisons, + -, ~,
// * / // %, **, unary, filters and tests, postfix access and calls, literals) over the lexer's
// tokens. The statement parser (jinja_parser.cpp) derives from it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "roundpipe/models/detail/jinja_ast.h"
#include "roundpipe/models/detail/jinja_lexer.h"

namespace roundpipe::models::detail {

/// Deeper nesting (of brackets, operators or blocks) is refused rather than risking the stack.
inline constexpr int kMaxNesting = 100;

class ExpressionParser {
 public:
  explicit ExpressionParser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

 protected:
  [[noreturn]] static void fail(int line, const std::string& what) { throw LocatedError(line, what); }

  const Token& peek(size_t ahead = 0) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
  const Token& next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  bool at_op(std::string_view op, size_t ahead = 0) const {
    return peek(ahead).type == TokenType::kOperator && peek(ahead).text == op;
  }
  bool at_name(std::string_view name, size_t ahead = 0) const {
    return peek(ahead).type == TokenType::kName && peek(ahead).text == name;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case TokenType::kBlockEnd: return "end of statement block";
      case TokenType::kVarEnd: return "end of print statement";
      case TokenType::kEof: return "end of template";
      case TokenType::kString: return "string";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(std::string_view op) {
    if (!at_op(op)) fail(peek().line, "expected '" + std::string(op) + "', got " + describe(peek()));
    next();
  }
  std::string expect_name() {
    if (peek().type != TokenType::kName) fail(peek().line, "expected a name, got " + describe(peek()));
    return next().text;
  }

  // Counts nesting on construction; refuses more than kMaxNesting levels.
  struct DepthGuard {
    explicit DepthGuard(ExpressionParser& p) : p_(p) {
      if (++p_.depth_ > kMaxNesting) fail(p_.peek().line, "nested deeper than " + std::to_string(kMaxNesting));
    }
    ~DepthGuard() { --p_.depth_; }
    ExpressionParser& p_;
  };

  // Expressions, one function per precedence level as in jinja2's Parser.
  ExprPtr make_expr(Expr::Kind kind, int line);
  ExprPtr parse_tuple(bool with_condexpr);
  bool tuple_ends() const;
  ExprPtr parse_expression(bool with_condexpr);
  ExprPtr binary(std::string op, ExprPtr left, ExprPtr right, int line);
  ExprPtr parse_or();
  ExprPtr parse_and();
  ExprPtr parse_not();
  ExprPtr parse_compare();
  ExprPtr parse_math1();  // + -
  ExprPtr parse_concat();  // ~
  ExprPtr parse_math2();  // * / // %
  ExprPtr parse_pow();
  ExprPtr parse_unary(bool with_filter);
  ExprPtr parse_primary();
  ExprPtr parse_name(const Token& t);   // a name, or true / false / none
  ExprPtr parse_parenthesized(int line);  // after "(": an expression or a tuple
  ExprPtr parse_list(int line);           // after "["
  ExprPtr parse_dict(int line);           // after "{"
  ExprPtr parse_postfix(ExprPtr node);
  ExprPtr parse_subscript(ExprPtr node);
  void parse_arguments(Arguments& args);
  ExprPtr parse_call(ExprPtr node);
  ExprPtr parse_filter_expr(ExprPtr node);
  bool test_argument_follows() const;

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  size_t loop_references_ = 0;  // names `loop` parsed so far (a for loop builds its object only if used)
};

}  // namespace roundpipe::models::detail
