#include "roundpipe/models/detail/jinja_interpreter.h"

#include <algorithm>
#include <memory>
#include <string_view>
#include <unordered_map>

#include "roundpipe/models/detail/jinja_builtins.h"

namespace roundpipe::models::detail {
namespace {

// Note [Scopes]: jinja2 gives every for-loop iteration and every macro call a fresh scope whose
// parent is the enclosing one (a `set` inside a loop body is gone at the next iteration and
// after the loop); `if` opens none. A macro sees the scope it was defined in at call time (so a
// top-level `set` after the macro definition is visible). Frames are shared_ptrs; a macro value
// holds its defining frame weakly, since that frame holds the macro (no cycle).
struct Frame {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Frame> parent;
};
using FramePtr = std::shared_ptr<Frame>;

enum class Flow { kNormal, kBreak, kContinue };

class Interpreter {
 public:
  explicit Interpreter(const RenderInput& input) : input_(input) {
    globals_["range"] = Value::from_callable(global_range);
    globals_["namespace"] = Value::from_callable([this](CallArgs& args) {
      Value ns = global_namespace(args);
      namespaces_.push_back(ns.dict);
      return ns;
    });
    globals_["dict"] = Value::from_callable(global_dict);
    globals_["raise_exception"] = Value::from_callable([](CallArgs& args) -> Value {
      const Value* message = args.get(0, "message");
      args.check_all_used("raise_exception");
      throw RaiseException(message ? to_str(*message) : std::string());
    });
    globals_["strftime_now"] = Value::from_callable([this](CallArgs& args) { return strftime_now(args); });
  }

  // A namespace is the one mutable container, so `{% set ns.self = ns %}` makes a reference cycle
  // of shared_ptrs: emptying every namespace at the end of the render frees them.
  ~Interpreter() {
    for (const auto& ns : namespaces_) ns->items.clear();
  }
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  RenderOutput run(const Template& t) {
    auto root = std::make_shared<Frame>();
    exec_body(t.body, root);
    RenderOutput result;
    result.text = std::move(out_);
    result.generation_spans = std::move(spans_);
    return result;
  }

 private:
  Value strftime_now(CallArgs& args) {
    const Value* format = args.get(0, "format");
    args.check_all_used("strftime_now");
    if (format == nullptr || !format->is_string()) throw JinjaError("strftime_now(format): format must be a str");
    if (format->string.find('\0') != std::string::npos) throw JinjaError("strftime_now: embedded null character");
    // Python's datetime.strftime expands these itself; C's strftime does not.
    for (const char* python_only : {"%f", "%:z"}) {
      if (format->string.find(python_only) != std::string::npos) {
        throw JinjaError(std::string("strftime_now: ") + python_only + " is not supported");
      }
    }
    const std::time_t now = input_.now ? *input_.now : std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    if (format->string.empty()) return Value::from_string("");
    for (size_t size = 256; size <= 65536; size *= 4) {
      std::string buf(size, '\0');
      const size_t n = std::strftime(buf.data(), buf.size(), format->string.c_str(), &tm);
      if (n > 0) return Value::from_string(buf.substr(0, n));
    }
    throw JinjaError("strftime_now: the formatted date is empty or too long");
  }

  Value lookup(const std::string& name, const FramePtr& frame) const {
    for (const Frame* f = frame.get(); f != nullptr; f = f->parent.get()) {
      const auto it = f->vars.find(name);
      if (it != f->vars.end()) return it->second;
    }
    if (input_.variables) {
      if (const Value* v = input_.variables->find(std::string_view(name))) return *v;
    }
    const auto it = globals_.find(name);
    if (it != globals_.end()) return it->second;
    return Value::undefined("'" + name + "' is undefined");
  }

  void write(std::string_view text) {
    if (out_.size() + text.size() > kMaxOutputBytes) {
      throw JinjaError("the output exceeds " + std::to_string(kMaxOutputBytes) + " bytes");
    }
    out_ += text;
  }

  void step() {
    if (++steps_ > kMaxSteps) throw JinjaError("the render exceeds " + std::to_string(kMaxSteps) + " steps");
  }

  Flow exec_body(const StmtList& body, const FramePtr& frame) {
    for (const auto& stmt : body) {
      const Flow flow = exec(*stmt, frame);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s, const FramePtr& frame) {
    try {
      step();
      return exec_inner(s, frame);
    } catch (const LocatedError&) {
      throw;
    } catch (const RaiseException& e) {
      throw LocatedError(s.line, e.what(), true);
    } catch (const JinjaError& e) {
      throw LocatedError(s.line, e.what());
    }
  }

  Flow exec_inner(const Stmt& s, const FramePtr& frame) {
    switch (s.kind) {
      case Stmt::Kind::kData: write(s.text); return Flow::kNormal;
      case Stmt::Kind::kOutput: write(to_str(eval(*s.expr, frame))); return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (size_t i = 0; i < s.conditions.size(); ++i) {
          if (truthy(eval(*s.conditions[i], frame))) return exec_body(s.bodies[i], frame);
        }
        return exec_body(s.else_body, frame);
      case Stmt::Kind::kFor: return exec_for(s, frame);
      case Stmt::Kind::kSet: exec_set(s, frame); return Flow::kNormal;
      case Stmt::Kind::kSetBlock: {
        // jinja2 inlines the block: a break/continue in it leaves the enclosing loop unassigned.
        Flow flow = Flow::kNormal;
        std::string text = capture(s.body, frame, &flow);
        if (flow == Flow::kNormal) frame->vars[s.targets[0]] = Value::from_string(std::move(text));
        return flow;
      }
      case Stmt::Kind::kMacro: define_macro(s, frame); return Flow::kNormal;
      case Stmt::Kind::kBreak: return Flow::kBreak;
      case Stmt::Kind::kContinue: return Flow::kContinue;
      case Stmt::Kind::kGeneration: {
        // transformers takes the span from the text yielded so far: inside a macro or a block set
        // (rendered into a buffer) or another generation block its offsets would be meaningless.
        if (capture_depth_ > 0 || in_generation_) {
          throw JinjaError("unsupported: {% generation %} inside a macro, a block set or another generation block");
        }
        const size_t begin = out_.size();
        in_generation_ = true;
        // The body is jinja2's `caller()`: a scope of its own (a `set` inside is gone after it).
        auto body_frame = std::make_shared<Frame>();
        body_frame->parent = frame;
        exec_body(s.body, body_frame);
        in_generation_ = false;
        spans_.emplace_back(begin, out_.size());
        return Flow::kNormal;
      }
    }
    return Flow::kNormal;
  }

  // Renders `body` into a string of its own (a macro call or a block set); `flow` receives a
  // break/continue that ended it.
  std::string capture(const StmtList& body, const FramePtr& frame, Flow* flow = nullptr) {
    std::string saved = std::move(out_);
    out_.clear();
    ++capture_depth_;
    try {
      const Flow f = exec_body(body, frame);
      if (flow != nullptr) *flow = f;
    } catch (...) {
      --capture_depth_;
      out_ = std::move(saved);
      throw;
    }
    --capture_depth_;
    std::string result = std::move(out_);
    out_ = std::move(saved);
    return result;
  }

  void assign_targets(const Stmt& s, Frame& frame, const Value& value) {
    if (!s.target_is_tuple) {
      frame.vars[s.targets[0]] = value;
      return;
    }
    const ValueList items = iterate(value);
    if (items.size() != s.targets.size()) {
      throw JinjaError((items.size() < s.targets.size() ? "not enough values to unpack (expected "
                                                        : "too many values to unpack (expected ") +
                       std::to_string(s.targets.size()) + ", got " + std::to_string(items.size()) + ")");
    }
    for (size_t i = 0; i < items.size(); ++i) frame.vars[s.targets[i]] = items[i];
  }

  void exec_set(const Stmt& s, const FramePtr& frame) {
    Value value = eval(*s.expr, frame);
    if (!s.namespace_attr) {
      assign_targets(s, *frame, value);
      return;
    }
    const Value ns = lookup(s.targets[0], frame);
    if (ns.kind != Value::Kind::kNamespace) {
      throw JinjaError("cannot assign attribute on non-namespace object '" + s.targets[0] + "'");
    }
    if (!s.text.empty() && s.text[0] == '_') {
      throw JinjaError("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + s.text +
                       "'");
    }
    ns.dict->set(Value::from_string(s.text), std::move(value));
  }

  Flow exec_for(const Stmt& s, const FramePtr& frame) {
    ValueList items = iterate(eval(*s.expr, frame));
    if (s.condition) {  // `for x in xs if cond`: the loop (and loop.length) sees the kept items only
      ValueList kept;
      for (const Value& item : items) {
        step();
        auto probe = std::make_shared<Frame>();
        probe->parent = frame;
        assign_targets(s, *probe, item);
        if (truthy(eval(*s.condition, probe))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec_body(s.else_body, frame);
    const auto n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      step();
      auto iteration = std::make_shared<Frame>();
      iteration->parent = frame;
      assign_targets(s, *iteration, items[static_cast<size_t>(i)]);
      if (s.uses_loop) iteration->vars["loop"] = loop_object(items, i);
      const Flow flow = exec_body(s.body, iteration);
      if (flow == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  static Value loop_object(const ValueList& items, int64_t i) {
    const auto n = static_cast<int64_t>(items.size());
    ValueDict loop;
    const auto set = [&](const char* key, Value v) { loop.items.emplace_back(Value::from_string(key), std::move(v)); };
    set("index0", Value::from_int(i));
    set("index", Value::from_int(i + 1));
    set("revindex0", Value::from_int(n - i - 1));
    set("revindex", Value::from_int(n - i));
    set("first", Value::from_bool(i == 0));
    set("last", Value::from_bool(i == n - 1));
    set("length", Value::from_int(n));
    set("depth", Value::from_int(1));
    set("depth0", Value::from_int(0));
    if (i > 0) set("previtem", items[static_cast<size_t>(i - 1)]);
    if (i + 1 < n) set("nextitem", items[static_cast<size_t>(i + 1)]);
    set("cycle", Value::from_callable([i](CallArgs& args) -> Value {
      if (args.positional.empty()) throw JinjaError("no items for cycling given");
      if (!args.keyword.empty()) throw JinjaError("loop.cycle takes no keyword arguments");
      return args.positional[static_cast<size_t>(i) % args.positional.size()];
    }));
    return Value::from_dict(std::move(loop));
  }

  void define_macro(const Stmt& s, const FramePtr& frame) {
    std::weak_ptr<Frame> definition = frame;
    const Stmt* macro = &s;
    frame->vars[s.text] = Value::from_callable(
        [this, macro, definition](CallArgs& args) { return call_macro(*macro, definition, args); });
  }

  Value call_macro(const Stmt& m, const std::weak_ptr<Frame>& definition, CallArgs& args) {
    FramePtr parent = definition.lock();
    if (!parent) throw JinjaError("macro '" + m.text + "' called after its scope ended");
    if (call_depth_ >= kMaxCallDepth) {
      throw JinjaError("macro calls nested deeper than " + std::to_string(kMaxCallDepth) + " (recursion?)");
    }
    if (args.positional.size() > m.params.size()) {
      throw JinjaError("macro '" + m.text + "' takes not more than " + std::to_string(m.params.size()) +
                       " argument(s)");
    }
    auto frame = std::make_shared<Frame>();
    frame->parent = parent;
    for (size_t i = 0; i < m.params.size(); ++i) {
      const MacroParam& p = m.params[i];
      const Value* given = args.get(i, p.name);
      if (given) {
        frame->vars[p.name] = *given;
      } else if (p.default_value) {
        frame->vars[p.name] = eval(*p.default_value, frame);
      } else {
        frame->vars[p.name] = Value::undefined("parameter '" + p.name + "' was not provided");
      }
    }
    for (const auto& keyword : args.keyword) {
      const std::string& name = keyword.first;
      const bool known = std::any_of(m.params.begin(), m.params.end(), [&](const MacroParam& p) { return p.name == name; });
      if (!known) throw JinjaError("macro '" + m.text + "' takes no keyword argument '" + name + "'");
    }
    ++call_depth_;
    struct Depth {
      int& d;
      ~Depth() { --d; }
    } depth{call_depth_};
    return Value::from_string(capture(m.body, frame));
  }

  CallArgs eval_args(const Arguments& a, const FramePtr& frame) {
    CallArgs args;
    for (const auto& e : a.positional) args.positional.push_back(eval(*e, frame));
    for (const auto& [name, e] : a.keyword) args.keyword.emplace_back(name, eval(*e, frame));
    return args;
  }

  static Value call_value(const Value& callee, CallArgs& args) {
    if (callee.kind == Value::Kind::kCallable) return (*callee.callable)(args);
    if (callee.is_undefined()) throw JinjaError(callee.string.empty() ? "undefined value called" : callee.string);
    throw JinjaError("'" + type_name(callee) + "' object is not callable");
  }

  Value eval(const Expr& e, const FramePtr& frame) {
    try {
      return eval_inner(e, frame);
    } catch (const LocatedError&) {
      throw;
    } catch (const RaiseException& err) {
      throw LocatedError(e.line, err.what(), true);
    } catch (const JinjaError& err) {
      throw LocatedError(e.line, err.what());
    }
  }

  Value eval_inner(const Expr& e, const FramePtr& frame) {
    switch (e.kind) {
      case Expr::Kind::kLiteral: return e.value;
      case Expr::Kind::kName: return lookup(e.name, frame);
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        ValueList items;
        for (const auto& item : e.items) items.push_back(eval(*item, frame));
        return Value::from_list(std::move(items), e.kind == Expr::Kind::kTuple);
      }
      case Expr::Kind::kDict: {
        ValueDict d;
        for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
          Value key = eval(*e.items[i], frame);
          check_hashable(key);
          d.set(std::move(key), eval(*e.items[i + 1], frame));
        }
        return Value::from_dict(std::move(d));
      }
      case Expr::Kind::kAttr: return get_attr(eval(*e.object, frame), e.name);
      case Expr::Kind::kItem: return get_item(eval(*e.object, frame), eval(*e.index, frame));
      case Expr::Kind::kSlice: {
        const Value obj = eval(*e.object, frame);
        Value bounds[3];
        const Value* p[3] = {nullptr, nullptr, nullptr};
        for (int i = 0; i < 3; ++i) {
          if (e.items[static_cast<size_t>(i)]) {
            bounds[i] = eval(*e.items[static_cast<size_t>(i)], frame);
            p[i] = &bounds[i];
          }
        }
        return get_slice(obj, p[0], p[1], p[2]);
      }
      case Expr::Kind::kCall: {
        if (e.object->kind == Expr::Kind::kAttr) {
          const Value obj = eval(*e.object->object, frame);
          CallArgs args = eval_args(e.args, frame);
          if (has_method(obj, e.object->name)) return call_method(obj, e.object->name, args);
          return call_value(get_attr(obj, e.object->name), args);
        }
        const Value callee = eval(*e.object, frame);
        CallArgs args = eval_args(e.args, frame);
        return call_value(callee, args);
      }
      case Expr::Kind::kFilter: {
        const Value value = eval(*e.object, frame);
        CallArgs args = eval_args(e.args, frame);
        return apply_filter(e.name, value, args);
      }
      case Expr::Kind::kTest: {
        const Value value = eval(*e.object, frame);
        CallArgs args = eval_args(e.args, frame);
        return Value::from_bool(apply_test(e.name, value, args) != e.negated);
      }
      case Expr::Kind::kUnary: return unary_op(e.name, eval(*e.object, frame));
      case Expr::Kind::kBinary: {
        if (e.name == "and" || e.name == "or") {
          Value left = eval(*e.object, frame);
          if (truthy(left) == (e.name == "or")) return left;
          return eval(*e.index, frame);
        }
        const Value left = eval(*e.object, frame);
        return binary_op(e.name, left, eval(*e.index, frame));
      }
      case Expr::Kind::kCompare: {
        Value left = eval(*e.object, frame);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.items[i], frame);
          if (!compare(e.ops[i], left, right)) return Value::from_bool(false);
          left = std::move(right);
        }
        return Value::from_bool(true);
      }
      case Expr::Kind::kCondition:
        if (truthy(eval(*e.items[1], frame))) return eval(*e.items[0], frame);
        if (e.items[2]) return eval(*e.items[2], frame);
        return Value::undefined("the inline if-expression evaluated to false and no else section was defined");
    }
    return Value::undefined();
  }

  static bool compare(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "in") return contains(b, a);
    if (op == "not in") return !contains(b, a);
    if (a.is_undefined()) throw JinjaError(a.string.empty() ? "undefined value compared" : a.string);
    if (b.is_undefined()) throw JinjaError(b.string.empty() ? "undefined value compared" : b.string);
    if (op == "<") return less(a, b);
    if (op == ">") return less(b, a);
    if (op == "<=") return less(a, b) || equals(a, b);
    return less(b, a) || equals(a, b);
  }

  const RenderInput& input_;
  std::unordered_map<std::string, Value> globals_;
  std::string out_;  // the text being rendered (a macro call or block set swaps in its own)
  std::vector<std::pair<size_t, size_t>> spans_;
  std::vector<std::shared_ptr<ValueDict>> namespaces_;  // every namespace() made by this render
  int capture_depth_ = 0;
  bool in_generation_ = false;
  size_t steps_ = 0;
  int call_depth_ = 0;
};

}  // namespace

RenderOutput render_template(const Template& tmpl, const RenderInput& input) { return Interpreter(input).run(tmpl); }

}  // namespace roundpipe::models::detail
