// The byte-level BPE tokenizer (src/text): the presets' generated tokenizer.json, round trips, the
// streaming decoder, every "not supported" / corrupt input error, and the comparison with Hugging Face
// `tokenizers` on generated strings (tests/tokenizer/compare_hf.py through `tpmoe tokenize`). Encode
// throughput is bench/bench_tokenize's.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "test_util.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace tpmoe::text {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const Tokenizer& tiny() {
  static const Tokenizer t = Tokenizer::from_json(make_preset_tokenizer_json(512), "tiny preset");
  return t;
}

// Expects `fn` to throw tpmoe::Error with a message holding `needle`.
template <class F>
void expect_error(F&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

// The tiny preset's json, edited.
std::string edited_tiny(const std::function<void(json&)>& edit) {
  json j = json::parse(make_preset_tokenizer_json(512));
  edit(j);
  return j.dump();
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
}

TEST(Tokenizer, PresetLayout) {
  const Tokenizer& t = tiny();
  EXPECT_EQ(t.vocab_size(), 512);
  // Specials at the end, MiniMax M2 names.
  EXPECT_EQ(t.token_to_id("</think>"), 511);
  EXPECT_EQ(t.token_to_id("<think>"), 510);
  EXPECT_EQ(t.token_to_id("[e~["), 508);
  EXPECT_EQ(t.token_to_id("]~b]"), 507);
  EXPECT_TRUE(t.is_special(508));
  EXPECT_FALSE(t.is_special(300));
  // Merges were learned: common English takes fewer tokens than bytes.
  const std::string text = "The model reads the text and writes the answer.";
  EXPECT_LT(t.encode(text).size(), text.size() / 2);

  const Tokenizer m3 = Tokenizer::from_json(make_preset_tokenizer_json(200064), "m3 preset");
  EXPECT_EQ(m3.vocab_size(), 200064);
  EXPECT_EQ(m3.token_to_id("</think>"), 200063);
  // Placeholders fill the middle and are never produced.
  const auto ids = m3.encode("<|tpmoe_unused_100000|> the quick brown fox");
  for (const int32_t id : ids) EXPECT_LT(id, 1000);
  EXPECT_EQ(m3.decode(ids), "<|tpmoe_unused_100000|> the quick brown fox");
  EXPECT_EQ(make_preset_tokenizer_json(512), make_preset_tokenizer_json(512));  // deterministic
}

TEST(Tokenizer, SpecialTokensMatchedInText) {
  const Tokenizer& t = tiny();
  const int32_t role = *t.token_to_id("]~b]"), end = *t.token_to_id("[e~["), think = *t.token_to_id("<think>");
  const auto ids = t.encode("]~b]user\nhi[e~[\n<think>x");
  ASSERT_GE(ids.size(), 5u);
  EXPECT_EQ(ids.front(), role);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), end), 1);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), think), 1);
  EXPECT_EQ(t.decode(ids), "]~b]user\nhi[e~[\n<think>x");
  // A partial special token is plain text.
  const auto partial = t.encode("<think");
  EXPECT_EQ(std::count(partial.begin(), partial.end(), think), 0);
}

TEST(Tokenizer, RoundTrip) {
  const Tokenizer& t = tiny();
  for (const std::string& s :
       std::vector<std::string>{"", " ", "hello world", "  two  spaces\n\n\ttab", "你好，世界", "e\u0301 combining",
                                "emoji 😀👍🏽 👨‍👩‍👧", "digits 1234567890 ١٢٣",
                                "code: for (int i = 0; i < n; ++i) { x[i] = 0; }", "\u00a0\u3000\u2028\u180e",
                                std::string("nul\0byte", 8)}) {
    EXPECT_EQ(t.decode(t.encode(s)), s) << s;
  }
  EXPECT_TRUE(t.encode("").empty());
}

TEST(Tokenizer, DecodeInvalidUtf8IsReplaced) {
  const Tokenizer& t = tiny();
  // Byte tokens: the vocab's ids for single bytes (encode of a one-byte ASCII text gives them directly).
  auto byte_id = [&](uint8_t b) {
    for (int32_t id = 0; id < t.vocab_size(); ++id)
      if (t.is_valid_id(id) && t.token_bytes(id) == std::string(1, char(b))) return id;
    throw std::runtime_error("no byte token");
  };
  const std::vector<int32_t> lone = {byte_id(0x80)}, truncated = {byte_id(0xE4), byte_id(0xBD), byte_id('A')},
                             surrogate = {byte_id(0xED), byte_id(0xA0), byte_id(0x80)};
  EXPECT_EQ(t.decode(lone), "\uFFFD");
  EXPECT_EQ(t.decode(truncated), "\uFFFDA");             // one U+FFFD for the maximal subpart E4 BD
  EXPECT_EQ(t.decode(surrogate), "\uFFFD\uFFFD\uFFFD");  // ED A0 is never valid: each byte alone
}

TEST(Tokenizer, StreamDecoderHoldsIncompleteSequences) {
  const Tokenizer& t = tiny();
  const auto ids = t.encode("a你");  // 你 = E4 BD A0: no merge covers it in the tiny preset
  ASSERT_EQ(ids.size(), 4u);
  StreamDecoder d(t);
  EXPECT_EQ(d.push(ids[0]), "a");
  EXPECT_EQ(d.push(ids[1]), "");
  EXPECT_EQ(d.push(ids[2]), "");
  EXPECT_EQ(d.push(ids[3]), "你");
  EXPECT_EQ(d.finish(), "");
  // Ended inside a sequence: the held bytes come out as one U+FFFD.
  EXPECT_EQ(d.push(ids[1]), "");
  EXPECT_EQ(d.finish(), "\uFFFD");
  // A byte that can never start or continue a sequence comes out at once.
  EXPECT_EQ(d.push(ids[3]), "\uFFFD");
}

TEST(Tokenizer, StreamDecoderEqualsDecode) {
  const Tokenizer& t = tiny();
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<int32_t> ids(1 + rng() % 12);
    for (auto& id : ids) id = int32_t(rng() % uint32_t(t.vocab_size()));
    StreamDecoder d(t);
    std::string streamed;
    for (const int32_t id : ids) streamed += d.push(id);
    streamed += d.finish();
    ASSERT_EQ(streamed, t.decode(ids)) << "trial " << trial;
    ASSERT_EQ(find_invalid_utf8(streamed), std::string_view::npos);
  }
}

TEST(Tokenizer, Errors) {
  expect_error([] { Tokenizer::from_json("{\"model\": ", "bad.json"); }, "bad.json: not valid JSON");
  expect_error([] { Tokenizer::from_json("[]"); }, "the top level must be a JSON object");
  expect_error([] { Tokenizer::from_file("/nonexistent/tokenizer.json"); }, "cannot open");
  expect_error(
      [] {
        Tokenizer::from_json(edited_tiny([](json& j) {
          j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
        }));
      },
      "pre_tokenizer type 'Metaspace' is not supported");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) {
                      j["normalizer"] = {{"type", "NFC"}};
                    })); },
               "normalizer type 'NFC' is not supported");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) { j["model"]["type"] = "WordPiece"; })); },
               "model type 'WordPiece' is not supported");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) { j["model"]["byte_fallback"] = true; })); },
               "byte_fallback true is not supported");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) { j["model"]["dropout"] = 0.1; })); },
               "'dropout' is not supported");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) {
                      j["decoder"] = {{"type", "Metaspace"}};
                    })); },
               "decoder type 'Metaspace' is not supported");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) { j["decoder"] = nullptr; })); }, "decoder is null");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) {
                      j["truncation"] = {{"max_length", 8}};
                    })); },
               "truncation is not supported");
  expect_error(
      [] {
        Tokenizer::from_json(edited_tiny([](json& j) { j["post_processor"] = {{"type", "BertProcessing"}}; }));
      },
      "post_processor type 'BertProcessing' is not supported");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) { j["model"]["vocab"].erase("Ġ"); })); },
               "lacks byte 0x20");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) {
                      j["model"]["merges"].push_back({"q", "zz"});
                    })); },
               "token 'zz' is not in the vocab");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) { j["model"]["merges"].push_back("a b c"); })); },
               "not two tokens separated by one space");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) { j["model"]["vocab"]["Ġthe"] = "x"; })); },
               "vocab entry 'Ġthe' has id \"x\"");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) { j["added_tokens"][0]["id"] = 5; })); },
               "is already taken");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) { j["added_tokens"][0]["weird"] = 1; })); },
               "field 'weird' is not supported");
  expect_error(
      [] {
        Tokenizer::from_json(
            edited_tiny([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }));
      },
      "invalid regex");
  expect_error(
      [] {
        Tokenizer::from_json(
            edited_tiny([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; }));
      },
      "split behavior 'Sideways' is not supported");
  expect_error([] { Tokenizer::from_json(edited_tiny([](json& j) {
                      j["pre_tokenizer"] = {{"type", "Digits"}};
                    })); },
               "must end with ByteLevel");

  const Tokenizer& t = tiny();
  expect_error([&] { t.decode(std::vector<int32_t>{1, 512}); }, "token id 512 is not in the vocabulary");
  expect_error([&] { t.decode(std::vector<int32_t>{-1}); }, "token id -1 is not in the vocabulary");
  expect_error([&] { t.encode("ok \xC3("); }, "not valid UTF-8 (byte 3 of 5)");

  const fs::path dir = test::make_temp_dir("tokenizer-errors");
  expect_error([&] { Tokenizer::from_file(dir); }, "the folder holds no tokenizer.json");
  write_file(dir / "tokenizer.json", make_preset_tokenizer_json(300));
  EXPECT_EQ(Tokenizer::from_file(dir).vocab_size(), 300);  // a model folder works
  fs::remove_all(dir);
}

TEST(Tokenizer, CliErrorsNameTheLine) {
  const fs::path dir = test::make_temp_dir("tokenizer-cli");
  write_file(dir / "tokenizer.json", make_preset_tokenizer_json(512));
  auto run = [&](const std::string& flags, const std::string& input) {
    write_file(dir / "input.jsonl", input);
    return test::run_cli(
        fmt::format("tokenize {} --tokenizer '{}' < '{}'", flags, dir.string(), (dir / "input.jsonl").string()));
  };
  auto r = run("", "\"hi\"\n42\n\"x\"\n");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("stdin line 2: expected a JSON string"), std::string::npos) << r.output;
  r = run("--decode", "[1,2]\n[1,99999]\n");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("stdin line 2: token id 99999 is not in the vocabulary"), std::string::npos) << r.output;
  r = run("", "\"hi\"\n{oops\n");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("stdin line 2: "), std::string::npos) << r.output;
  r = run("", "\"]~b]hi\"\n\"\"\n");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.substr(0, 5), "[507,") << r.output;
  EXPECT_NE(r.output.find("\n[]\n"), std::string::npos) << r.output;
  r = run("--decode", "[507,104,105]\n");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "\"]~b]hi\"\n");
  fs::remove_all(dir);
}

// The comparison with Hugging Face tokenizers: >= 10,000 strings per tokenizer, three regex styles and
// variants, plus the presets' generated tokenizer.json (which must load in Hugging Face).
TEST(Tokenizer, MatchesHuggingFace) {
  const fs::path script = fs::path(__FILE__).parent_path() / "tokenizer" / "compare_hf.py";
  ASSERT_TRUE(fs::exists(script)) << script;
  const fs::path dir = test::make_temp_dir("tokenizer-hf");
  write_file(dir / "tiny.json", make_preset_tokenizer_json(512));
  write_file(dir / "m3.json", make_preset_tokenizer_json(200064));
  const std::string cmd =
      fmt::format("timeout 600 python3 '{}' --cli '{}' --extra preset-tiny='{}' --extra preset-m3='{}' 2>&1",
                  script.string(), TPMOE_CLI_PATH, (dir / "tiny.json").string(), (dir / "m3.json").string());
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  const int status = pclose(pipe);
  std::printf("%s", out.c_str());
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("all match Hugging Face tokenizers"), std::string::npos) << out;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tpmoe::text
