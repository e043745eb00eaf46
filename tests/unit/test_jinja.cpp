// The Jinja interpreter (tokenizer/jinja/jinja.h) against two references:
//  - each construct, with what Python Jinja2 renders for it set up as transformers'
//  apply_chat_template
//    sets it up (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, its
//    tojson; the expected strings were rendered by Jinja2 3.1.6), and the errors for what is
//    malformed or unsupported, with their line:column;
//  - the real chat templates of tests/data/chat_templates/ over a set of conversations, byte for
//  byte
//    against what @huggingface/jinja renders (goldens.json, written by
//    scripts/make-jinja-goldens.mjs; scripts/check-jinja-goldens-python.py confirms Python Jinja2
//    renders the same).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cctype>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "base/error.h"
#include "tokenizer/jinja/jinja.h"

namespace fs = std::filesystem;
using kestrel::Error;
using kestrel::jinja::Json;
using kestrel::jinja::Template;
using kestrel::jinja::TemplateException;
using testing::HasSubstr;

namespace {

// strftime_now at a fixed time, formatted by the C library as Python's datetime.strftime does.
void fix_strftime_now(Template& t, std::tm when) {
  t.set_function("strftime_now", [when](const std::vector<Json>& args, const Json&) -> Json {
    char buf[256];
    const size_t n = std::strftime(buf, sizeof buf, args.at(0).get<std::string>().c_str(), &when);
    return std::string(buf, n);
  });
}

std::tm date(int year, int month, int day, int hour, int minute) {
  std::tm t{};
  t.tm_year = year - 1900;
  t.tm_mon = month - 1;
  t.tm_mday = day;
  t.tm_hour = hour;
  t.tm_min = minute;
  std::mktime(&t);  // fills in the weekday and the day of the year
  return t;
}

std::string render(const std::string& source, const Json& context = Json::object()) {
  Template t = Template::parse(source);
  fix_strftime_now(t, date(2024, 7, 26, 9, 30));
  return t.render(context);
}

// The message of the kestrel::Error that parsing or rendering throws, or "" when none does.
std::string error_of(const std::string& source, const Json& context = Json::object()) {
  try {
    render(source, context);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// ---- constructs, against Python Jinja2 ----

const char* const kContext = R"CONTEXT({
  "items": ["x", "y", "z"],
  "s": "abcdef",
  "n": 7,
  "f": 2.5,
  "zero": 0,
  "d": {"b": 2, "a": 1},
  "nothing": null,
  "msgs": [{"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Yo"},
           {"role": "user", "content": "Ok"}],
  "uni": "héllo wörld",
  "tools": [{"name": "f", "args": {"x": 1, "y": [1, 2.0, "é"]}}],
  "nested": {"a": {"b": [10, 20]}},
  "flag": true
})CONTEXT";

struct Expected {
  const char* source;
  const char* rendered;
};

const Expected kConstructs[] = {
    {"{{ 1 }} {{ 1.0 }} {{ 1.5e3 }} {{ 1e16 }} {{ 0.1 + 0.2 }} {{ -0.0 }} {{ 1_000 }} {{ 0x1F }}",
     "1 1.0 1500.0 1e+16 0.30000000000000004 -0.0 1000 31"},
    {"{{ true }} {{ True }} {{ none }} {{ None }} {{ false }} [{{ nope }}]",
     "True True None None False []"},
    {"{{ [1, 'a', none, true, 2.0] }} {{ {'k': 'v', 'n': [1, (2, 3)]} }}",
     "[1, 'a', None, True, 2.0] {'k': 'v', 'n': [1, (2, 3)]}"},
    {"{{ (1,) }} {{ () }} {{ (1, 2) }} {{ msgs[0] }}",
     "(1,) () (1, 2) {'role': 'user', 'content': 'Hi'}"},
    {"{{ \"it's\" }} {{ [\"it's\", 'say \"hi\"', \"both ' \\\"\"] }}",
     "it's [\"it's\", 'say \"hi\"', 'both \\' \"']"},
    {"{{ ['tab\\tnew\\nline', '\\u00e9', '\\x00'] }}", "['tab\\tnew\\nline', 'é', '\\x00']"},
    {"{{ 'a' 'b' }} {{ '\\x41\\u00e9' }} {{ '\\d\\w' }} {{ 'a\\\nb' }}", "ab Aé \\d\\w ab"},
    {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} "
     "{{ 7.5 // 2 }} {{ 2 ** 3 ** 2 }} {{ 10 / 2 }}",
     "3 -4 1 2 3.5 1024 0.5 3.0 64 5.0"},
    {"{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 'ab' * 3 }} {{ [1] * 3 }} {{ 'a' ~ 1 ~ none ~ nope }} "
     "{{ 'x' + 'y' }} {{ [1] + [2] }}",
     "7 9 ababab [1, 1, 1] a1None xy [1, 2]"},
    {"{{ n - 10 }} {{ -n }} {{ +f }} {{ true + 1 }} {{ -n|abs }} {{ 2 * -3 }}", "-3 -7 2.5 2 7 -6"},
    {"{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 != "
     "2 }} {{ nope == nope }} {{ nothing == none }}",
     "True False True True True True True True"},
    {"{{ nothing or 'fb' }} {{ s or 'fb' }} {{ zero or 'fb' }} {{ s and 'last' }} [{{ '' and "
     "'never' }}] {{ not zero }} {{ not s }} {{ not nope }}",
     "fb abcdef fb last [] True False True"},
    {"{{ 'a' in 'cat' }} {{ 'x' in items }} {{ 'q' not in items }} {{ 'a' in d }} {{ 'zz' in d }} "
     "{{ 1 in [1.0] }} {{ 'x' in nope }} {{ not 'x' in items }}",
     "True True True True False True False False"},
    {"{{ 'yes' if n > 5 else 'no' }} {{ 'yes' if zero else 'no' }} [{{ 'only' if zero }}] {{ 'a' "
     "if zero else 'b' if n else 'c' }}",
     "yes no [] b"},
    {"{{ s is defined }} {{ nope is defined }} {{ nope is undefined }} {{ nothing is none }} {{ n "
     "is number }} {{ f is float }} {{ n is integer }} {{ flag is boolean }} {{ flag is true }} {{ "
     "flag is false }}",
     "True False True True True True True True True False"},
    {"{{ s is string }} {{ d is mapping }} {{ items is sequence }} {{ items is iterable }} {{ s is "
     "iterable }} {{ n is odd }} {{ n is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) "
     "}}",
     "True True True True True True False True False"},
    {"{{ n is eq 7 }} {{ n is equalto(7) }} {{ 'x' is in items }} {{ s is lower }} {{ 'AB' is "
     "upper }} {{ n is gt 3 }} {{ n is not none }} {{ true is number }} {{ true is integer }} {{ d "
     "is iterable }} {{ n is iterable }}",
     "True True True True True True True True False True False"},
    {"{{ d.a }} {{ d['b'] }} {{ msgs[1].role }} {{ msgs[-1]['content'] }} {{ nested.a.b[1] }} {{ "
     "nested['a']['b'][-1] }} {{ items.0 }} [{{ d.zz }}] [{{ items[10] }}] [{{ s.nope }}] [{{ "
     "nothing.x }}]",
     "1 2 assistant Ok 20 20 x [] [] [] []"},
    {"{{ s[1:] }} {{ s[:2] }} {{ s[:-1] }} {{ s[::-1] }} {{ s[::2] }} {{ s[4:1:-1] }} {{ items[1:] "
     "}} {{ items[::-1] }} {{ uni[1:4] }} {{ uni[::-1] }} {{ uni[1] }} [{{ s[10:] }}] {{ s[-2:] }}",
     "bcdef ab abcde fedcba ace edc ['y', 'z'] ['z', 'y', 'x'] éll dlröw olléh é [] ef"},
    {"{{ '  x  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '  x  '.lstrip() }}|{{ '  x  '.rstrip() "
     "}}|{{ '\\n\\nx\\n'.lstrip('\\n') }}|{{ '\\u3000x\\xa0'.strip() }}|",
     "x|hi|x  |  x|x\n|x|"},
    {"{{ 'a,b,,c'.split(',') }} {{ ' a  b c '.split() }} {{ 'a b c'.split(' ', 1) }} {{ "
     "'a,b,c'.rsplit(',', 1) }} {{ '</think>x'.split('</think>')[-1] }} {{ '  a  b  '.split(none, "
     "1) }} {{ 'a\\nb\\r\\nc'.splitlines() }}",
     "['a', 'b', '', 'c'] ['a', 'b', 'c'] ['a', 'b c'] ['a,b', 'c'] x ['a', 'b  '] ['a', 'b', "
     "'c']"},
    {"{{ s.startswith('ab') }} {{ s.endswith(('x', 'ef')) }} {{ s.upper() }} {{ 'ABC'.lower() }} "
     "{{ \"they're bill's\".title() }} {{ 'hELLO'.capitalize() }} {{ 'aaa'.replace('a', 'b', 2) }} "
     "{{ 'ab'.replace('', '-') }}",
     "True True ABCDEF abc They'Re Bill'S Hello bba -a-b-"},
    {"{{ '-'.join(items) }} {{ s.find('cd') }} {{ uni.find('w') }} {{ s.rfind('z') }} {{ "
     "'abab'.count('ab') }} {{ '{} is {}'.format('x', 1) }} {{ '{0}{name}{0!r}'.format('a', "
     "name='b') }} {{ 'héllo'.upper() }} {{ 'ÀB'.lower() }}",
     "x-y-z 2 6 -1 2 x is 1 ab'a' HÉLLO àb"},
    {"{{ '42'.isdigit() }} {{ 'a1'.isalnum() }} {{ 'ab'.isalpha() }} {{ '  '.isspace() }} {{ "
     "'x'.removeprefix('x') }}|{{ 'ab'.center(6, '*') if false else 'ab'.zfill(4) }} {{ "
     "'ab'.ljust(4) }}|",
     "True True True True |00ab ab  |"},
    {"{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %} {{ d.keys()|list }} {{ "
     "d.values()|list }} {{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 0) }} {{ d.items()|list "
     "}}",
     "b=2;a=1; ['b', 'a'] [2, 1] 1 None 0 [('b', 2), ('a', 1)]"},
    {"{{ '  x  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ s|length }}|{{ items|count }}|{{ uni|length "
     "}}|{{ d|length }}|{{ nope|length }}",
     "x|hi|6|3|11|2|0"},
    {"{{ s|upper }} {{ 'AbC'|lower }} {{ 'hello wORLD-foo(bar) x'|title }} {{ 'hELLO "
     "wORLD'|capitalize }} {{ s|replace('c', 'C') }} {{ items|join(', ') }} {{ items|first }} {{ "
     "items|last }} {{ s|first }} {{ [1, 2]|join }} {{ msgs|join('|', attribute='role') }}",
     "ABCDEF abc Hello World-Foo(Bar) X Hello world abCdef x, y, z x z a 12 user|assistant|user"},
    {"{{ nope|default('dflt') }} [{{ ''|default('dflt') }}] {{ ''|default('dflt', true) }} {{ "
     "nope|d('x') }} {{ nothing|default('n') }} {{ n|string }} {{ '42'|int + 1 }} {{ '4.7'|int }} "
     "{{ 'x'|int }} {{ 'x'|int(5) }} {{ '2.5'|float }} {{ n|float }} {{ 3.7|int }} {{ ' 12 '|int "
     "}}",
     "dflt [] dflt x None 7 43 4 0 5 2.5 7.0 3 12"},
    {"{{ items|list }} {{ 'ab'|list }} {{ d|list }} {{ msgs|map(attribute='role')|list }} {{ "
     "msgs|map(attribute='missing', default='?')|list }} {{ ['a', 'B']|map('upper')|list }} {{ "
     "nested|map(attribute='b')|list }}",
     "['x', 'y', 'z'] ['a', 'b'] ['b', 'a'] ['user', 'assistant', 'user'] ['?', '?', '?'] ['A', "
     "'B'] [Undefined]"},
    {"{{ msgs|selectattr('role', 'equalto', 'user')|list|length }} {{ msgs|rejectattr('role', "
     "'eq', 'user')|map(attribute='content')|join }} {{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, "
     "2, 3, 4]|reject('even')|list }} {{ [0, 1, '', 'a']|select|list }} {{ ['a', "
     "'code_interpreter', 'b']|reject('equalto', 'code_interpreter')|join(', ') }} {{ "
     "msgs|selectattr('content')|list|length }}",
     "2 Yo [1, 3] [1, 3] [1, 'a'] a, b 3"},
    {"{{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ ['b', 'A', 'c']|sort }} {{ ['b', "
     "'A', 'c']|sort(case_sensitive=true) }} {{ "
     "msgs|sort(attribute='content')|map(attribute='content')|list }} {{ ['a', 'A', "
     "'b']|unique|list }} {{ [1, 2, 1]|unique|list }} {{ items|reverse|list }} {{ s|reverse }}",
     "[1, 2, 3] [3, 2, 1] ['A', 'b', 'c'] ['A', 'b', 'c'] ['Hi', 'Ok', 'Yo'] ['a', 'b'] [1, 2] "
     "['z', 'y', 'x'] fedcba"},
    {"{{ d|items|list }} {{ d|dictsort }} {{ d|dictsort(reverse=true) }} {{ {'b': 1, 'a': "
     "2}|dictsort(by='value') }}",
     "[('b', 2), ('a', 1)] [('a', 1), ('b', 2)] [('b', 2), ('a', 1)] [('b', 1), ('a', 2)]"},
    {"{{ -3|abs }} {{ 2.567|round(2) }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.1|round(0, 'ceil') }} "
     "{{ 7|round }} {{ [1, 2, 3]|sum }} {{ [1, 5, 2]|max }} {{ ['b', 'A']|min }} {{ "
     "msgs|sum(attribute='x', start=0) if false else [1.5, 2]|sum }} {{ 2.675|round(2) }}",
     "3 2.57 2.0 4.0 3.0 7 6 5 A 3.5 2.67"},
    {"{{ 'ab'|center(6) }}| {{ 'one two  three'|wordcount }} {{ 'a<b>&\"\\''|e }} {{ n|safe }} {{ "
     "'line1\\nline2\\n\\nline4'|indent(2) }}| {{ 'l1\\nl2'|indent(2, true) }} {{ "
     "'x\\n\\ny'|indent('> ', blank=true) }}",
     "  ab  | 3 a&lt;b&gt;&amp;&#34;&#39; 7 line1\n  line2\n\n  line4|   l1\n  l2 x\n> \n> y"},
    {"{{ '%s and %d'|format('a', 3) }} {{ '%05.1f|%-4s|%r'|format(2.25, 'x', 'y') }} {{ '%s' % "
     "'solo' }} {{ '%d%%' % 5 }}",
     "a and 3 002.2|x   |'y' solo 5%"},
    {"{{ tools|tojson }} {{ {'é': [1, 2.0, none, true, 1e20]}|tojson }} {{ "
     "'a\"b\\\\c\\n\\u0001é'|tojson }} {{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}",
     "[{\"name\": \"f\", \"args\": {\"x\": 1, \"y\": [1, 2.0, \"é\"]}}] {\"é\": [1, 2.0, null, "
     "true, 1e+20]} \"a\\\"b\\\\c\\n\\u0001é\" {\"a\": 2, \"b\": 1}"},
    {"{{ tools[0]|tojson(indent=2) }}\n{{ {'x': [1, {'y': []}], 'z': {}}|tojson(indent=4) }}\n{{ "
     "'é😀'|tojson(ensure_ascii=true) }} {{ [1, 2]|tojson(separators=(',', ':')) }} {{ "
     "{}|tojson(indent=2) }} {{ (1, 2)|tojson }}",
     "{\n  \"name\": \"f\",\n  \"args\": {\n    \"x\": 1,\n    \"y\": [\n      1,\n      2.0,\n    "
     "  \"é\"\n    ]\n  }\n}\n{\n    \"x\": [\n        1,\n        {\n            \"y\": []\n      "
     "  }\n    ],\n    \"z\": {}\n}\n\"\\u00e9\\ud83d\\ude00\" [1,2] {} [1, 2]"},
    {"{{ [1, 2, 3, 4, 5]|batch(2)|list }} {{ [1, 2, 3]|batch(2, 0)|list }} {{ msgs|attr('missing') "
     "is defined }}",
     "[[1, 2], [3, 4], [5]] [[1, 2], [3, 0]] False"},
    {"{% for x in items %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 "
     "}}{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}",
     "1032TrueFalse3|2121FalseFalse3|3210FalseTrue3|"},
    {"{% for x in items %}{{ loop.previtem|default('-') }}{{ x }}{{ loop.nextitem|default('-') }} "
     "{% endfor %}",
     "-xy xyz yz- "},
    {"{% for x in [] %}x{% else %}empty{% endfor %} {% for x in items if x == 'q' %}x{% else "
     "%}none passed{% endfor %}",
     "empty none passed"},
    {"{% for m in msgs if m.role == 'user' %}{{ loop.index }}:{{ m.content }}{{ ',' if not "
     "loop.last }}{% endfor %}",
     "1:Hi,2:Ok"},
    {"{% for k, v in d|dictsort %}{{ k }}{{ v }}{% endfor %} {% for k in d %}{{ k }}{% endfor %} "
     "{% for c in 'abc' %}{{ c }}-{% endfor %} {% for x in nope %}never{% endfor %}",
     "a1b2 ba a-b-c- "},
    {"{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ b }}{% endfor %}{{ loop.index "
     "}};{% endfor %}",
     "1x2y1;1x2y2;"},
    {"{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% "
     "endif %}{{ i }}{% endfor %}",
     "0134"},
    {"{% for i in range(4) %}{{ loop.cycle('a', 'b') }}{% endfor %} {{ range(3)|list }} {{ "
     "range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }}",
     "abab [0, 1, 2] [1, 4, 7] [5, 3, 1]"},
    {"{% for x in [1, 1, 2, 3, 3] %}{% if loop.changed(x) %}{{ x }}{% endif %}{% endfor %}", "123"},
    {"{% set y = 0 %}{% for i in [1, 2, 3] %}{% if i == 1 %}{% set y = 5 %}{% endif %}{{ y }}{% "
     "endfor %}{{ y }}",
     "5000"},
    {"{% set ns = namespace(count=0, found=false) %}{% for m in msgs %}{% if m.role == 'user' %}{% "
     "set ns.count = ns.count + 1 %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.found }} {% set "
     "ns2 = namespace() %}{% set ns2.x = 'set' %}{{ ns2.x }} {{ namespace({'a': 1}).a }}",
     "2 False set 1"},
    {"{% set a, b = 1, 2 %}{{ a }}{{ b }} {% set t = 1, 2 %}{{ t }} {% set (p, q) = 'pq' %}{{ q "
     "}}{{ p }}",
     "12 (1, 2) qp"},
    {"{% set x %}  Hello {{ n }}  {% endset %}[{{ x }}] {% set u | upper | trim %} hi {% endset "
     "%}[{{ u }}]",
     "[  Hello 7  ] [HI]"},
    {"{% for v in [1, 5, 10] %}{% if v < 3 %}small{% elif v < 8 %}medium{% elif v < 9 %}never{% "
     "else %}large{% endif %} {% endfor %}",
     "small medium large "},
    {"{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} "
     "{{ greet('B', '?') }} {{ greet(name='C', punct='.') }} {{ greet() }}",
     "Hello A! Hello B? Hello C. Hello !"},
    {"{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k='v') }} {% "
     "macro dflt(x, y=x * 2) %}{{ y }}{% endmacro %}{{ dflt(4) }}",
     "1(2, 3){'k': 'v'} 8"},
    {"{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') "
     "%}bold {{ n }}{% endcall %} {% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor "
     "%}{% endmacro %}{% call(x) each([1, 2]) %}[{{ x }}]{% endcall %}",
     "<b>bold 7</b> [1][2]"},
    {"{% filter upper %}hello {{ s }}{% endfilter %} {% with a = 1, b = 2 %}{{ a + b }}{% endwith "
     "%}[{{ a }}] {% raw %}{{ not evaluated }} {% if %}{% endraw %}",
     "HELLO ABCDEF 3[] {{ not evaluated }} {% if %}"},
    {"a{# comment #}b {#- trims -#}   c {% generation %}gen {{ n }}{% endgeneration %}",
     "abc gen 7"},
    {"{% set m = {'role': 'user', 'content': 'x'} %}{{ m.role }} {{ "
     "[m]|map(attribute='content')|first }} {{ {'a': {'b': 1}} }} {{ m|length }}",
     "user x {'a': {'b': 1}} 2"},
    {"{{ strftime_now('%d %b %Y') }} {{ strftime_now is defined }} {{ raise_exception is defined "
     "}} {{ dict(a=1, b='x') }}",
     "26 Jul 2024 True True {'a': 1, 'b': 'x'}"},
    {"a\n{% if true %}\nb\n{% endif %}\nc", "a\nb\nc"},
    {"a\n    {% if true %}\n    b\n    {% endif %}\nc", "a\n    b\nc"},
    {"a  {%- if true %} b {% endif -%}  c", "a b c"},
    {"{{ 'x' }}\n{{ 'y' }}\n", "x\ny"},
    {"  {{- 'x' -}}  \n  y", "xy"},
    {"  {%+ if true %}x{% endif +%}\ny", "  x\ny"},
    {"line\r\nnext\r\n", "line\nnext"},
    {"a {# c #}\nb", "a b"},
    {"    {# c #}\nb", "b"},
    {"{% for i in [1, 2] %}\n  {{ i }}\n{% endfor %}\n", "  1\n  2\n"},
    {"{%- for i in [1, 2] -%}\n  {{ i }}\n{%- endfor %}\n", "12"},
    {"x {% if true %}   {% endif %} y\n\n", "x     y\n"},
    {"{% raw -%}  r  {%- endraw %}\nz", "rz"},
};

TEST(Jinja, ConstructsRenderAsPythonJinja2) {
  const Json context = Json::parse(kContext);
  for (const auto& c : kConstructs) {
    std::string got;
    try {
      got = render(c.source, context);
    } catch (const Error& e) {
      got = std::string("ERROR ") + e.what();
    }
    EXPECT_EQ(got, c.rendered) << "template: " << c.source;
  }
}

TEST(Jinja, AcceptsNlohmannJson) {
  // A plain nlohmann::json converts (its object keys come sorted).
  const nlohmann::json context = {{"b", 1}, {"a", 2}};
  EXPECT_EQ(render("{{ b }}{{ a }}", context), "12");
  EXPECT_EQ(Template::parse("{{ x }}").render({{"x", {1, 2}}}), "[1, 2]");
}

TEST(Jinja, KeepsTheContextKeyOrder) {
  const Json tool = Json::parse(R"({"name": "f", "parameters": {"z": 1, "a": 2}})");
  EXPECT_EQ(render("{{ t|tojson }}", {{"t", tool}}),
            R"({"name": "f", "parameters": {"z": 1, "a": 2}})");
}

TEST(Jinja, RegisteredFunctions) {
  Template t = Template::parse("{{ add(2, 3) }} {{ greet(name='Ada') }} {{ strftime_now('%Y') }}");
  t.set_function("add", [](const std::vector<Json>& args, const Json&) -> Json {
    return args.at(0).get<int>() + args.at(1).get<int>();
  });
  t.set_function("greet", [](const std::vector<Json>&, const Json& kwargs) -> Json {
    return "hi " + kwargs.at("name").get<std::string>();
  });
  fix_strftime_now(t, date(1999, 12, 31, 23, 59));
  EXPECT_EQ(t.render(Json::object()), "5 hi Ada 1999");
}

TEST(Jinja, RaiseException) {
  const std::string source =
      "{% if messages[0].role != 'user' %}\n"
      "  {{ raise_exception('Conversation must start with ' ~ 'user') }}\n"
      "{% endif %}ok";
  const Json ok = {{"messages", Json::parse(R"([{"role": "user"}])")}};
  EXPECT_EQ(render(source, ok), "ok");
  const Json bad = {{"messages", Json::parse(R"([{"role": "assistant"}])")}};
  try {
    render(source, bad);
    FAIL() << "raise_exception did not throw";
  } catch (const TemplateException& e) {
    EXPECT_EQ(e.message(), "Conversation must start with user");
    EXPECT_THAT(e.what(), HasSubstr("line 2:6"));
    EXPECT_THAT(e.what(), HasSubstr("Conversation must start with user"));
  }
}

// ---- errors ----

TEST(Jinja, RefusesWhatItDoesNotSupportNamingLineAndColumn) {
  EXPECT_EQ(error_of("a\n  {% include 'other.jinja' %}"),
            "template line 2:6: unsupported tag '{% include %}' (a chat template renders alone: "
            "no other templates, blocks or extensions)");
  EXPECT_EQ(error_of("{% extends 'base' %}"),
            "template line 1:4: unsupported tag '{% extends %}' (a chat template renders alone: "
            "no other templates, blocks or extensions)");
  EXPECT_EQ(error_of("{{ x | frobnicate }}"), "template line 1:8: unknown filter 'frobnicate'");
  EXPECT_EQ(error_of("{{ x is frobnicated }}"), "template line 1:9: unknown test 'frobnicated'");
  EXPECT_EQ(error_of("{% for x in y recursive %}{% endfor %}"),
            "template line 1:15: unsupported: recursive for loops");
  EXPECT_EQ(error_of("{% frobnicate %}"), "template line 1:4: unknown tag '{% frobnicate %}'");
  EXPECT_EQ(error_of("{{ x[1, 2] }}"),
            "template line 1:7: unsupported: subscripts with several keys");
  EXPECT_EQ(error_of("{{ '\\N{BULLET}' }}"),
            "template line 1:5: \\N{...} escapes are not supported");
  EXPECT_EQ(error_of("{{ {1: 'a'} }}"),
            "template line 1:4: unsupported: dict keys other than strings (int)");
  EXPECT_EQ(error_of("{{ x | groupby('a') }}"), "template line 1:8: unsupported filter 'groupby'");
  EXPECT_EQ(error_of("{{ items.append(4) }}", {{"items", {1}}}),
            "template line 1:9: access to attribute 'append' of 'list' object is unsafe (templates "
            "cannot change a list; transformers renders them in an immutable sandbox)");
  EXPECT_EQ(render("{{ items.append is defined }}", {{"items", {1}}}), "False");
}

TEST(Jinja, ReportsMalformedTemplates) {
  EXPECT_EQ(error_of("{% for m in messages %}\n{{ m }}"),
            "template line 1:1: '{% for %}' is never closed (expected '{% endfor %}')");
  EXPECT_EQ(error_of("{% if x %}a{% endfor %}"),
            "template line 1:15: unexpected '{% endfor %}' (nothing open that it ends)");
  EXPECT_EQ(error_of("text {% endif %}"),
            "template line 1:9: unexpected '{% endif %}' (nothing open that it ends)");
  EXPECT_EQ(error_of("{{ x "), "template line 1:1: '{{' is never closed with '}}'");
  EXPECT_EQ(error_of("{# note"), "template line 1:1: comment '{#' is never closed with '#}'");
  EXPECT_EQ(error_of("{{ 'abc }}"), "template line 1:4: string literal is never closed");
  EXPECT_EQ(error_of("line one\n{{ 1 + }}"), "template line 2:8: unexpected '}}'");
  EXPECT_EQ(error_of("{% break %}"), "template line 1:4: '{% break %}' outside a for loop");
  EXPECT_EQ(error_of("{% if x %}{% else %}{% elif y %}{% endif %}"),
            "template line 1:24: unexpected '{% elif %}' (nothing open that it ends)");
  EXPECT_EQ(error_of("{% macro m(a=1, b) %}{% endmacro %}"),
            "template line 1:17: a parameter without a default follows one with a default");
  EXPECT_EQ(error_of("{% set x = 1 x %}"),
            "template line 1:14: expected '%}' to end '{% set %}', found 'x'");
  EXPECT_EQ(error_of("{{ (1 }}"), "template line 1:7: unexpected '}'");
  EXPECT_EQ(error_of("{{ f(a=1, 2) }}"),
            "template line 1:11: a positional argument follows keyword arguments");
  EXPECT_EQ(error_of("{{ x ! y }}"), "template line 1:6: unexpected character '!'");
}

// A template from a model directory must not hang, crash or eat the memory of the program that
// renders it: loops, recursion, growth and nesting past generous bounds are errors.
TEST(Jinja, BoundsWhatATemplateMayDo) {
  EXPECT_THAT(error_of("{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}"
                       "{% endfor %}"),
              HasSubstr("steps (a loop that does not end?)"));
  EXPECT_THAT(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
              HasSubstr("more than 200 deep"));
  EXPECT_THAT(error_of("{{ 'abc' * 1000000000 }}"), HasSubstr("passes the renderer's bound"));
  EXPECT_THAT(error_of("{% for a in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"),
              HasSubstr("output passed 64 MiB"));
  EXPECT_THAT(error_of("{{ " + std::string(300, '(') + "1" + std::string(300, ')') + " }}"),
              HasSubstr("nested more than 100 deep"));
  EXPECT_THAT(error_of("{{ " + std::string(300, '-') + "1 }}"), HasSubstr("nested more than 100 deep"));
  std::string ifs;
  for (int i = 0; i < 150; ++i) ifs += "{% if true %}";
  for (int i = 0; i < 150; ++i) ifs += "{% endif %}";
  EXPECT_THAT(error_of(ifs), HasSubstr("nested more than 100 deep"));
  // Found by fuzz_jinja: a value of the wrong kind where a filter wants a number.
  EXPECT_EQ(error_of("{{ x | tojson(indent=nope) }}", {{"x", 1}}), "template line 1:8: 'nope' is undefined");
  EXPECT_THAT(error_of("{{ x | tojson(indent=[1]) }}", {{"x", 1}}), HasSubstr("expected an integer, got list"));
  // Found by fuzz_jinja: a % format asking for a width of billions.
  EXPECT_THAT(error_of("{{ '%0730000000000s' % 'x' }}"), HasSubstr("too large"));
  EXPECT_THAT(error_of("{{ '%.99999999999f' % 1.5 }}"), HasSubstr("too large"));
  EXPECT_EQ(render("{{ '%5s|%-3d|%.2f' % ('ab', 7, 1.234) }}"), "   ab|7  |1.23");
  // Real templates are far inside the bounds.
  EXPECT_EQ(render("{% for a in range(300) %}{% for b in range(300) %}{% endfor %}{% endfor %}ok"), "ok");
}

// A render's values die with it, cycles included (found by the ASan build: every template with
// a macro leaked its scopes, the context among them). A registered function holds a token;
// each template reaches it from a cycle, so a cycle that outlived the render would keep it.
TEST(Jinja, RenderLeavesNoCycleBehind) {
  for (const std::string source : {
           // a macro holds the scope it is defined in, which holds the macro (and probe)
           "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(2) }}",
           // the same, ended by the recursion bound
           "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
           // a macro defined in a loop's scope, carried out of it in a namespace
           "{% set ns = namespace() %}{% for i in [1] %}{% macro g() %}{{ probe }}{% endmacro %}"
           "{% set ns.g = g %}{% endfor %}{{ ns.g() }}",
           // a namespace given itself
           "{% set ns = namespace(p=probe) %}{% set ns.me = ns %}",
           // loop.changed keeps the loop object that holds it
           "{% for x in [1, 2] %}{{ loop.changed(loop, probe) }}{% endfor %}",
       }) {
    auto token = std::make_shared<int>(0);
    {
      Template t = Template::parse(source);
      t.set_function("probe", [token](const std::vector<Json>&, const Json&) { return Json(); });
      try {
        t.render(Json::object());
      } catch (const Error&) {
      }
    }
    EXPECT_EQ(token.use_count(), 1) << source;
  }
}

TEST(Jinja, RuntimeErrorsNameWhereTheyHappen) {
  EXPECT_EQ(error_of("{{ 1 }}\n{{ nope + 1 }}"), "template line 2:9: 'nope' is undefined");
  EXPECT_EQ(error_of("{{ nope.attr }}"), "template line 1:8: 'nope' is undefined");
  EXPECT_EQ(error_of("{{ nope() }}"), "template line 1:4: 'nope' is undefined");
  EXPECT_EQ(error_of("{{ d.zz.yy }}", {{"d", Json::object()}}),
            "template line 1:8: 'dict object' has no attribute 'zz'");
  EXPECT_EQ(error_of("{{ 'a' + 1 }}"),
            "template line 1:8: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(error_of("{{ 1 / 0 }}"), "template line 1:6: division by zero");
  EXPECT_EQ(error_of("{{ nope|tojson }}"),
            "template line 1:9: Object of type Undefined is not JSON serializable");
  EXPECT_EQ(error_of("{{ nope|int }}"), "template line 1:9: 'nope' is undefined");
  EXPECT_EQ(error_of("{% set x.y = 1 %}", {{"x", 1}}),
            "template line 1:1: cannot assign attribute on non-namespace object ('x' is int)");
  EXPECT_EQ(error_of("{% for a, b in [1] %}{% endfor %}"),
            "template line 1:1: cannot unpack non-iterable int object");
  EXPECT_EQ(error_of("{% for a, b in ['abc'] %}{% endfor %}"),
            "template line 1:1: too many values to unpack (expected 2)");
  EXPECT_EQ(error_of("{% for x in 5 %}{% endfor %}"),
            "template line 1:1: 'int' object is not iterable");
  EXPECT_EQ(error_of("{{ range(200000)|length }}"),
            "template line 1:4: Range too big. The sandbox blocks ranges larger than MAX_RANGE "
            "(100000).");
  EXPECT_EQ(error_of("{{ 'x' < 1 }}"), "template line 1:8: cannot compare 'str' with 'int'");
  EXPECT_EQ(error_of("{{ (items|select)|length }}", {{"items", {1}}}),
            "template line 1:19: object of type 'generator' has no len()");
  EXPECT_EQ(
      error_of("{{ 9223372036854775807 + 1 }}"),
      "template line 1:24: integer overflow (Python's integers are unbounded, these are 64-bit)");
}

// ---- the real chat templates, against @huggingface/jinja ----

struct GoldenCase {
  std::string label;  // for the test name
  std::string tmpl;
  std::string name;
  Json context;
  std::optional<std::string> expected, error;
};

// What gtest prints for a case (instead of its bytes).
void PrintTo(const GoldenCase& c, std::ostream* os) { *os << c.tmpl << " / " << c.name; }

const fs::path kTemplates = KESTREL_CHAT_TEMPLATES_DIR;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

const Json& goldens() {
  static const Json g = Json::parse(read_file(kTemplates / "goldens.json"));
  return g;
}

std::vector<GoldenCase> golden_cases() {
  std::vector<GoldenCase> out;
  if (!fs::exists(kTemplates / "goldens.json")) return out;  // GoldenFile.IsThere says so
  for (const auto& c : goldens().at("cases")) {
    GoldenCase g;
    g.tmpl = c.at("template");
    g.name = c.at("name");
    g.context = c.at("context");
    if (c.contains("expected")) g.expected = c.at("expected").get<std::string>();
    if (c.contains("error")) g.error = c.at("error").get<std::string>();
    std::string label = g.tmpl.substr(0, g.tmpl.find(".jinja")) + "_" + g.name;
    for (char& ch : label)
      if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
    g.label = std::to_string(out.size()) + "_" + label;
    out.push_back(std::move(g));
  }
  return out;
}

TEST(GoldenFile, IsThere) {
  ASSERT_TRUE(fs::exists(kTemplates / "goldens.json"));
  const auto cases = golden_cases();
  EXPECT_GE(cases.size(), 200u);
  std::set<std::string> templates;
  for (const auto& c : cases) templates.insert(c.tmpl);
  for (const char* t : {"llama2.jinja", "llama3.jinja", "llama3.1.jinja", "llama3.2.jinja",
                        "qwen2.5.jinja", "qwen3.jinja", "mistral-v0.1.jinja", "mistral-v0.3.jinja",
                        "mistral-nemo.jinja", "mistral-small-3.1.jinja", "zephyr.jinja",
                        "chatml.jinja", "gemma2.jinja", "gemma3.jinja", "phi3.jinja"})
    EXPECT_TRUE(templates.count(t)) << t;
}

class RealTemplate : public testing::TestWithParam<GoldenCase> {};

TEST_P(RealTemplate, RendersAsHuggingFaceJinja) {
  const GoldenCase& c = GetParam();
  Template t = Template::parse(read_file(kTemplates / c.tmpl));
  const Json& when = goldens().at("strftime_now");
  fix_strftime_now(t, date(when.at("year"), when.at("month"), when.at("day"), when.at("hour"),
                           when.at("minute")));
  if (c.expected) {
    EXPECT_EQ(t.render(c.context), *c.expected);
  } else {
    try {
      t.render(c.context);
      FAIL() << "expected raise_exception(\"" << *c.error << "\")";
    } catch (const TemplateException& e) {
      EXPECT_EQ(e.message(), *c.error);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Goldens, RealTemplate, testing::ValuesIn(golden_cases()),
                         [](const testing::TestParamInfo<GoldenCase>& i) { return i.param.label; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(RealTemplate);

}  // namespace
