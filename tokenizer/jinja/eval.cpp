// The evaluator: walks the syntax tree with Jinja2's scoping and Python's semantics, and the
// Template API (jinja.h).
//
// Scopes as Jinja compiles them: the context's variables and top-level {% set %} share the
// root scope; each iteration of a for loop, a macro call, a {% with %} block and a block set's
// body gets a child scope, so that what they set is gone after them (a namespace is the way to
// carry state out of a loop). {% if %} opens no scope.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_map>

#include "tokenizer/jinja/jinja.h"
#include "tokenizer/jinja/ast.h"
#include "tokenizer/jinja/builtins.h"

namespace kestrel::jinja {
namespace {

struct Scope {
  std::shared_ptr<Scope> parent;
  std::unordered_map<std::string, Value> vars;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get()) {
      const auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using ScopePtr = std::shared_ptr<Scope>;

ScopePtr child(const ScopePtr& parent) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  return s;
}

// What a statement tells the loop around it.
enum class Flow { next, break_loop, continue_loop };

[[noreturn]] void overflow() {
  throw EvalError("integer overflow (Python's integers are unbounded, these are 64-bit)");
}

template <typename Op>
int64_t checked(Op op, int64_t x, int64_t y) {
  int64_t r = 0;
  if (op(x, y, &r)) overflow();
  return r;
}
constexpr auto kAdd = [](int64_t x, int64_t y, int64_t* r) {
  return __builtin_add_overflow(x, y, r);
};
constexpr auto kSub = [](int64_t x, int64_t y, int64_t* r) {
  return __builtin_sub_overflow(x, y, r);
};
constexpr auto kMul = [](int64_t x, int64_t y, int64_t* r) {
  return __builtin_mul_overflow(x, y, r);
};

// Python's arithmetic on numbers (bool counts as int): int op int stays int except for /.
Value arithmetic(const std::string& op, const Value& a, const Value& b) {
  const bool floats = a.is_float() || b.is_float();
  if (op == "/") {
    if (b.as_float() == 0) throw EvalError("division by zero");
    return Value(a.as_float() / b.as_float());
  }
  if (floats) {
    const double x = a.as_float(), y = b.as_float();
    if (op == "+") return Value(x + y);
    if (op == "-") return Value(x - y);
    if (op == "*") return Value(x * y);
    if (op == "**") {
      if (x == 0 && y < 0) throw EvalError("0.0 cannot be raised to a negative power");
      return Value(std::pow(x, y));
    }
    if (y == 0) throw EvalError(op == "//" ? "float floor division by zero" : "float modulo");
    if (op == "//") return Value(std::floor(x / y));
    double r = std::fmod(x, y);  // Python's %: the sign of the divisor
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    return Value(r);
  }
  const int64_t x = a.as_int(), y = b.as_int();
  if (op == "+") return Value(checked(kAdd, x, y));
  if (op == "-") return Value(checked(kSub, x, y));
  if (op == "*") return Value(checked(kMul, x, y));
  if (op == "**") {
    if (y < 0) {
      if (x == 0) throw EvalError("0.0 cannot be raised to a negative power");
      return Value(std::pow(static_cast<double>(x), static_cast<double>(y)));
    }
    int64_t result = 1, base = x;
    for (int64_t e = y; e > 0; e >>= 1) {
      if (e & 1) result = checked(kMul, result, base);
      if (e > 1) base = checked(kMul, base, base);
    }
    return Value(result);
  }
  if (y == 0)
    throw EvalError(op == "//" ? "integer division or modulo by zero" : "integer modulo by zero");
  int64_t q = x / y, m = x % y;
  if (m != 0 && ((m < 0) != (y < 0))) {  // Python floors; C++ truncates
    --q;
    m += y;
  }
  return Value(op == "//" ? q : m);
}

// What a template may make the renderer do: chat templates render in thousands of steps into
// kilobytes; these bounds turn a template that loops, recurses or grows without end into an
// error instead of a hang, a crash or gigabytes.
constexpr int64_t kMaxSteps = 2'000'000;         // statements executed
constexpr size_t kMaxOutput = size_t(64) << 20;  // bytes of any one rendered text or value
constexpr int kMaxCallDepth = 200;               // macros calling macros

Value repeat(const Value& seq, int64_t n) {
  const size_t unit = seq.is_string() ? seq.as_string().size() : seq.as_list().items.size();
  if (n > 0 && unit > 0 && (uint64_t)n > kMaxOutput / unit)
    throw EvalError(fmt::format("repeating {} items {} times passes the renderer's bound", unit, n));
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += seq.as_string();
    return Value(std::move(out));
  }
  std::vector<Value> out;
  for (int64_t i = 0; i < n; ++i)
    out.insert(out.end(), seq.as_list().items.begin(), seq.as_list().items.end());
  return make_list(std::move(out), seq.is_tuple());
}

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value(to_str(a) + to_str(b));  // Undefined concatenates as ""
  if (op == "%" && a.is_string()) return Value(percent_format(a.as_string(), b));
  require_defined(a);
  require_defined(b);
  if (a.is_number() && b.is_number()) return arithmetic(op, a, b);
  const auto sequence = [](const Value& v) {
    return v.is_string() || (v.is_list() && !v.is_iterator());
  };
  if (op == "+") {
    if (a.is_string() && b.is_string()) return Value(a.as_string() + b.as_string());
    if (a.is_list() && b.is_list() && !a.is_iterator() && !b.is_iterator() &&
        a.is_tuple() == b.is_tuple()) {
      std::vector<Value> items = a.as_list().items;
      items.insert(items.end(), b.as_list().items.begin(), b.as_list().items.end());
      return make_list(std::move(items), a.is_tuple());
    }
    if (sequence(a))
      throw EvalError(fmt::format("can only concatenate {} (not \"{}\") to {}", type_name(a),
                                  type_name(b), type_name(a)));
  }
  if (op == "*") {
    if (sequence(a) && (b.is_int() || b.is_bool())) return repeat(a, b.as_int());
    if (sequence(b) && (a.is_int() || a.is_bool())) return repeat(b, a.as_int());
  }
  throw EvalError(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a),
                              type_name(b)));
}

bool compare_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return equals(a, b);
  if (op == "!=") return !equals(a, b);
  if (op == "in") return contains(b, a);
  if (op == "notin") return !contains(b, a);
  const int c = compare(a, b);
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  return c >= 0;
}

class Interpreter {
 public:
  Interpreter() = default;
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;
  // A render can tie shared_ptr cycles: a macro holds the scope it was defined in, which holds
  // the macro; a namespace can be given itself ({% set ns.me = ns %}); loop.changed keeps the
  // values it was last called with, which can be the loop object that holds it. Nothing reads
  // them once the render is over (or has failed), so they are cut here; otherwise each such
  // render would leak its scopes, the context's values among them.
  ~Interpreter() {
    for (const ScopePtr& s : closures_) s->vars.clear();
    for (auto& [ptr, ns] : namespaces_) ns.as_namespace().attrs.items.clear();
    for (const auto& c : changed_) c->reset();
  }

  std::string render(const Program& program, const ScopePtr& root) {
    std::string out;
    exec(program.body, root, out);
    return out;
  }

 private:
  // ---- statements ----

  Flow exec(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const auto& n : body) {
      if (++steps_ > kMaxSteps)
        throw Error(located(n->pos, fmt::format("the template ran more than {} steps (a loop "
                                                "that does not end?)", kMaxSteps)));
      const Flow f = exec(*n, scope, out);
      if (out.size() > kMaxOutput)
        throw Error(located(n->pos, fmt::format("the template's output passed {} MiB",
                                                kMaxOutput >> 20)));
      if (f != Flow::next) return f;
    }
    return Flow::next;
  }

  int64_t steps_ = 0;
  int call_depth_ = 0;
  // What may sit in a cycle, cut by the destructor: the scopes macros were defined in, the
  // namespaces assigned to, the state of each loop's loop.changed.
  std::vector<ScopePtr> closures_;
  std::unordered_map<const Namespace*, Value> namespaces_;
  std::vector<std::shared_ptr<std::optional<std::vector<Value>>>> changed_;

  Flow exec(const Node& n, const ScopePtr& scope, std::string& out) {
    try {
      return exec_node(n, scope, out);
    } catch (const RaisedError& e) {
      throw TemplateException(e.message, located(n.pos, "raise_exception: " + e.message));
    } catch (const EvalError& e) {
      throw Error(located(n.pos, e.what()));
    }
  }

  Flow exec_node(const Node& n, const ScopePtr& scope, std::string& out) {
    switch (n.kind) {
      case Node::Kind::text:
        out += n.text;
        return Flow::next;
      case Node::Kind::output:
        out += to_str(eval(*n.expr, scope));
        return Flow::next;
      case Node::Kind::if_:
        for (size_t i = 0; i < n.conditions.size(); ++i)
          if (truthy(eval(*n.conditions[i], scope))) return exec(n.bodies[i], scope, out);
        return exec(n.otherwise, scope, out);
      case Node::Kind::for_:
        for_loop(n, scope, out);
        return Flow::next;
      case Node::Kind::set: {
        Value v;
        if (n.expr) {
          v = eval(*n.expr, scope);
        } else {
          std::string body;
          exec(n.body, child(scope), body);
          v = n.filter ? filter_chain(*n.filter, Value(std::move(body)), scope)
                       : Value(std::move(body));
        }
        assign(n.target, v, scope);
        return Flow::next;
      }
      case Node::Kind::macro:
        scope->vars[n.text] = macro("macro '" + n.text + "'", n.params, n.body, scope);
        return Flow::next;
      case Node::Kind::call_block: {
        const Expr& call = *n.expr;
        Value callee = eval(*call.object, scope);
        Args args = eval_args(call.args, scope);
        args.keyword.emplace_back("caller", macro("caller", n.params, n.body, scope));
        out += to_str(invoke(call, callee, args));
        return Flow::next;
      }
      case Node::Kind::filter: {
        std::string body;
        exec(n.body, child(scope), body);
        out += to_str(filter_chain(*n.filter, Value(std::move(body)), scope));
        return Flow::next;
      }
      case Node::Kind::with: {
        ScopePtr inner = child(scope);
        for (size_t i = 0; i < n.targets.size(); ++i)
          assign(n.targets[i], eval(*n.values[i], scope), inner);
        return exec(n.body, inner, out);
      }
      case Node::Kind::break_:
        return Flow::break_loop;
      case Node::Kind::continue_:
        return Flow::continue_loop;
      case Node::Kind::generation:
        return exec(n.body, scope, out);
    }
    return Flow::next;
  }

  void for_loop(const Node& n, const ScopePtr& scope, std::string& out) {
    std::vector<Value> items = iterate(eval(*n.expr, scope));
    if (n.filter) {  // for x in xs if cond: the loop sees only the items that pass
      std::vector<Value> kept;
      for (auto& item : items) {
        ScopePtr s = child(scope);
        assign(n.target, item, s);
        if (truthy(eval(*n.filter, s))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    auto last_changed = std::make_shared<std::optional<std::vector<Value>>>();
    changed_.push_back(last_changed);
    for (size_t i = 0; i < items.size(); ++i) {
      ScopePtr s = child(scope);
      assign(n.target, items[i], s);
      s->vars["loop"] = loop_object(items, i, last_changed);
      if (exec(n.body, s, out) == Flow::break_loop) break;
    }
    if (items.empty()) exec(n.otherwise, child(scope), out);
  }

  static Value loop_object(const std::vector<Value>& items, size_t i,
                           const std::shared_ptr<std::optional<std::vector<Value>>>& last_changed) {
    const auto n = static_cast<int64_t>(items.size());
    const auto k = static_cast<int64_t>(i);
    Dict d;
    d.set("index", Value(k + 1));
    d.set("index0", Value(k));
    d.set("revindex", Value(n - k));
    d.set("revindex0", Value(n - k - 1));
    d.set("first", Value(k == 0));
    d.set("last", Value(k == n - 1));
    d.set("length", Value(n));
    d.set("depth", Value(1));
    d.set("depth0", Value(0));
    d.set("previtem", k > 0 ? items[i - 1] : Value::undefined("there is no previous item"));
    d.set("nextitem", k + 1 < n ? items[i + 1] : Value::undefined("there is no next item"));
    d.set("cycle", make_callable("loop.cycle", [k](Args& a) {
            if (a.positional.empty()) throw EvalError("no items for cycling given");
            return a.positional[k % static_cast<int64_t>(a.positional.size())];
          }));
    d.set("changed", make_callable("loop.changed", [last_changed](Args& a) {
            if (*last_changed && last_changed->value().size() == a.positional.size() &&
                std::equal(a.positional.begin(), a.positional.end(), last_changed->value().begin(),
                           equals))
              return Value(false);
            *last_changed = a.positional;
            return Value(true);
          }));
    return make_dict(std::move(d));
  }

  void assign(const Target& t, const Value& v, const ScopePtr& scope) {
    if (!t.attribute.empty()) {
      const Value* ns = scope->find(t.names[0]);
      if (!ns || !ns->is_namespace())
        throw EvalError(fmt::format("cannot assign attribute on non-namespace object ('{}' is {})",
                                    t.names[0], ns ? type_name(*ns) : "undefined"));
      namespaces_.try_emplace(&ns->as_namespace(), *ns);
      ns->as_namespace().attrs.set(t.attribute, v);
      return;
    }
    if (!t.unpack) {
      scope->vars[t.names[0]] = v;
      return;
    }
    if (!v.is_list() && !v.is_string() && !v.is_dict())
      throw EvalError(fmt::format("cannot unpack non-iterable {} object", type_name(v)));
    const auto items = iterate(v);
    if (items.size() != t.names.size())
      throw EvalError(items.size() > t.names.size()
                          ? fmt::format("too many values to unpack (expected {})", t.names.size())
                          : fmt::format("not enough values to unpack (expected {}, got {})",
                                        t.names.size(), items.size()));
    for (size_t i = 0; i < items.size(); ++i) scope->vars[t.names[i]] = items[i];
  }

  // A macro (or a call block's caller): its parameters bound from the call, positional then
  // by name then defaults (evaluated at the call, seeing the parameters before them); extra
  // arguments land in varargs and kwargs.
  Value macro(std::string name, const std::vector<Param>& params, const Body& body,
              const ScopePtr& defined_in) {
    if (closures_.empty() || closures_.back() != defined_in) closures_.push_back(defined_in);
    return make_callable(name, [this, &params, &body, defined_in](Args& a) {
      if (call_depth_ >= kMaxCallDepth)
        throw EvalError(fmt::format("macros call each other more than {} deep (a recursion "
                                    "that does not end?)", kMaxCallDepth));
      ++call_depth_;
      struct Leave {
        int& depth;
        ~Leave() { --depth; }
      } leave{call_depth_};
      ScopePtr s = child(defined_in);
      std::vector<bool> used(a.keyword.size(), false);
      for (size_t i = 0; i < params.size(); ++i) {
        const Param& p = params[i];
        const Value* v = i < a.positional.size() ? &a.positional[i] : nullptr;
        for (size_t k = 0; !v && k < a.keyword.size(); ++k) {
          if (a.keyword[k].first == p.name) {
            v = &a.keyword[k].second;
            used[k] = true;
          }
        }
        s->vars[p.name] =
            v ? *v
            : p.default_value
                ? eval(*p.default_value, s)
                : Value::undefined(fmt::format("parameter '{}' was not provided", p.name));
      }
      std::vector<Value> varargs;
      for (size_t i = params.size(); i < a.positional.size(); ++i)
        varargs.push_back(a.positional[i]);
      Dict kwargs;
      for (size_t k = 0; k < a.keyword.size(); ++k) {
        if (used[k]) continue;
        if (a.keyword[k].first == "caller")
          s->vars["caller"] = a.keyword[k].second;
        else
          kwargs.set(a.keyword[k].first, a.keyword[k].second);
      }
      s->vars["varargs"] = make_list(std::move(varargs), true);
      s->vars["kwargs"] = make_dict(std::move(kwargs));
      std::string out;
      exec(body, s, out);
      return Value(std::move(out));
    });
  }

  // ---- expressions ----

  Value eval(const Expr& e, const ScopePtr& scope) {
    try {
      return eval_expr(e, scope);
    } catch (const RaisedError& r) {
      throw TemplateException(r.message, located(e.pos, "raise_exception: " + r.message));
    } catch (const EvalError& err) {
      throw Error(located(e.pos, err.what()));
    }
  }

  Value invoke(const Expr& at, const Value& callee, Args& args) {
    try {
      require_defined(callee);
      if (!callee.is_callable())
        throw EvalError(fmt::format("'{}' object is not callable", type_name(callee)));
      return callee.as_callable().call(args);
    } catch (const RaisedError& r) {
      throw TemplateException(r.message, located(at.pos, "raise_exception: " + r.message));
    } catch (const EvalError& err) {
      throw Error(located(at.pos, err.what()));
    }
  }

  Args eval_args(const CallArgs& c, const ScopePtr& scope) {
    Args a;
    for (const auto& p : c.positional) a.positional.push_back(eval(*p, scope));
    if (c.star)
      for (auto& v : iterate(eval(*c.star, scope))) a.positional.push_back(std::move(v));
    for (const auto& [k, p] : c.keyword) a.keyword.emplace_back(k, eval(*p, scope));
    if (c.star_star) {
      const Value d = eval(*c.star_star, scope);
      if (!d.is_dict())
        throw EvalError(fmt::format("argument after ** must be a mapping, not {}", type_name(d)));
      for (const auto& kv : d.as_dict().items) a.keyword.push_back(kv);
    }
    return a;
  }

  // A filter chain whose innermost operand is `operand` ({% filter %} and block {% set %}).
  Value filter_chain(const Expr& f, Value operand, const ScopePtr& scope) {
    if (f.object) operand = filter_chain(*f.object, std::move(operand), scope);
    const Args args = eval_args(f.args, scope);
    try {
      return apply_filter(f.name, operand, args);
    } catch (const EvalError& err) {
      throw Error(located(f.pos, err.what()));
    }
  }

  Value eval_expr(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case Expr::Kind::literal:
        return e.value;
      case Expr::Kind::name: {
        const Value* v = scope->find(e.name);
        return v ? *v : Value::undefined(fmt::format("'{}' is undefined", e.name));
      }
      case Expr::Kind::list: {
        std::vector<Value> items;
        for (const auto& x : e.items) items.push_back(eval(*x, scope));
        return make_list(std::move(items), e.tuple);
      }
      case Expr::Kind::dict: {
        Dict d;
        for (size_t i = 0; i < e.keys.size(); ++i) {
          const Value key = eval(*e.keys[i], scope);
          if (!key.is_string())
            throw EvalError(
                fmt::format("unsupported: dict keys other than strings ({})", type_name(key)));
          d.set(key.as_string(), eval(*e.items[i], scope));
        }
        return make_dict(std::move(d));
      }
      case Expr::Kind::getattr:
        return get_attribute(eval(*e.object, scope), e.name);
      case Expr::Kind::getitem:
        return get_item(eval(*e.object, scope), eval(*e.index, scope));
      case Expr::Kind::slice: {
        const auto bound = [&](const ExprPtr& x) { return x ? eval(*x, scope) : Value(None{}); };
        const Value object = eval(*e.object, scope);
        return get_slice(object, bound(e.start), bound(e.stop), bound(e.step));
      }
      case Expr::Kind::call: {
        const Value callee = eval(*e.object, scope);
        Args args = eval_args(e.args, scope);
        return invoke(e, callee, args);
      }
      case Expr::Kind::filter: {
        const Value operand = eval(*e.object, scope);
        return apply_filter(e.name, operand, eval_args(e.args, scope));
      }
      case Expr::Kind::test: {
        const Value operand = eval(*e.object, scope);
        return Value(apply_test(e.name, operand, eval_args(e.args, scope)) != e.negated);
      }
      case Expr::Kind::unary: {
        const Value v = eval(*e.object, scope);
        if (e.name == "not") return Value(!truthy(v));
        require_defined(v);
        if (!v.is_number())
          throw EvalError(fmt::format("bad operand type for unary {}: '{}'", e.name, type_name(v)));
        if (e.name == "+") return v.is_float() ? v : Value(v.as_int());
        if (v.is_float()) return Value(-v.as_float());
        if (v.as_int() == INT64_MIN) overflow();
        return Value(-v.as_int());
      }
      case Expr::Kind::binary: {
        const Value left = eval(*e.object, scope);
        if (e.name == "and") return truthy(left) ? eval(*e.index, scope) : left;
        if (e.name == "or") return truthy(left) ? left : eval(*e.index, scope);
        return binary_op(e.name, left, eval(*e.index, scope));
      }
      case Expr::Kind::compare: {
        Value left = eval(*e.object, scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.items[i], scope);
          if (!compare_op(e.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::Kind::condition:
        if (truthy(eval(*e.object, scope))) return eval(*e.then, scope);
        if (e.otherwise) return eval(*e.otherwise, scope);
        return Value::undefined(
            fmt::format("the inline if-expression on line {} evaluated to false and no else "
                        "section was defined.",
                        e.pos.line));
    }
    return Value();
  }
};

// A registered C++ function, called with JSON arguments.
Value wrap_function(const std::string& name, const Function& f) {
  return make_callable(name, [f](Args& a) {
    std::vector<Json> args;
    for (const auto& v : a.positional) args.push_back(to_json(v));
    Json kwargs = Json::object();
    for (const auto& [k, v] : a.keyword) kwargs[k] = to_json(v);
    return from_json(f(args, kwargs));
  });
}

}  // namespace

Template Template::parse(std::string_view source) {
  Template t;
  t.program_ = std::make_shared<const Program>(parse_program(source));
  return t;
}

void Template::set_function(const std::string& name, Function f) {
  functions_[name] = std::move(f);
}

std::string Template::render(const Json& context) const {
  if (!program_) throw Error("template: render() before parse()");
  if (!context.is_object()) throw Error("template: the context must be a JSON object");
  auto globals = std::make_shared<Scope>();
  for (auto& [name, v] : builtin_globals().items) globals->vars[name] = std::move(v);
  for (const auto& [name, f] : functions_) globals->vars[name] = wrap_function(name, f);
  ScopePtr root = child(globals);
  for (const auto& [k, v] : context.items()) {
    try {
      root->vars[k] = from_json(v);
    } catch (const EvalError& e) {
      throw Error(fmt::format("template: context variable '{}': {}", k, e.what()));
    }
  }
  return Interpreter().render(*program_, root);
}

}  // namespace kestrel::jinja
