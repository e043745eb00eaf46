// JSON Schema to GBNF, for response_format json_schema (docs/grammar.md lists the keywords
// kept and refused). The grammar's whitespace is bounded as llama.cpp's
// json-schema-to-grammar bounds it, so that a model cannot loop forever inside a value.
#pragma once

#include <string>

namespace kestrel::grammar {

// The GBNF of the values `schema_text` accepts, start rule "root". Throws kestrel::Error with
// one line naming the keyword and its JSON pointer ("json schema: /properties/a: unsupported
// keyword 'not'") for what it does not support, and naming the problem for invalid JSON.
std::string json_schema_to_gbnf(const std::string& schema_text);

// The GBNF of any JSON object (response_format json_object, --json-object).
std::string json_object_gbnf();

// A GBNF string literal matching exactly these bytes (quotes, backslashes and control bytes
// escaped).
std::string gbnf_literal(const std::string& s);

}  // namespace kestrel::grammar
