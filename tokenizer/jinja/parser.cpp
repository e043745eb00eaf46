// Jinja2's parser (jinja2/parser.py), statement by statement and with its precedence, so that a
// template means here what it means to transformers. What Jinja has and this interpreter does
// not (include, import, extends, recursive loops, a filter it does not know) is refused here,
// before rendering, naming the construct and its line:column.
#include <fmt/format.h>

#include <algorithm>

#include "tokenizer/jinja/ast.h"

namespace kestrel::jinja {
namespace {

// Jinja's filters that this interpreter leaves out: named as unsupported rather than unknown.
bool is_jinja_filter(std::string_view name) {
  constexpr std::string_view kLeftOut[] = {"filesizeformat", "groupby",   "pprint",   "random",
                                           "slice",          "striptags", "truncate", "urlencode",
                                           "urlize",         "wordwrap",  "xmlattr"};
  return std::find(std::begin(kLeftOut), std::end(kLeftOut), name) != std::end(kLeftOut);
}

// Tags that belong to another construct, and Jinja tags a chat template cannot use.
constexpr std::string_view kEndTags[] = {"endfor",  "endif",    "elif",         "else",
                                         "endset",  "endmacro", "endcall",      "endfilter",
                                         "endwith", "endraw",   "endgeneration"};
constexpr std::string_view kRefusedTags[] = {"include", "import", "from",       "extends",
                                             "block",   "do",     "autoescape", "trans"};

std::string describe(const Token& t) {
  if (t.kind == Tok::text) return "template text";
  if (t.kind == Tok::eof) return "the end of the template";
  if (t.kind == Tok::string) return "a string";
  return "'" + t.text + "'";
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Program run() {
    Program p;
    p.body = body({}, nullptr);
    return p;
  }

 private:
  // ---- tokens ----
  const Token& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(i_++, t_.size() - 1)]; }
  bool at_op(std::string_view op, size_t k = 0) const {
    return peek(k).kind == Tok::op && peek(k).text == op;
  }
  bool at_name(std::string_view name, size_t k = 0) const {
    return peek(k).kind == Tok::name && peek(k).text == name;
  }
  [[noreturn]] void fail(Pos pos, std::string_view message) const {
    throw Error(located(pos, message));
  }
  void expect_op(std::string_view op, std::string_view after) {
    if (!at_op(op))
      fail(peek().pos, fmt::format("expected '{}' {}, found {}", op, after, describe(peek())));
    next();
  }
  void expect_name(std::string_view name, std::string_view after) {
    if (!at_name(name))
      fail(peek().pos, fmt::format("expected '{}' {}, found {}", name, after, describe(peek())));
    next();
  }
  std::string name(std::string_view what) {
    if (peek().kind != Tok::name)
      fail(peek().pos, fmt::format("expected {}, found {}", what, describe(peek())));
    return next().text;
  }
  void end_of_tag(std::string_view tag) {
    if (peek().kind != Tok::block_end)
      fail(peek().pos,
           fmt::format("expected '%}}' to end '{{% {} %}}', found {}", tag, describe(peek())));
    next();
  }

  // ---- statements ----

  // Statements up to one of the tags in `ends` (consumed with its name, which is returned) or,
  // with no ends, to the end of the template. `open` is the tag being closed, for the message
  // when it is not.
  struct Opened {
    std::string_view tag;
    Pos pos;
  };
  Body body(std::initializer_list<std::string_view> ends, const Opened* open,
            std::string* found = nullptr) {
    const Nested guard(*this, open ? open->pos : peek().pos);
    Body out;
    while (true) {
      const Token& t = peek();
      if (t.kind == Tok::eof) {
        if (open)
          fail(open->pos, fmt::format("'{{% {} %}}' is never closed (expected '{{% {} %}}')",
                                      open->tag, *ends.begin()));
        return out;
      }
      if (t.kind == Tok::text) {
        auto n = std::make_unique<Node>(Node::Kind::text, t.pos);
        n->text = next().text;
        out.push_back(std::move(n));
      } else if (t.kind == Tok::expr_begin) {
        auto n = std::make_unique<Node>(Node::Kind::output, t.pos);
        next();
        n->expr = tuple(true);
        if (peek().kind != Tok::expr_end)
          fail(peek().pos,
               fmt::format("expected '}}}}' to end the expression, found {}", describe(peek())));
        next();
        out.push_back(std::move(n));
      } else if (t.kind == Tok::block_begin) {
        const Token& tag = peek(1);
        if (tag.kind != Tok::name)
          fail(tag.pos, fmt::format("expected a tag name after '{{%', found {}", describe(tag)));
        if (std::find(ends.begin(), ends.end(), tag.text) != ends.end()) {
          next();
          if (found)
            *found = next().text;
          else
            next();
          return out;
        }
        out.push_back(statement());
      } else {
        fail(t.pos, fmt::format("unexpected {}", describe(t)));
      }
    }
  }

  NodePtr statement() {
    const Pos pos = next().pos;  // {%
    const Token& tag = peek();
    const std::string kw = tag.text;
    if (kw == "for") return for_loop(pos);
    if (kw == "if") return if_chain(pos);
    if (kw == "set") return set(pos);
    if (kw == "macro") return macro(pos);
    if (kw == "call") return call_block(pos);
    if (kw == "filter") return filter_block(pos);
    if (kw == "with") return with(pos);
    if (kw == "generation") {
      next();
      end_of_tag(kw);
      auto n = std::make_unique<Node>(Node::Kind::generation, pos);
      const Opened open{"generation", pos};
      n->body = body({"endgeneration"}, &open);
      end_of_tag("endgeneration");
      return n;
    }
    if (kw == "break" || kw == "continue") {
      if (loop_depth_ == 0) fail(tag.pos, fmt::format("'{{% {} %}}' outside a for loop", kw));
      next();
      end_of_tag(kw);
      return std::make_unique<Node>(kw == "break" ? Node::Kind::break_ : Node::Kind::continue_,
                                    pos);
    }
    if (std::find(std::begin(kRefusedTags), std::end(kRefusedTags), kw) != std::end(kRefusedTags))
      fail(tag.pos, fmt::format("unsupported tag '{{% {} %}}' (a chat template renders alone: "
                                "no other templates, blocks or extensions)",
                                kw));
    if (std::find(std::begin(kEndTags), std::end(kEndTags), kw) != std::end(kEndTags))
      fail(tag.pos, fmt::format("unexpected '{{% {} %}}' (nothing open that it ends)", kw));
    fail(tag.pos, fmt::format("unknown tag '{{% {} %}}'", kw));
  }

  NodePtr for_loop(Pos pos) {
    next();
    auto n = std::make_unique<Node>(Node::Kind::for_, pos);
    n->target = assign_target(false);
    expect_name("in", "after the loop variable");
    n->expr = tuple(false, false, "recursive");
    if (at_name("if")) {
      next();
      n->filter = expression(true);
    }
    if (at_name("recursive")) fail(peek().pos, "unsupported: recursive for loops");
    end_of_tag("for");
    const Opened open{"for", pos};
    std::string found;
    ++loop_depth_;
    n->body = body({"endfor", "else"}, &open, &found);
    --loop_depth_;
    if (found == "else") {
      end_of_tag("else");
      n->otherwise = body({"endfor"}, &open);
    }
    end_of_tag("endfor");
    return n;
  }

  NodePtr if_chain(Pos pos) {
    next();
    auto n = std::make_unique<Node>(Node::Kind::if_, pos);
    const Opened open{"if", pos};
    while (true) {
      n->conditions.push_back(tuple(false));
      end_of_tag(n->conditions.size() == 1 ? "if" : "elif");
      std::string found;
      n->bodies.push_back(body({"elif", "else", "endif"}, &open, &found));
      if (found == "elif") continue;
      if (found == "else") {
        end_of_tag("else");
        n->otherwise = body({"endif"}, &open);
      }
      break;
    }
    end_of_tag("endif");
    return n;
  }

  NodePtr set(Pos pos) {
    next();
    auto n = std::make_unique<Node>(Node::Kind::set, pos);
    n->target = assign_target(true);
    if (at_op("=")) {
      next();
      n->expr = tuple(true);
      end_of_tag("set");
      return n;
    }
    if (n->target.unpack || !n->target.attribute.empty())
      fail(pos, "a block '{% set %}' assigns one name");
    if (at_op("|")) {
      next();
      n->filter = filter_chain(nullptr);
    }
    end_of_tag("set");
    const Opened open{"set", pos};
    n->body = body({"endset"}, &open);
    end_of_tag("endset");
    return n;
  }

  NodePtr macro(Pos pos) {
    next();
    auto n = std::make_unique<Node>(Node::Kind::macro, pos);
    n->text = name("a macro name");
    n->params = signature();
    end_of_tag("macro");
    const Opened open{"macro", pos};
    const int depth = std::exchange(loop_depth_, 0);
    n->body = body({"endmacro"}, &open);
    loop_depth_ = depth;
    end_of_tag("endmacro");
    return n;
  }

  NodePtr call_block(Pos pos) {
    next();
    auto n = std::make_unique<Node>(Node::Kind::call_block, pos);
    if (at_op("(")) n->params = signature();
    n->expr = expression(true);
    if (n->expr->kind != Expr::Kind::call) fail(n->expr->pos, "'{% call %}' needs a macro call");
    end_of_tag("call");
    const Opened open{"call", pos};
    const int depth = std::exchange(loop_depth_, 0);
    n->body = body({"endcall"}, &open);
    loop_depth_ = depth;
    end_of_tag("endcall");
    return n;
  }

  NodePtr filter_block(Pos pos) {
    next();
    auto n = std::make_unique<Node>(Node::Kind::filter, pos);
    n->filter = filter_chain(nullptr);
    end_of_tag("filter");
    const Opened open{"filter", pos};
    n->body = body({"endfilter"}, &open);
    end_of_tag("endfilter");
    return n;
  }

  NodePtr with(Pos pos) {
    next();
    auto n = std::make_unique<Node>(Node::Kind::with, pos);
    while (peek().kind != Tok::block_end) {
      if (!n->targets.empty()) expect_op(",", "between '{% with %}' assignments");
      n->targets.push_back(assign_target(false));
      expect_op("=", "in '{% with %}'");
      n->values.push_back(expression(true));
    }
    end_of_tag("with");
    const Opened open{"with", pos};
    n->body = body({"endwith"}, &open);
    end_of_tag("endwith");
    return n;
  }

  // name, a, b, (a, b), or with a namespace: ns.attr
  Target assign_target(bool with_namespace) {
    Target t;
    if (with_namespace && peek().kind == Tok::name && at_op(".", 1)) {
      t.names.push_back(next().text);
      next();
      t.attribute = name("an attribute name after '.'");
      return t;
    }
    const bool parens = at_op("(");
    if (parens) next();
    while (true) {
      t.names.push_back(name("a variable name"));
      if (!at_op(",")) break;
      next();
      t.unpack = true;
      if (peek().kind != Tok::name) break;  // trailing comma
    }
    if (parens) {
      t.unpack = true;
      expect_op(")", "after the variable names");
    }
    return t;
  }

  std::vector<Param> signature() {
    std::vector<Param> params;
    expect_op("(", "to start the parameters");
    while (!at_op(")")) {
      if (!params.empty()) expect_op(",", "between parameters");
      Param p;
      const Pos at = peek().pos;
      p.name = name("a parameter name");
      if (at_op("=")) {
        next();
        p.default_value = expression(true);
      } else if (!params.empty() && params.back().default_value) {
        fail(at, "a parameter without a default follows one with a default");
      }
      params.push_back(std::move(p));
    }
    next();
    return params;
  }

  // ---- expressions ----

  ExprPtr make(Expr::Kind k, Pos p) { return std::make_unique<Expr>(k, p); }

  // Jinja's parse_tuple: one expression, or several separated by commas as a tuple.
  ExprPtr tuple(bool with_condition, bool explicit_parens = false, std::string_view end_name = {}) {
    const Pos pos = peek().pos;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",", "between tuple items");
      const Token& t = peek();
      const bool end = t.kind == Tok::expr_end || t.kind == Tok::block_end || at_op(")") ||
                       (!end_name.empty() && at_name(end_name));
      if (end) break;
      items.push_back(expression(with_condition));
      if (!at_op(",")) break;
      is_tuple = true;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens)
        fail(pos, fmt::format("expected an expression, found {}", describe(peek())));
    }
    auto e = make(Expr::Kind::list, pos);
    e->items = std::move(items);
    e->tuple = true;
    return e;
  }

  ExprPtr expression(bool with_condition) {
    const Nested guard(*this, peek().pos);
    return with_condition ? condition() : or_expr();
  }

  ExprPtr condition() {
    ExprPtr e = or_expr();
    while (at_name("if")) {
      const Pos pos = next().pos;
      auto c = make(Expr::Kind::condition, pos);
      c->then = std::move(e);
      c->object = or_expr();
      if (at_name("else")) {
        next();
        c->otherwise = condition();
      }
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(std::string op, ExprPtr left, ExprPtr right, Pos pos) {
    auto e = make(Expr::Kind::binary, pos);
    e->name = std::move(op);
    e->object = std::move(left);
    e->index = std::move(right);
    return e;
  }

  ExprPtr or_expr() {
    ExprPtr e = and_expr();
    while (at_name("or")) {
      const Pos pos = next().pos;
      e = binary("or", std::move(e), and_expr(), pos);
    }
    return e;
  }

  ExprPtr and_expr() {
    ExprPtr e = not_expr();
    while (at_name("and")) {
      const Pos pos = next().pos;
      e = binary("and", std::move(e), not_expr(), pos);
    }
    return e;
  }

  ExprPtr not_expr() {
    if (at_name("not")) {
      const Nested guard(*this, peek().pos);
      auto e = make(Expr::Kind::unary, next().pos);
      e->name = "not";
      e->object = not_expr();
      return e;
    }
    return compare();
  }

  ExprPtr compare() {
    ExprPtr first = add();
    const Pos pos = peek().pos;  // the first operator
    std::vector<std::string> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      const Token& t = peek();
      if (t.kind == Tok::op && (t.text == "==" || t.text == "!=" || t.text == "<" ||
                                t.text == "<=" || t.text == ">" || t.text == ">=")) {
        ops.push_back(next().text);
      } else if (at_name("in")) {
        next();
        ops.push_back("in");
      } else if (at_name("not") && at_name("in", 1)) {
        next();
        next();
        ops.push_back("notin");
      } else {
        break;
      }
      operands.push_back(add());
    }
    if (ops.empty()) return first;
    auto e = make(Expr::Kind::compare, pos);
    e->object = std::move(first);
    e->ops = std::move(ops);
    e->items = std::move(operands);
    return e;
  }

  ExprPtr add() {
    ExprPtr e = concat();
    while (at_op("+") || at_op("-")) {
      const Token& op = next();
      e = binary(op.text, std::move(e), concat(), op.pos);
    }
    return e;
  }

  ExprPtr concat() {
    ExprPtr e = multiply();
    while (at_op("~")) {
      const Pos pos = next().pos;
      e = binary("~", std::move(e), multiply(), pos);
    }
    return e;
  }

  ExprPtr multiply() {
    ExprPtr e = power();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const Token& op = next();
      e = binary(op.text, std::move(e), power(), op.pos);
    }
    return e;
  }

  ExprPtr power() {
    ExprPtr e = unary(true);
    while (at_op("**")) {
      const Pos pos = next().pos;
      e = binary("**", std::move(e), unary(true), pos);
    }
    return e;
  }

  // -x applies to x with its postfix operators; filters and tests then apply to -x.
  ExprPtr unary(bool with_filter) {
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      const Nested guard(*this, peek().pos);
      const Token& op = next();
      e = make(Expr::Kind::unary, op.pos);
      e->name = op.text;
      e->object = unary(false);
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    if (with_filter) e = filters_and_tests(std::move(e));
    return e;
  }

  ExprPtr primary() {
    const Token& t = peek();
    switch (t.kind) {
      case Tok::name: {
        next();
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          auto e = make(Expr::Kind::literal, t.pos);
          e->value = Value(t.text == "true" || t.text == "True");
          return e;
        }
        if (t.text == "none" || t.text == "None") {
          auto e = make(Expr::Kind::literal, t.pos);
          e->value = Value(None{});
          return e;
        }
        auto e = make(Expr::Kind::name, t.pos);
        e->name = t.text;
        return e;
      }
      case Tok::string: {
        auto e = make(Expr::Kind::literal, t.pos);
        std::string s;
        while (peek().kind == Tok::string) s += next().text;  // "a" "b" is "ab"
        e->value = Value(std::move(s));
        return e;
      }
      case Tok::integer:
      case Tok::floating: {
        auto e = make(Expr::Kind::literal, t.pos);
        e->value = t.kind == Tok::integer ? Value(t.integer) : Value(t.floating);
        next();
        return e;
      }
      case Tok::op:
        if (t.text == "(") {
          next();
          ExprPtr e = tuple(true, true);
          expect_op(")", "to close '('");
          return e;
        }
        if (t.text == "[") {
          auto e = make(Expr::Kind::list, next().pos);
          while (!at_op("]")) {
            if (!e->items.empty()) expect_op(",", "between list items");
            if (at_op("]")) break;
            e->items.push_back(expression(true));
          }
          next();
          return e;
        }
        if (t.text == "{") {
          auto e = make(Expr::Kind::dict, next().pos);
          while (!at_op("}")) {
            if (!e->keys.empty()) expect_op(",", "between dict items");
            if (at_op("}")) break;
            e->keys.push_back(expression(true));
            expect_op(":", "after a dict key");
            e->items.push_back(expression(true));
          }
          next();
          return e;
        }
        break;
      default:
        break;
    }
    fail(t.pos, fmt::format("unexpected {}", describe(t)));
  }

  ExprPtr postfix(ExprPtr e) {
    while (true) {
      if (at_op(".")) {
        const Pos pos = next().pos;
        const Token& t = next();
        if (t.kind == Tok::name) {
          auto g = make(Expr::Kind::getattr, pos);
          g->object = std::move(e);
          g->name = t.text;
          e = std::move(g);
        } else if (t.kind == Tok::integer) {
          auto g = make(Expr::Kind::getitem, pos);
          g->object = std::move(e);
          g->index = make(Expr::Kind::literal, t.pos);
          g->index->value = Value(t.integer);
          e = std::move(g);
        } else {
          fail(t.pos, fmt::format("expected an attribute name after '.', found {}", describe(t)));
        }
      } else if (at_op("[")) {
        e = subscript(std::move(e));
      } else if (at_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr subscript(ExprPtr object) {
    const Pos pos = next().pos;  // [
    ExprPtr parts[3];
    int colons = 0;
    while (!at_op("]")) {
      if (at_op(":")) {
        if (++colons > 2) fail(peek().pos, "a slice has at most two ':'");
        next();
        continue;
      }
      if (at_op(",")) fail(peek().pos, "unsupported: subscripts with several keys");
      if (parts[colons])
        fail(peek().pos, fmt::format("expected ']' or ':', found {}", describe(peek())));
      parts[colons] = expression(true);
    }
    next();
    if (colons == 0) {
      if (!parts[0]) fail(pos, "expected a key inside '[]'");
      auto g = make(Expr::Kind::getitem, pos);
      g->object = std::move(object);
      g->index = std::move(parts[0]);
      return g;
    }
    auto s = make(Expr::Kind::slice, pos);
    s->object = std::move(object);
    s->start = std::move(parts[0]);
    s->stop = std::move(parts[1]);
    s->step = std::move(parts[2]);
    return s;
  }

  CallArgs call_args() {
    const Pos pos = next().pos;  // (
    CallArgs a;
    bool first = true;
    while (!at_op(")")) {
      if (!first) {
        expect_op(",", "between arguments");
        if (at_op(")")) break;
      }
      first = false;
      if (at_op("*")) {
        next();
        if (a.star || a.star_star) fail(pos, "invalid syntax for a call: repeated '*'");
        a.star = expression(true);
      } else if (at_op("**")) {
        next();
        if (a.star_star) fail(pos, "invalid syntax for a call: repeated '**'");
        a.star_star = expression(true);
      } else if (peek().kind == Tok::name && at_op("=", 1)) {
        std::string key = next().text;
        next();
        a.keyword.emplace_back(std::move(key), expression(true));
      } else {
        if (!a.keyword.empty() || a.star || a.star_star)
          fail(peek().pos, "a positional argument follows keyword arguments");
        a.positional.push_back(expression(true));
      }
    }
    next();
    return a;
  }

  ExprPtr call(ExprPtr callee) {
    auto c = make(Expr::Kind::call, callee->pos);
    c->object = std::move(callee);
    c->args = call_args();
    return c;
  }

  // | f | g(args), starting after the first '|' (a {% filter %} block or a {% set %} block
  // has no operand).
  ExprPtr filter_chain(ExprPtr operand) {
    while (true) {
      const Pos at = peek().pos;
      std::string fname = name("a filter name");
      if (!is_filter(fname))
        fail(at, fmt::format("{} filter '{}'", is_jinja_filter(fname) ? "unsupported" : "unknown",
                             fname));
      auto f = make(Expr::Kind::filter, at);
      f->name = std::move(fname);
      f->object = std::move(operand);
      if (at_op("(")) f->args = call_args();
      operand = std::move(f);
      if (!at_op("|")) break;
      next();
    }
    return operand;
  }

  ExprPtr filters_and_tests(ExprPtr e) {
    while (true) {
      if (at_op("|")) {
        next();
        e = filter_chain(std::move(e));
      } else if (at_name("is")) {
        e = test(std::move(e));
      } else if (at_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr test(ExprPtr operand) {
    next();  // is
    auto t = make(Expr::Kind::test, peek().pos);
    if (at_name("not")) {
      next();
      t->negated = true;
    }
    const Pos at = peek().pos;
    t->name = name("a test name after 'is'");
    if (!is_test(t->name)) fail(at, fmt::format("unknown test '{}'", t->name));
    t->object = std::move(operand);
    const Token& n = peek();
    if (at_op("(")) {
      t->args = call_args();
    } else if ((n.kind == Tok::name || n.kind == Tok::string || n.kind == Tok::integer ||
                n.kind == Tok::floating || at_op("[") || at_op("{")) &&
               !at_name("else") && !at_name("or") && !at_name("and")) {
      // `x is divisibleby 3`: one argument without parentheses, as Jinja allows.
      if (at_name("is")) fail(n.pos, "tests cannot be chained with 'is'");
      t->args.positional.push_back(postfix(primary()));
    }
    return t;
  }

  // Statements and expressions nest by recursion here and in the evaluator: a bound keeps a
  // hostile template from exhausting the stack (real chat templates nest a handful deep).
  static constexpr int kMaxNesting = 100;
  struct Nested {
    Parser& p;
    Nested(Parser& parser, Pos pos) : p(parser) {
      if (++p.nesting_ > kMaxNesting) {
        --p.nesting_;
        p.fail(pos, fmt::format("nested more than {} deep", kMaxNesting));
      }
    }
    ~Nested() { --p.nesting_; }
  };

  std::vector<Token> t_;
  size_t i_ = 0;
  int loop_depth_ = 0;
  int nesting_ = 0;
};

}  // namespace

Program parse_program(std::string_view source) { return Parser(lex(source)).run(); }

}  // namespace kestrel::jinja
