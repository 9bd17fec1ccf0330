#include "roundpipe/models/detail/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "roundpipe/models/detail/jinja_expression_parser.h"
#include "roundpipe/models/detail/jinja_lexer.h"
#include "roundpipe/models/detail/jinja_value.h"

namespace roundpipe::models::detail {
namespace {

// Tags of jinja2 (or its extensions) that this engine does not implement: named in the error.
constexpr std::string_view kUnsupportedTags[] = {"extends", "block",      "include", "import", "from", "call",
                                                 "filter",  "with",       "do",      "autoescape", "trans",
                                                 "pluralize", "debug"};

class Parser : public ExpressionParser {
 public:
  using ExpressionParser::ExpressionParser;

  Template run() {
    Template t;
    t.body = parse_body({});
    if (peek().type != TokenType::kEof) fail(peek().line, "unexpected tag");
    return t;
  }

 private:
  void expect_block_end() {
    if (peek().type != TokenType::kBlockEnd) fail(peek().line, "expected end of statement block, got " +
                                                                   describe(peek()));
    next();
  }

  // Statements until a block tag named in `end_tags` (left unconsumed, after its `{%`).
  StmtList parse_body(std::initializer_list<std::string_view> end_tags) {
    DepthGuard guard(*this);
    StmtList body;
    while (true) {
      const Token& t = peek();
      if (t.type == TokenType::kEof) {
        if (end_tags.size() == 0) return body;
        std::string expected;
        for (auto tag : end_tags) expected += (expected.empty() ? "'" : " or '") + std::string(tag) + "'";
        fail(t.line, "unexpected end of template, expected " + expected);
      }
      if (t.type == TokenType::kData) {
        auto s = make_stmt(Stmt::Kind::kData, t.line);
        s->text = next().text;
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kVarBegin) {
        next();
        auto s = make_stmt(Stmt::Kind::kOutput, t.line);
        s->expr = parse_tuple(true);
        if (peek().type != TokenType::kVarEnd) fail(peek().line, "expected end of print statement, got " +
                                                                     describe(peek()));
        next();
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        const Token& tag = peek(1);
        if (tag.type == TokenType::kName &&
            std::find(end_tags.begin(), end_tags.end(), std::string_view(tag.text)) != end_tags.end()) {
          next();
          return body;
        }
        next();
        body.push_back(parse_statement());
      } else {
        fail(t.line, "unexpected " + describe(t));
      }
    }
  }

  static std::unique_ptr<Stmt> make_stmt(Stmt::Kind kind, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  // After `{%`.
  std::unique_ptr<Stmt> parse_statement() {
    const Token& t = peek();
    if (t.type != TokenType::kName) fail(t.line, "tag name expected");
    const std::string tag = t.text;
    const int line = t.line;
    next();
    if (tag == "if") return parse_if(line);
    if (tag == "for") return parse_for(line);
    if (tag == "set") return parse_set(line);
    if (tag == "macro") return parse_macro(line);
    if (tag == "generation") {
      expect_block_end();
      auto s = make_stmt(Stmt::Kind::kGeneration, line);
      const int saved = loop_depth_;
      loop_depth_ = 0;  // the block renders as a call (jinja2's CallBlock): no loop to break
      s->body = parse_body({"endgeneration"});
      loop_depth_ = saved;
      next();
      expect_block_end();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail(line, "'" + tag + "' outside of a for loop");
      expect_block_end();
      return make_stmt(tag == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue, line);
    }
    for (auto unsupported : kUnsupportedTags) {
      if (tag == unsupported) fail(line, "unsupported tag '" + tag + "'");
    }
    fail(line, "unknown tag '" + tag + "'");
  }

  std::unique_ptr<Stmt> parse_if(int line) {
    auto s = make_stmt(Stmt::Kind::kIf, line);
    s->conditions.push_back(parse_tuple(true));
    expect_block_end();
    while (true) {
      s->bodies.push_back(parse_body({"elif", "else", "endif"}));
      const std::string tag = next().text;
      if (tag == "elif") {
        s->conditions.push_back(parse_tuple(true));
        expect_block_end();
      } else if (tag == "else") {
        expect_block_end();
        s->else_body = parse_body({"endif"});
        next();
        expect_block_end();
        return s;
      } else {
        expect_block_end();
        return s;
      }
    }
  }

  std::unique_ptr<Stmt> parse_for(int line) {
    auto s = make_stmt(Stmt::Kind::kFor, line);
    parse_targets(*s, "in");
    next();  // in
    s->expr = parse_tuple(false);
    const size_t loop_references = loop_references_;
    if (at_name("if")) {
      next();
      s->condition = parse_expression(true);
    }
    if (at_name("recursive")) fail(peek().line, "unsupported: recursive for loops");
    expect_block_end();
    ++loop_depth_;
    s->body = parse_body({"endfor", "else"});
    --loop_depth_;
    s->uses_loop = loop_references_ != loop_references;
    if (next().text == "else") {
      expect_block_end();
      const int saved = loop_depth_;
      loop_depth_ = 0;  // break/continue in a for's else belong to an outer loop only
      s->else_body = parse_body({"endfor"});
      loop_depth_ = saved;
      next();
    }
    expect_block_end();
    return s;
  }

  // `a` or `a, b` (with optional parentheses), up to the keyword or `=`.
  void parse_targets(Stmt& s, std::string_view until) {
    const bool paren = at_op("(");
    if (paren) next();
    s.targets.push_back(expect_name());
    while (at_op(",")) {
      next();
      s.target_is_tuple = true;
      if ((until == "in" && at_name("in")) || at_op("=") || at_op(")")) break;
      s.targets.push_back(expect_name());
    }
    if (paren) expect_op(")");
    const bool ok = until == "in" ? at_name("in") : at_op("=") || at_op("|") || peek().type == TokenType::kBlockEnd;
    if (!ok) fail(peek().line, "expected '" + std::string(until) + "', got " + describe(peek()));
  }

  std::unique_ptr<Stmt> parse_set(int line) {
    if (peek().type == TokenType::kName && at_op(".", 1)) {
      auto s = make_stmt(Stmt::Kind::kSet, line);
      s->targets.push_back(next().text);
      next();
      s->text = expect_name();
      s->namespace_attr = true;
      expect_op("=");
      s->expr = parse_tuple(true);
      expect_block_end();
      return s;
    }
    auto s = make_stmt(Stmt::Kind::kSet, line);
    parse_targets(*s, "=");
    if (peek().type == TokenType::kBlockEnd) {
      if (s->target_is_tuple) fail(line, "a block set takes one name");
      next();
      s->kind = Stmt::Kind::kSetBlock;
      s->body = parse_body({"endset"});
      next();
      expect_block_end();
      return s;
    }
    if (at_op("|")) fail(line, "unsupported: filters on a block set");
    expect_op("=");
    s->expr = parse_tuple(true);
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_macro(int line) {
    auto s = make_stmt(Stmt::Kind::kMacro, line);
    s->text = expect_name();
    expect_op("(");
    while (!at_op(")")) {
      if (!s->params.empty()) expect_op(",");
      if (at_op(")")) break;
      MacroParam p;
      p.name = expect_name();
      if (at_op("=")) {
        next();
        p.default_value = parse_expression(true);
      } else if (std::any_of(s->params.begin(), s->params.end(), [](const auto& q) { return q.default_value != nullptr; })) {
        fail(line, "non-default argument follows default argument in macro '" + s->text + "'");
      }
      s->params.push_back(std::move(p));
    }
    next();
    expect_block_end();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_body({"endmacro"});
    loop_depth_ = saved;
    next();
    if (peek().type == TokenType::kName) next();  // {% endmacro name %}
    expect_block_end();
    return s;
  }

  int loop_depth_ = 0;  // for loops around the statement being parsed (break/continue need one)
};

}  // namespace

Template parse_template(std::string_view source) { return Parser(lex_template(source)).run(); }

}  // namespace roundpipe::models::detail
