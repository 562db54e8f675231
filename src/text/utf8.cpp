// UTF-8 validation, decoding and lossy conversion (see utf8.h).
#include "text/utf8.h"

#include <cstring>

namespace tpmoe::text {

namespace {

// Length of the sequence a lead byte announces (0: not a lead byte) and the allowed range of the
// second byte, per the well-formed byte sequences table of the Unicode standard (Table 3-7).
struct LeadInfo {
  int length;
  uint8_t second_lo, second_hi;
};

LeadInfo lead_info(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};  // no surrogates
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};  // nothing above U+10FFFF
  return {0, 0, 0};
}

// How many bytes from `pos` form a valid prefix of a sequence (== length when complete).
int valid_prefix(std::string_view s, size_t pos, const LeadInfo& info) {
  int n = 1;
  for (; n < info.length && pos + n < s.size(); ++n) {
    const uint8_t c = uint8_t(s[pos + n]);
    const bool ok = n == 1 ? (c >= info.second_lo && c <= info.second_hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) break;
  }
  return n;
}

}  // namespace

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII runs, 8 bytes at a time.
    uint64_t word;
    while (i + 8 <= s.size() && (std::memcpy(&word, s.data() + i, 8), (word & 0x8080808080808080ull) == 0)) i += 8;
    if (i >= s.size()) break;
    const uint8_t b = uint8_t(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    const LeadInfo info = lead_info(b);
    if (info.length == 0 || valid_prefix(s, i, info) != info.length) return i;
    i += size_t(info.length);
  }
  return std::string_view::npos;
}

char32_t decode_utf8_at(std::string_view s, size_t pos, size_t* len) {
  const uint8_t b = uint8_t(s[pos]);
  if (b < 0x80) {
    *len = 1;
    return b;
  }
  const int n = b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
  char32_t cp = b & (0x7F >> n);
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (uint8_t(s[pos + k]) & 0x3F);
  *len = size_t(n);
  return cp;
}

size_t append_utf8_lossy(std::string& out, std::string_view bytes, bool final) {
  size_t i = 0;
  while (i < bytes.size()) {
    const uint8_t b = uint8_t(bytes[i]);
    if (b < 0x80) {
      out += char(b);
      ++i;
      continue;
    }
    const LeadInfo info = lead_info(b);
    if (info.length == 0) {
      append_utf8(out, kReplacementChar);
      ++i;
      continue;
    }
    const int n = valid_prefix(bytes, i, info);
    if (n == info.length) {
      out.append(bytes.substr(i, size_t(n)));
    } else if (i + size_t(n) == bytes.size() && !final) {
      return i;  // incomplete, may still complete: hold it back
    } else {
      append_utf8(out, kReplacementChar);  // one U+FFFD for the maximal ill-formed subpart
    }
    i += size_t(n);
  }
  return i;
}

}  // namespace tpmoe::text
