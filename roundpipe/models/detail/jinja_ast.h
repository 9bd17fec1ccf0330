// Syntax tree of the chat template engine (roundpipe/models/chat_template.h): expressions and
// statements of the Jinja subset the parser accepts (docs/models.md, "Chat templates"). Built by
// jinja_parser.cpp, evaluated by jinja_interpreter.cpp; immutable after parsing.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "roundpipe/models/detail/jinja_value.h"

namespace roundpipe::models::detail {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Arguments {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
};

struct Expr {
  enum class Kind {
    kLiteral,   // value
    kName,      // name
    kList,      // items
    kTuple,     // items
    kDict,      // items as key, value pairs: items[2k], items[2k+1]
    kAttr,      // object.name
    kItem,      // object[index]
    kSlice,     // object[items[0]:items[1]:items[2]] (null = omitted)
    kCall,      // object(args)
    kFilter,    // object | name(args)
    kTest,      // object is [not] name(args)
    kUnary,     // op: "-", "+", "not"; object
    kBinary,    // op; object (left), index (right)
    kCompare,   // object, then (ops[k], items[k]) in order
    kCondition, // items: then, condition, else (else may be null)
  };
  Kind kind;
  int line = 0;
  Value value;
  std::string name;  // kName, kAttr, kFilter, kTest; op for kUnary, kBinary
  ExprPtr object;
  ExprPtr index;
  std::vector<ExprPtr> items;
  std::vector<std::string> ops;
  Arguments args;
  bool negated = false;  // kTest: `is not`
};

struct Stmt;
using StmtList = std::vector<std::unique_ptr<Stmt>>;

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: no default
};

struct Stmt {
  enum class Kind {
    kData,        // text
    kOutput,      // {{ expr }}
    kIf,          // conditions[k] -> bodies[k]; else_body
    kFor,         // targets in expr [if condition]: body; else_body
    kSet,         // targets (or attr_object.attr) = expr
    kSetBlock,    // {% set name %} body {% endset %}
    kMacro,       // name(params): body
    kBreak,
    kContinue,
    kGeneration,  // {% generation %} body {% endgeneration %}
  };
  Kind kind;
  int line = 0;
  std::string text;  // kData; kMacro: name; kSet on a namespace: the attribute
  ExprPtr expr;      // kOutput, kFor (iterable), kSet (value)
  ExprPtr condition; // kFor: the `if` filter
  std::vector<ExprPtr> conditions;
  std::vector<StmtList> bodies;
  StmtList body;
  StmtList else_body;
  std::vector<std::string> targets;  // kFor, kSet, kSetBlock; kSet on a namespace: {namespace name}
  bool target_is_tuple = false;      // `for a, b in` / `set a, b =`
  bool namespace_attr = false;       // `set ns.attr =`
  bool uses_loop = false;            // kFor: the body or condition names `loop` (else none is built)
  std::vector<MacroParam> params;
};

/// A parsed template: the top-level statements.
struct Template {
  StmtList body;
};

}  // namespace roundpipe::models::detail
