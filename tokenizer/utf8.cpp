#include "tokenizer/utf8.h"

#include <array>
#include <cstdint>

namespace kestrel::utf8 {

namespace {

// The length a lead byte announces and the range its second byte must lie in (which rules
// out overlong forms, surrogates and code points past U+10FFFF); need 0 for bytes that never
// start a character.
struct Lead {
  uint8_t need, lo, hi;
};

Lead lead(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// GPT-2's byte-level alphabet, character -> byte (-1 outside it); the alphabet's characters
// are all below U+0144.
struct ByteLevelTable {
  std::array<int16_t, 0x144> to_byte{};
  ByteLevelTable() {
    to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_byte[printable ? static_cast<char32_t>(b) : next++] = static_cast<int16_t>(b);
    }
  }
};

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

size_t maximal_subpart(std::string_view s) {
  if (s.empty()) return 0;
  const auto b = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const Lead l = lead(b(0));
  if (l.need <= 1) return 1;
  if (s.size() < 2 || b(1) < l.lo || b(1) > l.hi) return 1;
  size_t i = 2;
  while (i < l.need && i < s.size() && (b(i) & 0xC0) == 0x80) ++i;
  return i;
}

size_t char_len(std::string_view s) {
  if (s.empty()) return 0;
  const size_t need = lead(static_cast<uint8_t>(s[0])).need;
  return need > 0 && maximal_subpart(s) == need ? need : 0;
}

bool incomplete_char(std::string_view s) {
  if (s.empty()) return false;
  const size_t need = lead(static_cast<uint8_t>(s[0])).need;
  return s.size() < need && maximal_subpart(s) == s.size();
}

bool valid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = char_len(s.substr(i));
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string drain(std::string& bytes, bool final) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const std::string_view rest = std::string_view(bytes).substr(i);
    if (static_cast<uint8_t>(rest[0]) < 0x80) {
      out += rest[0];
      ++i;
      continue;
    }
    const size_t n = maximal_subpart(rest);
    if (n == lead(static_cast<uint8_t>(rest[0])).need) {
      out.append(rest.substr(0, n));
    } else if (!final && incomplete_char(rest)) {
      break;  // may still complete
    } else {
      out.append(kReplacement);
    }
    i += n;
  }
  bytes.erase(0, i);
  return out;
}

std::string sanitize(std::string_view s) {
  if (valid(s)) return std::string(s);
  std::string bytes(s);
  return drain(bytes, /*final=*/true);
}

char32_t decode_char(std::string_view s, size_t* len) {
  const auto b = [&](size_t i) { return static_cast<char32_t>(static_cast<uint8_t>(s[i])); };
  const size_t n = lead(static_cast<uint8_t>(s[0])).need;
  *len = n == 0 ? 1 : n;
  switch (n) {
    case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    case 4:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
    default: return b(0);
  }
}

bool byte_level_to_bytes(std::string_view token, std::string& out) {
  static const ByteLevelTable table;
  out.clear();
  for (size_t i = 0; i < token.size();) {
    size_t len = 0;
    const char32_t c = decode_char(token.substr(i), &len);
    const int b = c < table.to_byte.size() ? table.to_byte[c] : -1;
    if (b < 0) return false;
    out += static_cast<char>(b);
    i += len;
  }
  return true;
}

int byte_token(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return -1;
  const int hi = hex_digit(token[3]), lo = hex_digit(token[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

bool is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

}  // namespace kestrel::utf8
