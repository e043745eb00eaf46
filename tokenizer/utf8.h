// UTF-8 helpers shared by the tokenizers: validity, the two ways of replacing invalid bytes
// with U+FFFD, code points, GPT-2's byte-level alphabet and byte_fallback's <0xNN> tokens.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kestrel::utf8 {

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Length of the character at the start of `s` when it is complete and valid (RFC 3629: no
// overlong forms, no surrogates, nothing past U+10FFFF), else 0.
size_t char_len(std::string_view s);

// Length of the longest prefix of `s` that is the start of some valid character (at least 1
// for non-empty `s`): the "maximal subpart" that Unicode's recommended practice, WHATWG's
// decoder, Python and Rust's from_utf8_lossy replace with one U+FFFD. When `s` starts with a
// valid character this is its length.
size_t maximal_subpart(std::string_view s);

// Whether `s` is a proper prefix of a valid character: more bytes can still complete it.
bool incomplete_char(std::string_view s);

// `s` with every maximal invalid subpart replaced by U+FFFD (valid input is returned as is).
std::string sanitize(std::string_view s);
bool valid(std::string_view s);

// Decodes the leading bytes of `bytes` that are final, replacing maximal invalid subparts
// with U+FFFD, and erases them. When `final` is false, a trailing incomplete character (a
// proper prefix of a valid one) stays; bytes that no continuation can make valid (a lone
// continuation byte, 0xC0, 0xF5-0xFF, a truncated sequence followed by more) are replaced at
// once.
std::string drain(std::string& bytes, bool final);

// The code point at the start of valid UTF-8 `s`, and its length in bytes.
char32_t decode_char(std::string_view s, size_t* len);

// GPT-2's byte-level alphabet spells each byte as a printable character (bytes 0x21-0x7E,
// 0xA1-0xAC and 0xAE-0xFF as themselves, the others as U+0100 onward in byte order). Sets
// `out` to the bytes that the characters of `token` (valid UTF-8) stand for; false when one
// of them is outside the alphabet.
bool byte_level_to_bytes(std::string_view token, std::string& out);

// The byte of a byte_fallback token "<0xNN>" (two hex digits, either case), -1 for any other
// token.
int byte_token(std::string_view token);

// Unicode White_Space (what Oniguruma's and Rust's \s match).
bool is_whitespace(char32_t c);

}  // namespace kestrel::utf8
