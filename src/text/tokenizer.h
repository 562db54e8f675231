// A byte-level BPE tokenizer read from a Hugging Face `tokenizer.json`: the family GPT-2, Llama 3,
// Qwen, DeepSeek and MiniMax use. Encoding and decoding match Hugging Face `tokenizers` (the Rust
// library) for the subset it accepts; anything outside that subset is an error naming the part.
//
// Accepted tokenizer.json:
//   normalizer     null (NFC and every other normalizer: "unsupported normalizer X").
//   pre_tokenizer  ByteLevel, or Sequence of Split / Digits steps ending in ByteLevel. Split: pattern
//                  {"Regex": ...} or {"String": ...}, behavior Removed / Isolated / MergedWithPrevious /
//                  MergedWithNext / Contiguous, invert. ByteLevel: add_prefix_space, use_regex (the GPT-2
//                  regex). Digits: individual_digits. Regexes run on PCRE2 (JIT), translated so that \s,
//                  \S, \w, \W mean what they mean in Oniguruma, the engine Hugging Face uses.
//   model          BPE with vocab, merges ("a b" strings or ["a", "b"] pairs, rank = order),
//                  ignore_merges; dropout, continuing_subword_prefix, end_of_word_suffix null;
//                  byte_fallback false. Every one of the 256 byte symbols must be in the vocab.
//   added_tokens   special and not, matched before the pre-tokenizer (leftmost-longest, tokens with
//                  normalized=false first, as Hugging Face does), never split; single_word, lstrip,
//                  rstrip honoured.
//   decoder        ByteLevel.
//   post_processor null, ByteLevel, TemplateProcessing, or a Sequence of those: accepted but ignored;
//                  encode() never adds special tokens (the chat template or the caller adds BOS etc.).
//   truncation, padding: null.
//
// Decoding: special tokens decode to their text (Hugging Face's decode(ids, skip_special_tokens=False));
// bytes that are not valid UTF-8 become U+FFFD, one per maximal ill-formed subsequence (what Hugging
// Face's from_utf8_lossy does). An id outside the vocabulary is an error (Hugging Face silently drops it).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tpmoe::text {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false;
};

class Tokenizer {
 public:
  // Parses tokenizer.json text; `source` names it in error messages.
  static Tokenizer from_json(std::string_view json, const std::string& source = "tokenizer.json");
  // `path` is a tokenizer.json file or a folder holding one (a model folder).
  static Tokenizer from_file(const std::filesystem::path& path);

  // The ids of `text` (UTF-8; invalid UTF-8 is an error). No special tokens are added. Thread-safe
  // (calls from several threads take turns: the word cache is shared).
  std::vector<int32_t> encode(std::string_view text) const;
  // The text of `ids`, special tokens included.
  std::string decode(std::span<const int32_t> ids) const;
  // The raw bytes id `id` stands for (may be part of a UTF-8 sequence).
  const std::string& token_bytes(int32_t id) const;

  // One more than the largest id (ids in gaps are not in the vocabulary).
  int32_t vocab_size() const;
  bool is_valid_id(int32_t id) const;
  // The id of an added token's content or of a vocab entry (its tokenizer.json spelling).
  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::vector<AddedToken>& added_tokens() const;
  bool is_special(int32_t id) const;

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns ids into text as they arrive (generation): push() returns the text the id completes, holding
// back the bytes of a UTF-8 sequence that is incomplete but may still become valid. Bytes that can no
// longer become valid come out at once as U+FFFD (Hugging Face's DecodeStream instead holds text that
// ends in U+FFFD until more arrives). The concatenation of every push() and finish() equals
// decode(all ids).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}
  std::string push(int32_t id);
  // The held-back bytes, as U+FFFD (the stream ended inside a sequence); resets the decoder.
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  std::string pending_;  // at most 3 bytes: a valid but incomplete sequence
};

// A tokenizer.json for the built-in presets: byte-level BPE (the o200k-style regex MiniMax-like
// tokenizers use), ids 0..255 the bytes, then merges learned deterministically from a small embedded
// English corpus (a few hundred; the corpus runs out), then for large vocabularies placeholder tokens
// `<|tpmoe_unused_N|>` that no merge produces (encode never returns them), then the 7 special tokens at
// the end of the vocabulary, in this order: `<|endoftext|>`, and MiniMax M2's `]!p~[` (pad), `]~b]` (role
// start), `[e~[` (end of message, the eos), `]~!b[` (begin of sequence), `<think>`, `</think>`.
// vocab_size >= 263. Loads in Hugging Face tokenizers too (tested).
std::string make_preset_tokenizer_json(int vocab_size);

}  // namespace tpmoe::text
