// Byte-level BPE tokenizer from a Hugging Face tokenizer.json (see tokenizer.h for what is accepted).
//
// The pipeline mirrors Hugging Face `tokenizers` step for step, because matching its ids exactly is
// the point: added tokens are cut out first (two passes, as its AddedVocabulary does), each remaining
// piece runs through the pre-tokenizer steps (Split / Digits, then ByteLevel), and each final piece
// goes through BPE. One shortcut: ByteLevel maps every byte to one printable character and BPE works on
// those characters; here the vocabulary is mapped back to raw bytes once at load time, so BPE runs on
// the bytes directly and the mapping never happens per call.
#include "text/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <mutex>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "text/tokenizer_regex.h"
#include "text/utf8.h"

namespace tpmoe::text {

namespace {

using nlohmann::json;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One pre-tokenizer step: a Split (Digits is a Split on \p{N}) or the final ByteLevel.
struct Step {
  bool byte_level = false;
  std::unique_ptr<Regex> regex;  // Split's pattern, or ByteLevel's GPT-2 regex when use_regex
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;
};

struct Merge {
  int32_t rank, new_id;
};

// Added tokens of one matching pass, in a byte trie for leftmost-longest matching.
struct AddedTrie {
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    int32_t token = -1;  // index into Tokenizer::Impl::added
  };
  std::vector<Node> nodes{1};
  std::array<bool, 256> first_byte{};

  bool empty() const { return nodes.size() == 1; }
  void insert(std::string_view s, int32_t token) {
    int32_t n = 0;
    for (const char ch : s) {
      const uint8_t b = uint8_t(ch);
      int32_t next = -1;
      for (const auto& [c, child] : nodes[size_t(n)].children)
        if (c == b) next = child;
      if (next < 0) {
        next = int32_t(nodes.size());
        nodes[size_t(n)].children.emplace_back(b, next);
        nodes.emplace_back();
      }
      n = next;
    }
    if (nodes[size_t(n)].token < 0) nodes[size_t(n)].token = token;  // the first of duplicates wins
    first_byte[uint8_t(s[0])] = true;
  }
  // The longest token starting at `pos`: (token, end) or token -1.
  std::pair<int32_t, size_t> longest_at(std::string_view s, size_t pos) const {
    std::pair<int32_t, size_t> best{-1, pos};
    int32_t n = 0;
    for (size_t j = pos; j < s.size(); ++j) {
      int32_t next = -1;
      for (const auto& [c, child] : nodes[size_t(n)].children)
        if (c == uint8_t(s[j])) next = child;
      if (next < 0) break;
      n = next;
      if (nodes[size_t(n)].token >= 0) best = {nodes[size_t(n)].token, j + 1};
    }
    return best;
  }
};

// BPE results per word, in one open-addressing table over two arenas: no allocation per entry, one
// probe per hit in the common case. Cleared when full (words repeat, so it refills with the common ones).
class WordCache {
 public:
  static constexpr size_t kMaxEntries = size_t(1) << 18;

  static uint64_t hash(std::string_view w) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ w.size();
    size_t i = 0;
    for (; i + 8 <= w.size(); i += 8) {
      uint64_t v;
      std::memcpy(&v, w.data() + i, 8);
      h = (h ^ v) * 0xFF51AFD7ED558CCDull;
      h ^= h >> 32;
    }
    uint64_t tail = 0;
    std::memcpy(&tail, w.data() + i, w.size() - i);
    h = (h ^ tail) * 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 29);
  }

  // The cached ids of `w` (nullptr when absent); `*n` receives their count.
  const int32_t* find(std::string_view w, uint64_t h, size_t* n) const {
    if (slots_.empty()) return nullptr;
    for (size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.key_len == 0) return nullptr;
      if (s.hash == h && s.key_len == w.size() && std::memcmp(keys_.data() + s.key_off, w.data(), w.size()) == 0) {
        *n = s.ids_len;
        return ids_.data() + s.ids_off;
      }
    }
  }

  void insert(std::string_view w, uint64_t h, const int32_t* ids, size_t n) {
    if ((used_ + 1) * 2 > slots_.size()) {
      if (slots_.size() >= 2 * kMaxEntries) {
        clear();
      } else {
        rehash(std::max<size_t>(1024, slots_.size() * 2));
      }
    }
    place({h, uint32_t(keys_.size()), uint32_t(w.size()), uint32_t(ids_.size()), uint32_t(n)});
    keys_.append(w);
    ids_.insert(ids_.end(), ids, ids + n);
    ++used_;
  }

 private:
  struct Slot {
    uint64_t hash;
    uint32_t key_off, key_len, ids_off, ids_len;  // key_len 0: empty (words are never empty)
  };
  void place(const Slot& slot) {
    size_t i = slot.hash & (slots_.size() - 1);
    while (slots_[i].key_len != 0) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = slot;
  }
  void rehash(size_t size) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(size, Slot{});
    for (const Slot& s : old)
      if (s.key_len != 0) place(s);
  }
  void clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    ids_.clear();
    used_ = 0;
  }

  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<int32_t> ids_;
  size_t used_ = 0;
};

std::string read_whole_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TPMOE_CHECK(in, "{}: cannot open", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  TPMOE_CHECK(!in.bad(), "{}: read failed", path.string());
  return ss.str();
}

// The bytes Hugging Face's ByteLevel decoder turns a token's spelling into: the alphabet characters
// mapped back to bytes, or the spelling's own UTF-8 bytes if any character is outside the alphabet.
std::string spelling_to_bytes(std::string_view spelling, bool* all_in_alphabet) {
  std::string bytes;
  bytes.reserve(spelling.size());
  size_t pos = 0;
  while (pos < spelling.size()) {
    size_t len = 0;
    const int b = char_to_byte(decode_utf8_at(spelling, pos, &len));
    if (b < 0) {
      *all_in_alphabet = false;
      return std::string(spelling);
    }
    bytes += char(b);
    pos += len;
  }
  *all_in_alphabet = true;
  return bytes;
}

}  // namespace

struct Tokenizer::Impl {
  std::string source;  // the file name for error messages

  // Pre-tokenizer steps; the last is ByteLevel.
  std::vector<Step> steps;

  // BPE model. Vocab entries spelled in the byte alphabet, by their raw bytes: what BPE can produce.
  std::array<int32_t, 256> byte_ids{};
  StringMap<int32_t> bytes_to_id;
  std::unordered_map<uint64_t, Merge> merges;  // (left id << 32 | right id) -> rank, merged id
  bool ignore_merges = false;

  // Added tokens, and the two matching passes (normalized=false tokens first).
  std::vector<AddedToken> added;
  AddedTrie trie_raw, trie_normalized;
  std::unique_ptr<Regex> word_char;  // Rust regex \w, for single_word

  // Per id: its bytes for decoding, whether it exists, whether it is special; spellings for lookup.
  std::vector<std::string> id_bytes;
  std::vector<uint8_t> id_valid, id_special;
  StringMap<int32_t> spelling_to_id;

  // Encode state, guarded by `mutex`: the word cache (HF caches BPE results per word too) and scratch.
  mutable std::mutex mutex;
  mutable WordCache cache;
  mutable std::vector<std::vector<std::pair<size_t, size_t>>> spans;  // per Split step
  mutable std::vector<std::vector<std::tuple<size_t, size_t, bool>>> matches;
  mutable std::string prefixed;  // ByteLevel's add_prefix_space copy

  static constexpr size_t kCacheMaxWordBytes = 256;

  void parse(const json& j);
  void parse_normalizer(const json& j);
  void parse_pre_tokenizer(const json& j);
  void add_pre_tokenizer(const json& j, const std::string& where);
  void parse_model(const json& j);
  void parse_added_tokens(const json& j);
  void parse_decoder(const json& j);
  void parse_post_processor(const json& j, const std::string& where);

  void encode_added_pass(std::string_view text, const AddedTrie& trie, int pass, std::vector<int32_t>& out) const;
  void pre_tokenize(size_t step, std::string_view piece, std::vector<int32_t>& out) const;
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& out) const;
};

// ---- loading -------------------------------------------------------------------------------------

namespace {

const json& member(const json& j, const char* key, const std::string& where) {
  TPMOE_CHECK(j.is_object(), "{} must be a JSON object", where);
  const auto it = j.find(key);
  TPMOE_CHECK(it != j.end(), "{}: missing '{}'", where, key);
  return *it;
}

bool bool_member(const json& j, const char* key, bool fallback, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  TPMOE_CHECK(it->is_boolean(), "{}: '{}' must be true or false", where, key);
  return it->get<bool>();
}

std::string string_member(const json& j, const char* key, const std::string& where) {
  const json& v = member(j, key, where);
  TPMOE_CHECK(v.is_string(), "{}: '{}' must be a string", where, key);
  return v.get<std::string>();
}

// Fails on a key not in `known`: a field this code does not understand could change the result.
void check_keys(const json& j, std::initializer_list<const char*> known, const std::string& where) {
  for (const auto& [key, value] : j.items()) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    TPMOE_CHECK(ok, "{}: field '{}' is not supported", where, key);
  }
}

std::string type_of(const json& j, const std::string& where) {
  TPMOE_CHECK(j.is_object(), "{} must be a JSON object", where);
  const auto it = j.find("type");
  TPMOE_CHECK(it != j.end() && it->is_string(), "{}: missing 'type'", where);
  return it->get<std::string>();
}

}  // namespace

void Tokenizer::Impl::parse(const json& j) {
  TPMOE_CHECK(j.is_object(), "{}: the top level must be a JSON object", source);
  check_keys(j,
             {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "post_processor",
              "decoder", "model"},
             source);
  for (const char* k : {"truncation", "padding"}) {
    const auto it = j.find(k);
    TPMOE_CHECK(it == j.end() || it->is_null(), "{}: {} is not supported (must be null)", source, k);
  }
  parse_normalizer(j.contains("normalizer") ? j["normalizer"] : json());
  parse_pre_tokenizer(member(j, "pre_tokenizer", source));
  parse_model(member(j, "model", source));
  parse_added_tokens(j.contains("added_tokens") ? j["added_tokens"] : json::array());
  parse_decoder(member(j, "decoder", source));
  if (j.contains("post_processor")) parse_post_processor(j["post_processor"], source + ": post_processor");
}

void Tokenizer::Impl::parse_normalizer(const json& j) {
  if (j.is_null()) return;
  const std::string type = type_of(j, source + ": normalizer");
  // An empty Sequence changes nothing.
  if (type == "Sequence" && j.contains("normalizers") && j["normalizers"].is_array() && j["normalizers"].empty())
    return;
  TPMOE_FAIL("{}: normalizer type '{}' is not supported (only null)", source, type);
}

void Tokenizer::Impl::parse_pre_tokenizer(const json& j) {
  const std::string where = source + ": pre_tokenizer";
  TPMOE_CHECK(!j.is_null(), "{} is null: only byte-level BPE (a ByteLevel pre-tokenizer) is supported", where);
  add_pre_tokenizer(j, where);
  TPMOE_CHECK(!steps.empty() && steps.back().byte_level,
              "{} must end with ByteLevel (only byte-level BPE is supported)", where);
}

void Tokenizer::Impl::add_pre_tokenizer(const json& j, const std::string& where) {
  const std::string type = type_of(j, where);
  TPMOE_CHECK(steps.empty() || !steps.back().byte_level, "{}: a {} after ByteLevel is not supported", where, type);
  if (type == "Sequence") {
    check_keys(j, {"type", "pretokenizers"}, where);
    const json& list = member(j, "pretokenizers", where);
    TPMOE_CHECK(list.is_array(), "{}: 'pretokenizers' must be an array", where);
    for (size_t i = 0; i < list.size(); ++i) add_pre_tokenizer(list[i], fmt::format("{}.pretokenizers[{}]", where, i));
    return;
  }
  Step step;
  if (type == "Split") {
    check_keys(j, {"type", "pattern", "behavior", "invert"}, where);
    const json& pattern = member(j, "pattern", where);
    TPMOE_CHECK(pattern.is_object() && pattern.size() == 1 && pattern.begin().value().is_string(),
                "{}: 'pattern' must be {{\"Regex\": ...}} or {{\"String\": ...}}", where);
    const std::string kind = pattern.begin().key(), text = pattern.begin().value().get<std::string>();
    TPMOE_CHECK(kind == "Regex" || kind == "String", "{}: pattern kind '{}' is not supported", where, kind);
    const std::string what = where + " pattern";
    step.regex = kind == "Regex" ? std::make_unique<Regex>(onig_to_pcre2(text, what), false, what)
                                 : std::make_unique<Regex>(text, true, what);
    const std::string behavior = string_member(j, "behavior", where);
    if (behavior == "Removed")
      step.behavior = SplitBehavior::kRemoved;
    else if (behavior == "Isolated")
      step.behavior = SplitBehavior::kIsolated;
    else if (behavior == "MergedWithPrevious")
      step.behavior = SplitBehavior::kMergedWithPrevious;
    else if (behavior == "MergedWithNext")
      step.behavior = SplitBehavior::kMergedWithNext;
    else if (behavior == "Contiguous")
      step.behavior = SplitBehavior::kContiguous;
    else
      TPMOE_FAIL("{}: split behavior '{}' is not supported", where, behavior);
    step.invert = bool_member(j, "invert", false, where);
  } else if (type == "Digits") {
    check_keys(j, {"type", "individual_digits"}, where);
    // Rust's char::is_numeric is the N categories; each digit is a match, then merged or not.
    step.regex = std::make_unique<Regex>(R"(\p{N})", false, where);
    step.behavior =
        bool_member(j, "individual_digits", false, where) ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
  } else if (type == "ByteLevel") {
    check_keys(j, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, where);
    step.byte_level = true;
    step.add_prefix_space = bool_member(j, "add_prefix_space", true, where);
    if (bool_member(j, "use_regex", true, where))
      step.regex = std::make_unique<Regex>(onig_to_pcre2(kGpt2Pattern, where), false, where + " (GPT-2 regex)");
  } else {
    TPMOE_FAIL("{}: pre_tokenizer type '{}' is not supported", where, type);
  }
  steps.push_back(std::move(step));
}

void Tokenizer::Impl::parse_model(const json& j) {
  const std::string where = source + ": model";
  const std::string type = type_of(j, where);
  TPMOE_CHECK(type == "BPE", "{}: model type '{}' is not supported (only BPE)", where, type);
  check_keys(j,
             {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
              "byte_fallback", "ignore_merges", "vocab", "merges"},
             where);
  for (const char* k : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto it = j.find(k);
    TPMOE_CHECK(it == j.end() || it->is_null(), "{}: '{}' is not supported (must be null)", where, k);
  }
  TPMOE_CHECK(!bool_member(j, "byte_fallback", false, where), "{}: byte_fallback true is not supported", where);
  ignore_merges = bool_member(j, "ignore_merges", false, where);

  const json& vocab = member(j, "vocab", where);
  TPMOE_CHECK(vocab.is_object(), "{}: 'vocab' must be an object of token -> id", where);
  int64_t max_id = -1;
  for (const auto& [spelling, id] : vocab.items()) {
    TPMOE_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < (int64_t(1) << 30),
                "{}: vocab entry '{}' has id {}, not an integer in [0, 2^30)", where, spelling, id.dump());
    max_id = std::max(max_id, id.get<int64_t>());
  }
  TPMOE_CHECK(max_id >= 0, "{}: the vocab is empty", where);
  id_bytes.assign(size_t(max_id + 1), {});
  id_valid.assign(size_t(max_id + 1), 0);
  id_special.assign(size_t(max_id + 1), 0);
  bytes_to_id.reserve(vocab.size());
  spelling_to_id.reserve(vocab.size());
  for (const auto& [spelling, value] : vocab.items()) {
    const int32_t id = value.get<int32_t>();
    TPMOE_CHECK(!id_valid[size_t(id)], "{}: id {} is used by two vocab entries ('{}' and another)", where, id,
                spelling);
    TPMOE_CHECK(find_invalid_utf8(spelling) == std::string_view::npos, "{}: vocab entry {} is not valid UTF-8", where,
                id);
    id_valid[size_t(id)] = 1;
    bool in_alphabet = false;
    id_bytes[size_t(id)] = spelling_to_bytes(spelling, &in_alphabet);
    if (in_alphabet && !spelling.empty()) bytes_to_id.emplace(id_bytes[size_t(id)], id);
    spelling_to_id.emplace(spelling, id);
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = bytes_to_id.find(std::string(1, char(b)));
    std::string symbol;
    append_utf8(symbol, byte_to_char(uint8_t(b)));
    TPMOE_CHECK(it != bytes_to_id.end(), "{}: the vocab lacks byte 0x{:02X} (symbol '{}'): not a byte-level vocab",
                where, b, symbol);
    byte_ids[size_t(b)] = it->second;
  }
  const auto unk = j.find("unk_token");
  if (unk != j.end() && !unk->is_null()) {
    // Never used: every byte has a token, so nothing is unknown. It must still name a real token.
    TPMOE_CHECK(unk->is_string() && spelling_to_id.count(unk->get<std::string>()),
                "{}: unk_token {} is not in the vocab", where, unk->dump());
  }

  const json& list = member(j, "merges", where);
  TPMOE_CHECK(list.is_array(), "{}: 'merges' must be an array", where);
  merges.reserve(list.size());
  for (size_t rank = 0; rank < list.size(); ++rank) {
    const json& m = list[rank];
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      TPMOE_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                  "{}: merge #{} '{}' is not two tokens separated by one space", where, rank, s);
      left = s.substr(0, space), right = s.substr(space + 1);
    } else {
      TPMOE_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
                  "{}: merge #{} must be \"a b\" or [\"a\", \"b\"], is {}", where, rank, m.dump());
      left = m[0].get<std::string>(), right = m[1].get<std::string>();
    }
    const auto a = spelling_to_id.find(left), b = spelling_to_id.find(right), ab = spelling_to_id.find(left + right);
    TPMOE_CHECK(a != spelling_to_id.end(), "{}: merge #{}: token '{}' is not in the vocab", where, rank, left);
    TPMOE_CHECK(b != spelling_to_id.end(), "{}: merge #{}: token '{}' is not in the vocab", where, rank, right);
    TPMOE_CHECK(ab != spelling_to_id.end(), "{}: merge #{}: token '{}' is not in the vocab", where, rank, left + right);
    // A repeated pair takes its last rank, as in Hugging Face's map built in merge order.
    merges[uint64_t(uint32_t(a->second)) << 32 | uint32_t(b->second)] = {int32_t(rank), ab->second};
  }
}

void Tokenizer::Impl::parse_added_tokens(const json& j) {
  const std::string where = source + ": added_tokens";
  TPMOE_CHECK(j.is_array(), "{} must be an array", where);
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string at = fmt::format("{}[{}]", where, i);
    const json& t = j[i];
    check_keys(t, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"}, at);
    AddedToken a;
    const json& id = member(t, "id", at);
    TPMOE_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < (int64_t(1) << 30),
                "{}: id {} is not an integer in [0, 2^30)", at, id.dump());
    a.id = id.get<int32_t>();
    a.content = string_member(t, "content", at);
    TPMOE_CHECK(!a.content.empty(), "{}: empty content", at);
    TPMOE_CHECK(find_invalid_utf8(a.content) == std::string_view::npos, "{}: content is not valid UTF-8", at);
    a.special = bool_member(t, "special", false, at);
    a.single_word = bool_member(t, "single_word", false, at);
    a.lstrip = bool_member(t, "lstrip", false, at);
    a.rstrip = bool_member(t, "rstrip", false, at);
    // Hugging Face's default: special tokens are matched on the raw text, others after normalization.
    a.normalized = bool_member(t, "normalized", !a.special, at);

    const auto in_vocab = spelling_to_id.find(a.content);
    TPMOE_CHECK(in_vocab == spelling_to_id.end() || in_vocab->second == a.id,
                "{}: '{}' has id {} but the vocab gives it id {}", at, a.content, a.id, in_vocab->second);
    if (size_t(a.id) >= id_valid.size()) {
      id_bytes.resize(size_t(a.id) + 1);
      id_valid.resize(size_t(a.id) + 1, 0);
      id_special.resize(size_t(a.id) + 1, 0);
    }
    const bool same_token = in_vocab != spelling_to_id.end();
    TPMOE_CHECK(same_token || !id_valid[size_t(a.id)], "{}: id {} of '{}' is already taken", at, a.id, a.content);
    id_valid[size_t(a.id)] = 1;
    id_special[size_t(a.id)] = a.special;
    bool in_alphabet = false;
    id_bytes[size_t(a.id)] = spelling_to_bytes(a.content, &in_alphabet);
    spelling_to_id[a.content] = a.id;
    added.push_back(a);
  }
  // Hugging Face orders the matching sets: special tokens first, then the others; a repeated content
  // keeps its first entry.
  std::vector<size_t> order;
  for (size_t i = 0; i < added.size(); ++i)
    if (added[i].special) order.push_back(i);
  for (size_t i = 0; i < added.size(); ++i)
    if (!added[i].special) order.push_back(i);
  for (const size_t i : order) (added[i].normalized ? trie_normalized : trie_raw).insert(added[i].content, int32_t(i));
  const bool any_single_word = std::any_of(added.begin(), added.end(), [](const auto& a) { return a.single_word; });
  if (any_single_word)
    word_char = std::make_unique<Regex>(onig_to_pcre2(R"(\w)", where), false, where + " (single_word)");
}

void Tokenizer::Impl::parse_decoder(const json& j) {
  const std::string where = source + ": decoder";
  TPMOE_CHECK(!j.is_null(), "{} is null: only ByteLevel is supported", where);
  const std::string type = type_of(j, where);
  TPMOE_CHECK(type == "ByteLevel", "{}: decoder type '{}' is not supported (only ByteLevel)", where, type);
}

void Tokenizer::Impl::parse_post_processor(const json& j, const std::string& where) {
  if (j.is_null()) return;
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    const json& list = member(j, "processors", where);
    TPMOE_CHECK(list.is_array(), "{}: 'processors' must be an array", where);
    for (size_t i = 0; i < list.size(); ++i) parse_post_processor(list[i], fmt::format("{}.processors[{}]", where, i));
    return;
  }
  // Both only matter when special tokens are added or offsets are asked for; encode() does neither.
  TPMOE_CHECK(type == "ByteLevel" || type == "TemplateProcessing",
              "{}: post_processor type '{}' is not supported (ByteLevel, TemplateProcessing)", where, type);
}

// ---- encoding ------------------------------------------------------------------------------------

// Cuts the added tokens of `trie` out of `text` the way Hugging Face's AddedVocabulary::find_matches
// does (leftmost-longest, non-overlapping; single_word, lstrip, rstrip), then hands the pieces in
// between to the next pass (pass 0 -> 1) or the pre-tokenizer (pass 1).
void Tokenizer::Impl::encode_added_pass(std::string_view text, const AddedTrie& trie, int pass,
                                        std::vector<int32_t>& out) const {
  auto next = [&](std::string_view piece) {
    if (piece.empty()) return;
    if (pass == 0)
      encode_added_pass(piece, trie_normalized, 1, out);
    else
      pre_tokenize(0, piece, out);
  };
  if (trie.empty()) return next(text);
  size_t start_offset = 0, pos = 0;
  while (pos < text.size()) {
    if (!trie.first_byte[uint8_t(text[pos])]) {
      ++pos;
      continue;
    }
    auto [token, stop] = trie.longest_at(text, pos);
    if (token < 0) {
      ++pos;
      continue;
    }
    size_t start = pos;
    pos = stop;  // matches never overlap, whether kept or not
    const AddedToken& a = added[size_t(token)];
    if (a.single_word) {
      // Rust regex \w: a word character just before or just after means the match is inside a word.
      bool word_before = false;
      if (start > 0) {
        size_t b = start - 1;
        while (b > 0 && (uint8_t(text[b]) & 0xC0) == 0x80) --b;
        word_before = word_char->matches_at(text, b);
      }
      const bool word_after = stop < text.size() && word_char->matches_at(text, stop);
      if (word_before || word_after) continue;
    }
    if (a.lstrip) {
      size_t s = start;
      while (s > 0) {
        size_t b = s - 1;
        while (b > 0 && (uint8_t(text[b]) & 0xC0) == 0x80) --b;
        size_t len = 0;
        if (!is_white_space(decode_utf8_at(text, b, &len))) break;
        s = b;
      }
      start = std::max(s, start_offset);  // an earlier rstrip may have taken those spaces already
    }
    if (a.rstrip) {
      while (stop < text.size()) {
        size_t len = 0;
        if (!is_white_space(decode_utf8_at(text, stop, &len))) break;
        stop += len;
      }
    }
    if (start_offset < start) next(text.substr(start_offset, start - start_offset));
    out.push_back(a.id);
    // The search goes on from the match's end, not from `stop`: a match inside whitespace rstrip took
    // is still found (and overlaps), as in Hugging Face.
    start_offset = stop;
  }
  if (start_offset < text.size()) next(text.substr(start_offset));
}

void Tokenizer::Impl::pre_tokenize(size_t k, std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  const Step& step = steps[k];
  if (step.byte_level) {
    if (step.add_prefix_space && piece[0] != ' ') {
      prefixed.assign(1, ' ');
      prefixed.append(piece);
      piece = prefixed;  // the last step: nothing below overwrites `prefixed` while it is in use
    }
    if (!step.regex) return bpe(piece, out);
    size_t prev = 0;
    step.regex->for_each_match(piece, [&](size_t s, size_t e) {
      if (prev < s) bpe(piece.substr(prev, s - prev), out);
      if (s < e) bpe(piece.substr(s, e - s), out);
      prev = e;
    });
    if (prev < piece.size()) bpe(piece.substr(prev), out);
    return;
  }

  if (step.behavior == SplitBehavior::kIsolated && !step.invert) {  // the common case, without the lists
    size_t prev = 0;
    step.regex->for_each_match(piece, [&](size_t s, size_t e) {
      if (prev < s) pre_tokenize(k + 1, piece.substr(prev, s - prev), out);
      if (s < e) pre_tokenize(k + 1, piece.substr(s, e - s), out);
      prev = e;
    });
    if (prev < piece.size()) pre_tokenize(k + 1, piece.substr(prev), out);
    return;
  }

  // Split: Hugging Face's NormalizedString::split. The pieces cover the input: matches and the gaps
  // between them; `invert` swaps the two; the behavior decides which are merged or dropped.
  auto& m = matches[k];
  m.clear();
  size_t prev = 0;
  step.regex->for_each_match(piece, [&](size_t s, size_t e) {
    if (prev != s) m.emplace_back(prev, s, false);
    m.emplace_back(s, e, true);
    prev = e;
  });
  if (prev != piece.size()) m.emplace_back(prev, piece.size(), false);
  if (step.invert)
    for (auto& t : m) std::get<2>(t) = !std::get<2>(t);

  auto& sp = spans[k];
  sp.clear();
  switch (step.behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& [s, e, is_match] : m) sp.emplace_back(s, e);
      break;
    case SplitBehavior::kRemoved:
      for (const auto& [s, e, is_match] : m)
        if (!is_match) sp.emplace_back(s, e);
      break;
    case SplitBehavior::kContiguous: {
      bool previous = false;
      for (const auto& [s, e, is_match] : m) {
        if (is_match == previous && !sp.empty())
          sp.back().second = e;
        else
          sp.emplace_back(s, e);
        previous = is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous = false;
      for (const auto& [s, e, is_match] : m) {
        if (is_match && !previous && !sp.empty())
          sp.back().second = e;
        else
          sp.emplace_back(s, e);
        previous = is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous = false;
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        const auto& [s, e, is_match] = *it;
        if (is_match && !previous && !sp.empty())
          sp.back().first = s;
        else
          sp.emplace_back(s, e);
        previous = is_match;
      }
      std::reverse(sp.begin(), sp.end());
      break;
    }
  }
  for (const auto& [s, e] : sp)
    if (s < e) pre_tokenize(k + 1, piece.substr(s, e - s), out);
}

void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_ids[uint8_t(word[0])]);
    return;
  }
  if (ignore_merges) {
    const auto it = bytes_to_id.find(word);
    if (it != bytes_to_id.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() > kCacheMaxWordBytes) return bpe_uncached(word, out);
  const uint64_t h = WordCache::hash(word);
  size_t n = 0;
  if (const int32_t* hit = cache.find(word, h, &n)) {
    out.insert(out.end(), hit, hit + n);
    return;
  }
  const size_t first = out.size();
  bpe_uncached(word, out);
  cache.insert(word, h, out.data() + first, out.size() - first);
}

// Hugging Face's Word::merge_all: repeatedly merge the pair of lowest rank, leftmost first, with a
// heap of candidate merges whose stale entries are skipped.
void Tokenizer::Impl::bpe_uncached(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool removed;
  };
  struct Candidate {
    int32_t rank, pos, new_id;
    bool operator<(const Candidate& o) const {  // priority_queue pops the largest: invert
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  const int32_t n = int32_t(word.size());
  std::vector<Symbol> sym(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) sym[size_t(i)] = {byte_ids[uint8_t(word[size_t(i)])], i - 1, i + 1, false};
  sym[size_t(n - 1)].next = -1;
  auto lookup = [&](int32_t a, int32_t b) -> const Merge* {
    const auto it = merges.find(uint64_t(uint32_t(a)) << 32 | uint32_t(b));
    return it == merges.end() ? nullptr : &it->second;
  };
  std::priority_queue<Candidate> queue;
  for (int32_t i = 0; i + 1 < n; ++i)
    if (const Merge* m = lookup(sym[size_t(i)].id, sym[size_t(i + 1)].id)) queue.push({m->rank, i, m->new_id});
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& cur = sym[size_t(top.pos)];
    if (cur.removed || cur.next < 0) continue;
    const int32_t right = cur.next;
    const Merge* m = lookup(cur.id, sym[size_t(right)].id);
    if (!m || m->new_id != top.new_id) continue;  // stale: the pair changed since it was queued
    cur.id = top.new_id;
    sym[size_t(right)].removed = true;
    cur.next = sym[size_t(right)].next;
    if (cur.next >= 0) sym[size_t(cur.next)].prev = top.pos;
    if (cur.prev >= 0)
      if (const Merge* p = lookup(sym[size_t(cur.prev)].id, cur.id)) queue.push({p->rank, cur.prev, p->new_id});
    if (cur.next >= 0)
      if (const Merge* q = lookup(cur.id, sym[size_t(cur.next)].id)) queue.push({q->rank, top.pos, q->new_id});
  }
  for (int32_t i = 0; i >= 0; i = sym[size_t(i)].next) out.push_back(sym[size_t(i)].id);
}

// ---- Tokenizer -----------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json(std::string_view text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TPMOE_FAIL("{}: not valid JSON: {}", source, e.what());
  }
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  try {
    impl->parse(j);
  } catch (const json::exception& e) {  // a type mismatch the checks above did not name
    TPMOE_FAIL("{}: unexpected JSON structure: {}", source, e.what());
  }
  impl->spans.resize(impl->steps.size());
  impl->matches.resize(impl->steps.size());
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::filesystem::path& path) {
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(path)) {
    file = path / "tokenizer.json";
    TPMOE_CHECK(std::filesystem::is_regular_file(file), "{}: the folder holds no tokenizer.json", path.string());
  }
  return from_json(read_whole_file(file), file.string());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  const size_t bad = find_invalid_utf8(text);
  TPMOE_CHECK(bad == std::string_view::npos, "encode: the text is not valid UTF-8 (byte {} of {})", bad, text.size());
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->encode_added_pass(text, impl_->trie_raw, 0, out);
  return out;
}

bool Tokenizer::is_valid_id(int32_t id) const {
  return id >= 0 && size_t(id) < impl_->id_valid.size() && impl_->id_valid[size_t(id)];
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  TPMOE_CHECK(is_valid_id(id), "token id {} is not in the vocabulary (size {})", id, vocab_size());
  return impl_->id_bytes[size_t(id)];
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string bytes;
  for (const int32_t id : ids) bytes += token_bytes(id);
  std::string text;
  append_utf8_lossy(text, bytes, true);
  return text;
}

int32_t Tokenizer::vocab_size() const { return int32_t(impl_->id_valid.size()); }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->spelling_to_id.find(token);
  if (it == impl_->spelling_to_id.end()) return std::nullopt;
  return it->second;
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }

bool Tokenizer::is_special(int32_t id) const { return is_valid_id(id) && impl_->id_special[size_t(id)]; }

// ---- StreamDecoder -------------------------------------------------------------------------------

std::string StreamDecoder::push(int32_t id) {
  pending_ += tokenizer_->token_bytes(id);
  std::string text;
  const size_t used = append_utf8_lossy(text, pending_, false);
  pending_.erase(0, used);
  return text;
}

std::string StreamDecoder::finish() {
  std::string text;
  append_utf8_lossy(text, pending_, true);
  pending_.clear();
  return text;
}

}  // namespace tpmoe::text
