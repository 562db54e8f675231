// PCRE2 wrapper, Oniguruma-to-PCRE2 pattern translation and the byte-level alphabet (see
// tokenizer_regex.h).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/tokenizer_regex.h"

#include <pcre2.h>

#include <array>

#include "core/error.h"

namespace tpmoe::text {

namespace {

// Oniguruma's (and Rust regex's) Unicode \w, as a class body.
constexpr const char* kWordClassBody = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control})";

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

std::string onig_to_pcre2(std::string_view p, const std::string& what) {
  std::string out;
  out.reserve(p.size() + 32);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[++i];
      switch (d) {
        case 's': out += R"(\p{White_Space})"; break;
        case 'S': out += R"(\P{White_Space})"; break;
        case 'w': out += in_class ? std::string(kWordClassBody) : "[" + std::string(kWordClassBody) + "]"; break;
        case 'W':
          TPMOE_CHECK(!in_class, "{}: \\W inside a character class is not supported", what);
          out += "[^" + std::string(kWordClassBody) + "]";
          break;
        case 'h': out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]"; break;  // Oniguruma: a hex digit
        case 'H':
          TPMOE_CHECK(!in_class, "{}: \\H inside a character class is not supported", what);
          out += "[^0-9a-fA-F]";
          break;
        case 'u':  // Ruby's \uHHHH
          TPMOE_CHECK(i + 4 < p.size(), "{}: truncated \\u escape", what);
          out += "\\x{" + std::string(p.substr(i + 1, 4)) + "}";
          i += 4;
          break;
        case 'b':
        case 'B':
          // Inside a class \b is a backspace in both engines; outside it is a word boundary whose
          // notion of a word differs between them.
          TPMOE_CHECK(in_class, "{}: \\{} (word boundary) is not supported", what, d);
          out += '\\';
          out += d;
          break;
        default: out += '\\'; out += d;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ']' is a literal
      continue;
    }
    if (c == '[' && in_class) {
      TPMOE_CHECK(i + 1 < p.size() && p[i + 1] == ':', "{}: nested character classes are not supported", what);
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(std::string_view pattern, bool literal, const std::string& what) : what_(what) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  // PCRE2_LITERAL admits no PCRE2_UCP (nothing in a literal depends on it).
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  code_ =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error, &offset, nullptr);
  TPMOE_CHECK(code_, "{}: invalid regex at offset {}: {}", what, size_t(offset), pcre2_message(error));
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  match_data_ = pcre2_match_data_create_from_pattern(code_, nullptr);
  TPMOE_CHECK(match_data_, "{}: out of memory", what);
}

Regex::~Regex() {
  pcre2_match_data_free(match_data_);
  pcre2_code_free(code_);
}

bool Regex::find(std::string_view subject, size_t from, size_t* start, size_t* end) {
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const int rc = jit_ ? pcre2_jit_match(code_, s, subject.size(), from, 0, match_data_, nullptr)
                      : pcre2_match(code_, s, subject.size(), from, PCRE2_NO_UTF_CHECK, match_data_, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  TPMOE_CHECK(rc >= 0, "{}: matching failed: {}", what_, pcre2_message(rc));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match_data_);
  *start = ov[0];
  *end = ov[1] < ov[0] ? ov[0] : ov[1];  // \K in a lookbehind can end a match before its start
  return true;
}

bool Regex::matches_at(std::string_view subject, size_t pos) {
  const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), pos,
                             PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, match_data_, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  TPMOE_CHECK(rc >= 0, "{}: matching failed: {}", what_, pcre2_message(rc));
  return true;
}

size_t Regex::char_length(std::string_view s, size_t pos) {
  const uint8_t b = uint8_t(s[pos]);
  return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

namespace {

struct ByteAlphabet {
  std::array<char32_t, 256> to_char{};
  std::array<int16_t, 324> to_byte{};  // every alphabet character is below U+0144
  ByteAlphabet() {
    to_byte.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = printable ? char32_t(b) : char32_t(256 + extra++);
      to_byte[to_char[b]] = int16_t(b);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

}  // namespace

char32_t byte_to_char(uint8_t b) { return alphabet().to_char[b]; }

int char_to_byte(char32_t c) { return c < alphabet().to_byte.size() ? alphabet().to_byte[c] : -1; }

bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

}  // namespace tpmoe::text
