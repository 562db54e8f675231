// UTF-8 helpers the tokenizer needs: validation, decoding one code point, and the lossy conversion
// Hugging Face tokenizers applies when decoding (Rust's String::from_utf8_lossy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tpmoe::text {

inline constexpr char32_t kReplacementChar = 0xFFFD;

// Appends the UTF-8 encoding of `cp` (a Unicode scalar value) to `out`.
void append_utf8(std::string& out, char32_t cp);

// Byte offset of the first byte that starts an ill-formed UTF-8 sequence in `s`, or npos when `s` is
// well-formed (no surrogates, no overlong forms, nothing above U+10FFFF).
size_t find_invalid_utf8(std::string_view s);

// Decodes the code point starting at `s[pos]` of a string known to be well-formed; `*len` receives its
// byte length.
char32_t decode_utf8_at(std::string_view s, size_t pos, size_t* len);

// Appends `bytes` to `out` as text, replacing each maximal ill-formed subsequence with one U+FFFD (the
// Unicode "substitution of maximal subparts" practice, which is what Rust's from_utf8_lossy and so
// Hugging Face's decode do). With `final` false, a trailing sequence that is incomplete but could still
// become valid is left unconsumed; the return value is the number of bytes consumed.
size_t append_utf8_lossy(std::string& out, std::string_view bytes, bool final);

}  // namespace tpmoe::text
