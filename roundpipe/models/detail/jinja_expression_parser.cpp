#include "roundpipe/models/detail/jinja_expression_parser.h"

#include <memory>
#include <utility>

#include "roundpipe/models/detail/jinja_builtins.h"

namespace roundpipe::models::detail {

ExprPtr ExpressionParser::make_expr(Expr::Kind kind, int line) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->line = line;
  return e;
}

// parse_tuple: `a, b` without parentheses is a tuple.
ExprPtr ExpressionParser::parse_tuple(bool with_condexpr) {
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

bool ExpressionParser::tuple_ends() const {
  const Token& t = peek();
  return t.type == TokenType::kVarEnd || t.type == TokenType::kBlockEnd || at_op(")") || at_name("in") ||
         at_name("if");
}

ExprPtr ExpressionParser::parse_expression(bool with_condexpr) {
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

ExprPtr ExpressionParser::binary(std::string op, ExprPtr left, ExprPtr right, int line) {
  auto b = make_expr(Expr::Kind::kBinary, line);
  b->name = std::move(op);
  b->object = std::move(left);
  b->index = std::move(right);
  return b;
}

ExprPtr ExpressionParser::parse_or() {
  ExprPtr left = parse_and();
  while (at_name("or")) {
    const int line = next().line;
    left = binary("or", std::move(left), parse_and(), line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_and() {
  ExprPtr left = parse_not();
  while (at_name("and")) {
    const int line = next().line;
    left = binary("and", std::move(left), parse_not(), line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_not() {
  if (at_name("not")) {
    DepthGuard guard(*this);
    auto u = make_expr(Expr::Kind::kUnary, next().line);
    u->name = "not";
    u->object = parse_not();
    return u;
  }
  return parse_compare();
}

ExprPtr ExpressionParser::parse_compare() {
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

ExprPtr ExpressionParser::parse_math1() {
  ExprPtr left = parse_concat();
  while (at_op("+") || at_op("-")) {
    const Token& t = next();
    left = binary(t.text, std::move(left), parse_concat(), t.line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_concat() {
  ExprPtr left = parse_math2();
  while (at_op("~")) {
    const int line = next().line;
    left = binary("~", std::move(left), parse_math2(), line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_math2() {
  ExprPtr left = parse_pow();
  while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
    const Token& t = next();
    left = binary(t.text, std::move(left), parse_pow(), t.line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_pow() {
  ExprPtr left = parse_unary(true);
  while (at_op("**")) {
    const int line = next().line;
    left = binary("**", std::move(left), parse_unary(true), line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_unary(bool with_filter) {
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

ExprPtr ExpressionParser::parse_primary() {
  const Token& t = peek();
  switch (t.type) {
    case TokenType::kName: next(); return parse_name(t);
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
      if (t.text == "(" || t.text == "[" || t.text == "{") {
        next();
        if (t.text == "(") return parse_parenthesized(t.line);
        return t.text == "[" ? parse_list(t.line) : parse_dict(t.line);
      }
      break;
    default:
      break;
  }
  fail(t.line, "unexpected " + describe(t));
}

ExprPtr ExpressionParser::parse_name(const Token& t) {
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

ExprPtr ExpressionParser::parse_parenthesized(int line) {
  if (at_op(")")) {
    next();
    return make_expr(Expr::Kind::kTuple, line);
  }
  ExprPtr inner = parse_expression(true);
  if (at_op(",")) {
    auto tuple = make_expr(Expr::Kind::kTuple, line);
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

ExprPtr ExpressionParser::parse_list(int line) {
  auto list = make_expr(Expr::Kind::kList, line);
  while (!at_op("]")) {
    if (!list->items.empty()) expect_op(",");
    if (at_op("]")) break;
    list->items.push_back(parse_expression(true));
  }
  next();
  return list;
}

ExprPtr ExpressionParser::parse_dict(int line) {
  auto dict = make_expr(Expr::Kind::kDict, line);
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

ExprPtr ExpressionParser::parse_postfix(ExprPtr node) {
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

ExprPtr ExpressionParser::parse_subscript(ExprPtr node) {
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

void ExpressionParser::parse_arguments(Arguments& args) {
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

ExprPtr ExpressionParser::parse_call(ExprPtr node) {
  auto call = make_expr(Expr::Kind::kCall, peek().line);
  call->object = std::move(node);
  parse_arguments(call->args);
  return call;
}

ExprPtr ExpressionParser::parse_filter_expr(ExprPtr node) {
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
bool ExpressionParser::test_argument_follows() const {
  const Token& t = peek();
  if (t.type == TokenType::kString || t.type == TokenType::kInt || t.type == TokenType::kFloat) return true;
  if (t.type == TokenType::kOperator) return t.text == "(" || t.text == "[" || t.text == "{";
  if (t.type == TokenType::kName) {
    if (t.text == "is") fail(t.line, "You cannot chain multiple tests with is");
    return t.text != "else" && t.text != "or" && t.text != "and";
  }
  return false;
}

}  // namespace roundpipe::models::detail
