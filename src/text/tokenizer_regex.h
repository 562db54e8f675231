// Internals shared by the tokenizer and the preset generator: the PCRE2 regex wrapper that iterates
// matches the way Hugging Face's Oniguruma wrapper does, and the GPT-2 byte-level alphabet.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

struct pcre2_real_code_8;
struct pcre2_real_match_data_8;

namespace tpmoe::text {

// The GPT-2 regex ByteLevel uses when use_regex is true.
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Rewrites an Oniguruma (Ruby syntax) pattern, as tokenizer.json holds it, into PCRE2 syntax with the
// same meaning where the two differ: \s / \S are Unicode White_Space (PCRE2's \s also takes U+180E),
// \w / \W are Alphabetic, marks, Nd and Pc (PCRE2 10.42's \w is only letters, numbers and '_').
// Throws for constructs whose meaning would differ and are not translated (\b, \B, \W inside a class).
std::string onig_to_pcre2(std::string_view pattern, const std::string& what);

// A compiled UTF-8 regex (PCRE2 with UTF and UCP, JIT when available). Not thread-safe: it owns its
// match data.
class Regex {
 public:
  // `literal`: the pattern is a plain string to find (Split's {"String": ...}). `what` names the
  // pattern in error messages.
  Regex(std::string_view pattern, bool literal, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls `on_match(start, end)` for each match in `subject` (well-formed UTF-8), left to right, as
  // the onig crate's find_iter yields them: after an empty match at the end of the previous match the
  // search moves on one character.
  template <class F>
  void for_each_match(std::string_view subject, F&& on_match) {
    size_t last_end = 0, last_match_end = 0;
    bool matched_before = false;
    size_t start = 0, end = 0;
    while (last_end <= subject.size()) {
      if (!find(subject, last_end, &start, &end)) return;
      if (start == end && matched_before && last_match_end == end) {
        last_end += last_end < subject.size() ? char_length(subject, last_end) : 1;
        continue;
      }
      last_end = end;
      last_match_end = end;
      matched_before = true;
      on_match(start, end);
    }
  }

  // Whether a match starts exactly at `pos`.
  bool matches_at(std::string_view subject, size_t pos);

 private:
  bool find(std::string_view subject, size_t from, size_t* start, size_t* end);
  static size_t char_length(std::string_view s, size_t pos);

  std::string what_;
  pcre2_real_code_8* code_ = nullptr;
  pcre2_real_match_data_8* match_data_ = nullptr;
  bool jit_ = false;
};

// GPT-2's byte <-> printable character table (bytes_to_unicode): printable Latin-1 bytes map to
// themselves, the others to U+0100 onwards in byte order.
char32_t byte_to_char(uint8_t b);
// The byte a character of the alphabet stands for, or -1.
int char_to_byte(char32_t c);

// Unicode White_Space (what Rust's char::is_whitespace and regex \s test).
bool is_white_space(char32_t c);

}  // namespace tpmoe::text
