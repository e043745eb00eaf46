// The template's tokens and syntax tree, made by the lexer (jinja/lexer.cpp) and the parser
// (jinja/parser.cpp) and walked by the evaluator (jinja/eval.cpp). The grammar and its
// precedence are Python Jinja2's (jinja2/parser.py), tightest first:
//
//   primary   literal, name, ( tuple ), [ list ], { dict }
//   postfix   .name  .0  [key]  [a:b:c]  (args)
//   filters   x | f(args)   x is [not] test(args)      (also after a unary minus: -x|abs)
//   unary     -x  +x
//   power     **            (left-associative, as Jinja's)
//   multiply  *  /  //  %
//   concat    ~
//   add       +  -
//   compare   ==  !=  <  <=  >  >=  in  not in         (chained as Python: a < b < c)
//   not, and, or
//   condition a if c else b
//
// Internal to the interpreter; the public API is jinja.h.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/jinja/value.h"

namespace kestrel::jinja {

struct Pos {
  int line = 1;
  int column = 1;
};

// "template line 3:12: <message>", the form of every error the interpreter throws.
std::string located(Pos pos, std::string_view message);

// ---- tokens ----

enum class Tok {
  text,         // template text, whitespace control already applied
  expr_begin,   // {{
  expr_end,     // }}
  block_begin,  // {%
  block_end,    // %}
  name,
  string,
  integer,
  floating,
  op,  // + - * / // % ** ~ == != < <= > >= = ( ) [ ] { } , . : |
  eof,
};

struct Token {
  Tok kind;
  std::string text;  // text, name, operator, or a string literal's decoded value
  Pos pos;
  int64_t integer = 0;
  double floating = 0;
};

// Jinja2's lexer with transformers' settings: trim_blocks, lstrip_blocks, {%-/-%} and {%+/+%}
// whitespace control, comments dropped, {% raw %} kept as text, newlines normalised to \n and
// one trailing newline dropped (keep_trailing_newline=False).
std::vector<Token> lex(std::string_view source);

// ---- expressions ----

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct CallArgs {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
  ExprPtr star;       // *args
  ExprPtr star_star;  // **kwargs
};

struct Expr {
  enum class Kind {
    literal,    // value
    name,       // name
    list,       // items (tuple: a tuple)
    dict,       // keys, items
    getattr,    // object.name
    getitem,    // object[index]
    slice,      // object[start:stop:step], each optional
    call,       // object(args)
    filter,     // object | name(args); object is null in a {% filter %} block
    test,       // object is [not] name(args)
    unary,      // op object: "-", "+", "not"
    binary,     // object op index: + - * / // % ** ~ and or
    compare,    // object, then (ops[i], items[i]) pairs
    condition,  // then if object else otherwise (otherwise may be null)
  };
  Kind kind;
  Pos pos;
  Value value;
  std::string name;  // name, attribute, filter or test, operator
  ExprPtr object;
  ExprPtr index;                 // getitem key, binary right side
  ExprPtr start, stop, step;     // slice
  ExprPtr then, otherwise;       // condition
  std::vector<ExprPtr> items;    // list/tuple items, dict values, compare operands
  std::vector<ExprPtr> keys;     // dict keys
  std::vector<std::string> ops;  // compare operators: == != < <= > >= in notin
  CallArgs args;                 // call, filter, test
  bool tuple = false;            // list: written as a tuple
  bool negated = false;          // test: "is not"

  Expr(Kind k, Pos p) : kind(k), pos(p) {}
};

// ---- statements ----

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

// What a set, for or with assigns to: a name, names unpacked from a tuple, or ns.attr.
struct Target {
  std::vector<std::string> names;
  bool unpack = false;
  std::string attribute;  // set ns.attr: names = {"ns"}
};

struct Param {
  std::string name;
  ExprPtr default_value;  // may be null
};

struct Node {
  enum class Kind {
    text,        // text
    output,      // {{ expr }}
    if_,         // conditions[i] -> bodies[i]; otherwise
    for_,        // for target in expr [if filter]: body; else otherwise
    set,         // set target = expr, or set target | filters: body (expr null)
    macro,       // macro name(params): body
    call_block,  // call(params) expr: body  -- the body is the macro's caller()
    filter,      // filter chain: body (the chain's innermost operand is null)
    with,        // with targets[i] = values[i]: body
    break_,
    continue_,
    generation,  // transformers' {% generation %}: body as is (it marks the assistant's tokens)
  };
  Kind kind;
  Pos pos;
  std::string text;  // text: the text; macro: its name
  ExprPtr expr;
  ExprPtr filter;  // for: the loop filter; set and filter: the filter chain (operand null)
  Target target;
  std::vector<Target> targets;
  std::vector<ExprPtr> conditions;
  std::vector<ExprPtr> values;
  std::vector<Body> bodies;
  Body body;
  Body otherwise;
  std::vector<Param> params;

  Node(Kind k, Pos p) : kind(k), pos(p) {}
};

struct Program {
  Body body;
};

Program parse_program(std::string_view source);

// The names the parser accepts after | and after is (jinja/filters.cpp): Jinja checks them
// when compiling, so an unknown one is refused before rendering.
bool is_filter(std::string_view name);
bool is_test(std::string_view name);

}  // namespace kestrel::jinja
