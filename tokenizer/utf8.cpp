#include "tokenizer/utf8.h"

#include <array>

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

struct ByteLevelTables {
  std::array<char32_t, 256> to_char{};
  std::array<int16_t, 324> to_byte{};  // characters below U+0144; the alphabet ends at U+0143
  ByteLevelTables() {
    to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_char[b] = printable ? static_cast<char32_t>(b) : next++;
      to_byte[to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelTables& byte_level() {
  static const ByteLevelTables t;
  return t;
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
    } else if (!final && n == rest.size()) {
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

void append_char(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

char32_t byte_to_char(uint8_t b) { return byte_level().to_char[b]; }

int char_to_byte(char32_t c) {
  const auto& t = byte_level().to_byte;
  return c < t.size() ? t[c] : -1;
}

bool is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

}  // namespace kestrel::utf8
