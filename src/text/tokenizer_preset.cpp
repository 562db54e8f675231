// make_preset_tokenizer_json: the tokenizer.json of the built-in presets (tiny, m3), learned here by
// byte-level BPE from a small embedded English corpus, so that the random-weight presets can take and
// give text. The merges are deterministic (most frequent pair first, ties broken by the pair's bytes).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <unordered_map>

#include "core/error.h"
#include "text/tokenizer.h"
#include "text/tokenizer_regex.h"
#include "text/utf8.h"

namespace tpmoe::text {

namespace {

// The o200k-style split MiniMax-like tokenizers use: letter runs with their case shape and a leading
// non-letter, 1-3 digits, punctuation runs, whitespace.
constexpr const char* kPresetPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Special tokens, in id order at the end of the vocabulary. MiniMax M2 spells its pad, role start, end
// of message and begin of sequence markers like this; <think> / </think> bracket the reasoning.
constexpr const char* kSpecialTokens[] = {"<|endoftext|>", "]!p~[", "]~b]", "[e~[", "]~!b[", "<think>", "</think>"};
constexpr int kNumSpecialTokens = int(std::size(kSpecialTokens));

// A few paragraphs of plain English (written for this file) to learn merges from.
constexpr const char* kCorpus = R"(The quick brown fox jumps over the lazy dog, and the dog does not seem to mind.
In the morning the town was quiet. People walked to work, children went to school, and the bakery on the
corner opened its doors at seven. The smell of fresh bread filled the street, and everyone who passed by
stopped for a moment to look through the window.
A model reads text as a sequence of tokens. Each token is a number, and the numbers are what the network
sees. When the model writes, it picks the next token, then the next one, until it decides that the answer
is complete. Good tokenizers keep common words whole and split rare words into smaller pieces.
She said that she would be there at 10:30, but the train was late, so she arrived at 11:45 instead.
It's not the first time this has happened; they've asked the company to fix the schedule, and we'll see
whether anything changes. I'm sure it will take time.
Water boils at 100 degrees Celsius at sea level. The boiling point is lower on a mountain, because the air
pressure there is lower. Cooking pasta at high altitude therefore takes a little longer than it does at
the beach.
The history of the city goes back more than two thousand years. It was founded on the banks of a river,
where traders met to exchange grain, salt, wool and metal. Over the centuries the city grew, burned, was
rebuilt, and grew again. Today it is known for its museums, its parks and its long summer evenings.
Please remember to close the window before you leave the house. If it rains, the floor near the desk gets
wet, and the papers on the desk will be ruined. Thank you for your help!
Questions and answers: What is the capital of France? Paris. How many days are there in a week? Seven.
Which planet is closest to the sun? Mercury. Who wrote the play about the prince of Denmark? Shakespeare.
The engineers measured the speed of the new system and compared it with the old one. The new system was
faster on every test, although the difference was small when the input was short. They wrote a report,
shared the numbers with the team, and planned the next set of experiments for the following week.
)";

// Learns up to `max_merges` merges (pairs seen at least twice) from the corpus. Tokens are byte strings;
// ids 0..255 are the bytes.
struct Learned {
  std::vector<std::string> tokens;                  // by id
  std::vector<std::pair<int32_t, int32_t>> merges;  // in rank order
};

Learned learn_merges(int max_merges) {
  Learned l;
  for (int b = 0; b < 256; ++b) l.tokens.emplace_back(1, char(b));
  std::map<std::string, int64_t> word_counts;
  Regex split(onig_to_pcre2(kPresetPattern, "preset pattern"), false, "preset pattern");
  const std::string_view corpus = kCorpus;
  size_t prev = 0;
  split.for_each_match(corpus, [&](size_t s, size_t e) {
    if (prev < s) ++word_counts[std::string(corpus.substr(prev, s - prev))];
    if (s < e) ++word_counts[std::string(corpus.substr(s, e - s))];
    prev = e;
  });
  if (prev < corpus.size()) ++word_counts[std::string(corpus.substr(prev))];
  std::vector<std::pair<std::vector<int32_t>, int64_t>> words;
  for (const auto& [w, count] : word_counts) {
    std::vector<int32_t> ids;
    for (const char c : w) ids.push_back(uint8_t(c));
    words.emplace_back(std::move(ids), count);
  }
  std::unordered_map<std::string, int32_t> id_of;
  for (int32_t i = 0; i < 256; ++i) id_of[l.tokens[size_t(i)]] = i;

  while (int(l.merges.size()) < max_merges) {
    std::map<std::pair<int32_t, int32_t>, int64_t> counts;
    for (const auto& [ids, count] : words)
      for (size_t i = 0; i + 1 < ids.size(); ++i) counts[{ids[i], ids[i + 1]}] += count;
    const std::pair<int32_t, int32_t>* best = nullptr;
    int64_t best_count = 1;  // a pair seen once is not worth a token
    for (const auto& [pair, count] : counts) {
      const bool better =
          count > best_count || (count == best_count && best &&
                                 std::tie(l.tokens[size_t(pair.first)], l.tokens[size_t(pair.second)]) <
                                     std::tie(l.tokens[size_t(best->first)], l.tokens[size_t(best->second)]));
      if (better) best = &pair, best_count = count;
    }
    if (!best) break;
    const auto [a, b] = *best;
    const std::string merged = l.tokens[size_t(a)] + l.tokens[size_t(b)];
    auto [it, fresh] = id_of.emplace(merged, int32_t(l.tokens.size()));
    if (fresh) l.tokens.push_back(merged);
    l.merges.emplace_back(a, b);
    for (auto& [ids, count] : words) {
      std::vector<int32_t> next;
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i + 1 < ids.size() && ids[i] == a && ids[i + 1] == b) {
          next.push_back(it->second);
          ++i;
        } else {
          next.push_back(ids[i]);
        }
      }
      ids = std::move(next);
    }
  }
  return l;
}

// A token's tokenizer.json spelling: its bytes through the byte-level alphabet.
std::string spelling(const std::string& bytes) {
  std::string s;
  for (const char c : bytes) append_utf8(s, byte_to_char(uint8_t(c)));
  return s;
}

std::string json_quoted(const std::string& s) { return nlohmann::json(s).dump(); }

}  // namespace

std::string make_preset_tokenizer_json(int vocab_size) {
  TPMOE_CHECK(vocab_size >= 256 + kNumSpecialTokens,
              "preset tokenizer: vocab_size {} is below {} (256 bytes + {} specials)", vocab_size,
              256 + kNumSpecialTokens, kNumSpecialTokens);
  const int model_size = vocab_size - kNumSpecialTokens;
  const Learned l = learn_merges(model_size - 256);
  std::vector<std::string> vocab;
  for (const auto& t : l.tokens) vocab.push_back(spelling(t));
  // Placeholders fill the vocabulary up to the specials. No merge produces them, so encode() never
  // returns them; the model's embedding rows exist for them all the same.
  for (int i = int(vocab.size()); i < model_size; ++i) vocab.push_back(fmt::format("<|tpmoe_unused_{}|>", i));

  std::string out;
  out.reserve(size_t(vocab_size) * 32);
  out += "{\"version\":\"1.0\",\"truncation\":null,\"padding\":null,\"added_tokens\":[";
  for (int i = 0; i < kNumSpecialTokens; ++i)
    out += fmt::format(
        "{}{{\"id\":{},\"content\":{},\"single_word\":false,\"lstrip\":false,\"rstrip\":false,\"normalized\":false,"
        "\"special\":true}}",
        i ? "," : "", model_size + i, json_quoted(kSpecialTokens[i]));
  out += "],\"normalizer\":null,\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[";
  out += fmt::format("{{\"type\":\"Split\",\"pattern\":{{\"Regex\":{}}},\"behavior\":\"Isolated\",\"invert\":false}},",
                     json_quoted(kPresetPattern));
  out += "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":false}]},";
  out +=
      "\"post_processor\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"trim_offsets\":false,"
      "\"use_regex\":true},";
  out += "\"decoder\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"trim_offsets\":true,\"use_regex\":true},";
  out +=
      "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"continuing_subword_prefix\":null,"
      "\"end_of_word_suffix\":null,\"fuse_unk\":false,\"byte_fallback\":false,\"ignore_merges\":false,\"vocab\":{";
  for (size_t i = 0; i < vocab.size(); ++i) out += fmt::format("{}{}:{}", i ? "," : "", json_quoted(vocab[i]), i);
  out += "},\"merges\":[";
  for (size_t i = 0; i < l.merges.size(); ++i)
    out += fmt::format("{}[{},{}]", i ? "," : "", json_quoted(vocab[size_t(l.merges[i].first)]),
                       json_quoted(vocab[size_t(l.merges[i].second)]));
  out += "]}}\n";
  return out;
}

}  // namespace tpmoe::text
