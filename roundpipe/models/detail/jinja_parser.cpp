#include "roundpipe/models/detail/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "roundpipe/models/detail/jinja_builtins.h"
#include "roundpipe/models/detail/jinja_lexer.h"

namespace roundpipe::models::detail {
namespace {

// Deeper nesting (of brackets, operators or blocks) is refused rather than risking the stack.
constexpr int kMaxNesting = 100;

// Tags of jinja2 (or its extensions) that this engine does not implement: named in the error.
constexpr std::string_view kUnsupportedTags[] = {"extends", "block",      "include", "import", "from", "call",
                                                 "filter",  "with",       "do",      "autoescape", "trans",
                                                 "pluralize", "debug"};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Template run() {
    Template t;
    t.body = parse_body({});
    if (peek().type != TokenType::kEof) fail(peek().line, "unexpected tag");
    return t;
  }

 private:
  [[noreturn]] static void fail(int line, const std::string& what) {
    throw LocatedError(line, what);
  }

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
  void expect_block_end() {
    if (peek().type != TokenType::kBlockEnd) fail(peek().line, "expected end of statement block, got " +
                                                                   describe(peek()));
    next();
  }

  struct DepthGuard {
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxNesting) fail(p_.peek().line, "nested deeper than " + std::to_string(kMaxNesting));
    }
    ~DepthGuard() { --p_.depth_; }
    Parser& p_;
  };

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

  // ---- expressions (jinja2's Parser, same precedence) ----

  ExprPtr make_expr(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // parse_tuple: `a, b` without parentheses is a tuple.
  ExprPtr parse_tuple(bool with_condexpr) {
    const int line = peek().line;
    ExprPtr first = parse_expression(with_condexpr);
    if (!at_op(",")) return first;
    auto t = make_expr(Expr::Kind::kTuple, line);
    t->items.push_back(std::move(first));
    while (at_op(",")) {
      next();
      if (tuple_ends()) break;
      t->items.push_back(parse_expression(with_condexpr));
    }
    return t;
  }

  bool tuple_ends() const {
    const Token& t = peek();
    return t.type == TokenType::kVarEnd || t.type == TokenType::kBlockEnd || at_op(")") || at_name("in") ||
           at_name("if");
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this);
    if (!with_condexpr) return parse_or();
    const int line = peek().line;
    ExprPtr e = parse_or();
    while (at_name("if")) {
      next();
      auto c = make_expr(Expr::Kind::kCondition, line);
      ExprPtr condition = parse_or();
      ExprPtr otherwise;
      if (at_name("else")) {
        next();
        otherwise = parse_expression(true);
      }
      c->items.push_back(std::move(e));
      c->items.push_back(std::move(condition));
      c->items.push_back(std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(std::string op, ExprPtr left, ExprPtr right, int line) {
    auto b = make_expr(Expr::Kind::kBinary, line);
    b->name = std::move(op);
    b->object = std::move(left);
    b->index = std::move(right);
    return b;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (at_name("or")) {
      const int line = next().line;
      left = binary("or", std::move(left), parse_and(), line);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (at_name("and")) {
      const int line = next().line;
      left = binary("and", std::move(left), parse_not(), line);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (at_name("not")) {
      DepthGuard guard(*this);
      auto u = make_expr(Expr::Kind::kUnary, next().line);
      u->name = "not";
      u->object = parse_not();
      return u;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = peek().line;
    ExprPtr first = parse_math1();
    std::unique_ptr<Expr> c;
    while (true) {
      std::string op;
      if (peek().type == TokenType::kOperator &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == "<=" ||
           peek().text == ">" || peek().text == ">=")) {
        op = next().text;
      } else if (at_name("in")) {
        next();
        op = "in";
      } else if (at_name("not") && at_name("in", 1)) {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      if (!c) {
        c = make_expr(Expr::Kind::kCompare, line);
        c->object = std::move(first);
      }
      c->ops.push_back(op);
      c->items.push_back(parse_math1());
    }
    return c ? std::move(c) : std::move(first);
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (at_op("+") || at_op("-")) {
      const Token& t = next();
      left = binary(t.text, std::move(left), parse_concat(), t.line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (at_op("~")) {
      const int line = next().line;
      left = binary("~", std::move(left), parse_math2(), line);
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const Token& t = next();
      left = binary(t.text, std::move(left), parse_pow(), t.line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (at_op("**")) {
      const int line = next().line;
      left = binary("**", std::move(left), parse_unary(true), line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr node;
    if (at_op("-") || at_op("+")) {
      const Token& t = next();
      node = make_expr(Expr::Kind::kUnary, t.line);
      node->name = t.text;
      node->object = parse_unary(false);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = peek();
    switch (t.type) {
      case TokenType::kName: {
        next();
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          auto e = make_expr(Expr::Kind::kLiteral, t.line);
          e->value = Value::from_bool(t.text[0] == 't' || t.text[0] == 'T');
          return e;
        }
        if (t.text == "none" || t.text == "None") {
          auto e = make_expr(Expr::Kind::kLiteral, t.line);
          e->value = Value::none();
          return e;
        }
        auto e = make_expr(Expr::Kind::kName, t.line);
        e->name = t.text;
        loop_references_ += t.text == "loop";
        return e;
      }
      case TokenType::kString: {
        auto e = make_expr(Expr::Kind::kLiteral, t.line);
        std::string s;
        while (peek().type == TokenType::kString) s += next().text;  // adjacent literals concatenate
        e->value = Value::from_string(std::move(s));
        return e;
      }
      case TokenType::kInt:
      case TokenType::kFloat: {
        next();
        auto e = make_expr(Expr::Kind::kLiteral, t.line);
        e->value = t.type == TokenType::kInt ? Value::from_int(t.int_value) : Value::from_float(t.float_value);
        return e;
      }
      case TokenType::kOperator:
        if (t.text == "(") {
          next();
          if (at_op(")")) {
            next();
            return make_expr(Expr::Kind::kTuple, t.line);
          }
          ExprPtr inner = parse_expression(true);
          if (at_op(",")) {
            auto tuple = make_expr(Expr::Kind::kTuple, t.line);
            tuple->items.push_back(std::move(inner));
            while (at_op(",")) {
              next();
              if (at_op(")")) break;
              tuple->items.push_back(parse_expression(true));
            }
            inner = std::move(tuple);
          }
          expect_op(")");
          return inner;
        }
        if (t.text == "[") {
          next();
          auto list = make_expr(Expr::Kind::kList, t.line);
          while (!at_op("]")) {
            if (!list->items.empty()) expect_op(",");
            if (at_op("]")) break;
            list->items.push_back(parse_expression(true));
          }
          next();
          return list;
        }
        if (t.text == "{") {
          next();
          auto dict = make_expr(Expr::Kind::kDict, t.line);
          while (!at_op("}")) {
            if (!dict->items.empty()) expect_op(",");
            if (at_op("}")) break;
            dict->items.push_back(parse_expression(true));
            expect_op(":");
            dict->items.push_back(parse_expression(true));
          }
          next();
          return dict;
        }
        break;
      default:
        break;
    }
    fail(t.line, "unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (at_op(".")) {
        const int line = next().line;
        if (peek().type == TokenType::kInt) {
          auto item = make_expr(Expr::Kind::kItem, line);
          item->object = std::move(node);
          item->index = make_expr(Expr::Kind::kLiteral, line);
          item->index->value = Value::from_int(next().int_value);
          node = std::move(item);
          continue;
        }
        auto attr = make_expr(Expr::Kind::kAttr, line);
        attr->object = std::move(node);
        attr->name = expect_name();
        node = std::move(attr);
      } else if (at_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (at_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const int line = next().line;  // [
    ExprPtr parts[3];
    int colons = 0;
    while (!at_op("]")) {
      if (at_op(":")) {
        if (++colons > 2) fail(line, "too many ':' in a subscript");
        next();
        continue;
      }
      if (parts[colons]) fail(line, "expected ':' or ']' in a subscript");
      parts[colons] = parse_expression(true);
      if (colons == 0 && at_op(",")) fail(line, "unsupported: tuple subscripts");
    }
    next();
    if (colons == 0) {
      if (!parts[0]) fail(line, "empty subscript");
      auto item = make_expr(Expr::Kind::kItem, line);
      item->object = std::move(node);
      item->index = std::move(parts[0]);
      return item;
    }
    auto slice = make_expr(Expr::Kind::kSlice, line);
    slice->object = std::move(node);
    for (auto& p : parts) slice->items.push_back(std::move(p));
    return slice;
  }

  void parse_arguments(Arguments& args) {
    next();  // (
    while (!at_op(")")) {
      if (!args.positional.empty() || !args.keyword.empty()) expect_op(",");
      if (at_op(")")) break;
      if (at_op("*") || at_op("**")) fail(peek().line, "unsupported: *args / **kwargs in a call");
      if (peek().type == TokenType::kName && at_op("=", 1)) {
        std::string name = next().text;
        next();
        args.keyword.emplace_back(std::move(name), parse_expression(true));
      } else {
        if (!args.keyword.empty()) fail(peek().line, "positional argument follows keyword argument");
        args.positional.push_back(parse_expression(true));
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr node) {
    auto call = make_expr(Expr::Kind::kCall, peek().line);
    call->object = std::move(node);
    parse_arguments(call->args);
    return call;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (at_op("|")) {
        const int line = next().line;
        auto f = make_expr(Expr::Kind::kFilter, line);
        f->object = std::move(node);
        f->name = expect_name();
        while (at_op(".")) {  // dotted filter names are jinja2 syntax; none is defined here
          next();
          f->name += "." + expect_name();
        }
        if (!has_filter(f->name)) fail(line, "unsupported filter '" + f->name + "'");
        if (at_op("(")) parse_arguments(f->args);
        node = std::move(f);
      } else if (at_name("is")) {
        const int line = next().line;
        auto t = make_expr(Expr::Kind::kTest, line);
        t->object = std::move(node);
        if (at_name("not")) {
          next();
          t->negated = true;
        }
        t->name = expect_name();
        while (at_op(".")) {
          next();
          t->name += "." + expect_name();
        }
        if (!has_test(t->name)) fail(line, "unsupported test '" + t->name + "'");
        if (at_op("(")) {
          parse_arguments(t->args);
        } else if (test_argument_follows()) {
          ExprPtr arg = parse_primary();
          t->args.positional.push_back(parse_postfix(std::move(arg)));
        }
        node = std::move(t);
      } else if (at_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  // jinja2: `x is divisibleby 3` takes one argument without parentheses: any name but
  // else/or/and, a literal, or a bracket starts it.
  bool test_argument_follows() const {
    const Token& t = peek();
    if (t.type == TokenType::kString || t.type == TokenType::kInt || t.type == TokenType::kFloat) return true;
    if (t.type == TokenType::kOperator) return t.text == "(" || t.text == "[" || t.text == "{";
    if (t.type == TokenType::kName) {
      if (t.text == "is") fail(t.line, "You cannot chain multiple tests with is");
      return t.text != "else" && t.text != "or" && t.text != "and";
    }
    return false;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  size_t loop_references_ = 0;  // names `loop` parsed so far (a for loop builds its object only if used)
};

}  // namespace

Template parse_template(std::string_view source) { return Parser(lex_template(source)).run(); }

}  // namespace roundpipe::models::detail
