// The `tpmoe` command's contract (src/cli/main.cpp): subcommands and their outputs, and how it fails
// on bad input: exit status 1 and one "error: ..." line that names the file, tensor or field to fix,
// never a crash, an uncaught exception or a hang.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/presets.h"
#include "test_util.h"

namespace tpmoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The CLI dumps the engine's fp32 logits; the reference is fp32 math on the same bf16 weights, so
// only summation order differs (the tolerance test_fixture holds the engine to).
constexpr double kFixtureTolerance = 1e-4;

std::string quoted(const fs::path& p) { return "'" + p.string() + "'"; }

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
}

// Rewrites the JSON header of the safetensors file at `path` through `edit`, keeping the data area.
void edit_safetensors_header(const fs::path& path, const std::function<void(json&)>& edit) {
  const std::string bytes = read_file(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  json header = json::parse(bytes.substr(8, n));
  edit(header);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char(uint64_t(text.size()) >> (8 * i));
  write_file(path, out + text + bytes.substr(8 + n));
}

// The run failed the way the contract says: status 1 (not a signal, not a hang) and exactly one
// "error: ..." line (other output, like inspect's "checkpoint:" line, may precede it), holding every
// one of `needles`.
void expect_clean_error(const test::CommandResult& r, std::initializer_list<std::string> needles) {
  EXPECT_NE(r.exit_code, test::kCliHung) << "hung: " << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  for (const char* crash : {"terminate called", "Segmentation", "Aborted", "core dumped"})
    EXPECT_EQ(r.output.find(crash), std::string::npos) << r.output;
  std::istringstream lines(r.output);
  std::vector<std::string> errors;
  for (std::string line; std::getline(lines, line);)
    if (line.find("error") != std::string::npos) errors.push_back(line);
  ASSERT_EQ(errors.size(), 1u) << r.output;
  EXPECT_EQ(errors[0].rfind("error: ", 0), 0u) << r.output;
  for (const auto& n : needles) EXPECT_NE(errors[0].find(n), std::string::npos) << "'" << n << "' not in: " << r.output;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::make_temp_dir("cli"); }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path fixture() const { return test::fixtures_dir() / "m3-tiny"; }
  // A writable copy of the fixture checkpoint, to break.
  fs::path copy_fixture() const {
    const fs::path out = dir_ / "m3-tiny";
    fs::copy(fixture(), out);
    return out;
  }
  // The tiny preset cut to 2 layers (layer 0 dense + full attention, layer 1 MoE + sparse), written
  // by the library with `edit` applied to its layout-A tensors first.
  fs::path write_tiny(const std::function<void(std::map<std::string, io::OwnedTensor>&)>& edit) const {
    const ModelConfig config = preset_config("tiny", 2);
    auto tensors = random_weights(config, 3);
    edit(tensors);
    const fs::path out = dir_ / "tiny";
    io::write_checkpoint(out, config, tensors, io::CheckpointLayout::kTransformers);
    return out;
  }
  // `generate` on a (broken) checkpoint directory: the cheapest command that reads every weight.
  test::CommandResult generate_on(const fs::path& model) const {
    return test::run_cli("generate --model " + quoted(model) + " --prompt-ids 1,2,3 --max-new-tokens 2");
  }

  fs::path dir_;
};

TEST_F(Cli, HelpOfEverySubcommandExitsZero) {
  for (const char* cmd :
       {"", "generate ", "make-model ", "inspect ", "bench ", "bench serve ", "chat ", "serve ", "tokenize "}) {
    const auto r = test::run_cli(std::string(cmd) + "--help");
    EXPECT_EQ(r.exit_code, 0) << cmd << r.output;
    EXPECT_NE(r.output.find("Usage"), std::string::npos) << cmd << r.output;
  }
}

// inspect prints the fusion plan of a checkpoint without loading weights, stage ends included.
TEST_F(Cli, MakeModelThenInspectPrintsThePlan) {
  const fs::path model = dir_ / "tiny";
  const auto made = test::run_cli("make-model --preset tiny --out " + quoted(model));
  ASSERT_EQ(made.exit_code, 0) << made.output;
  const auto r = test::run_cli("inspect --model " + quoted(model) + " --tp 2 --pp-stages 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"fusion plan (tp=2)", "stage end", "allreduce+norm", "rank 0", "rank 1"})
    EXPECT_NE(r.output.find(s), std::string::npos) << "'" << s << "' not in:\n" << r.output;
}

// --dump writes what the fixture's reference holds, in the same shapes and dtypes, so the two files
// can be compared tensor by tensor.
TEST_F(Cli, TeacherForcedDumpMatchesReference) {
  const fs::path out = dir_ / "out.safetensors";
  // --device cpu: the CLI picks the GPU where one is visible, and this compares at the fp32 bound.
  const auto r = test::run_cli("generate --device cpu --model " + quoted(fixture()) + " --input " +
                               quoted(fixture() / "reference.safetensors") + " --teacher-force --dump " + quoted(out));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto dump = io::SafetensorsSet::open_file(out);
  const test::FixtureReference ref = test::load_fixture_reference();

  const io::TensorView* prefill = dump.find("prefill_logits");
  const io::TensorView* steps = dump.find("step_logits");
  const io::TensorView* ids = dump.find("generated_ids");
  ASSERT_TRUE(prefill && steps && ids);
  EXPECT_EQ(prefill->dtype, DType::kF32);
  EXPECT_EQ(prefill->shape, (std::vector<int64_t>{1, 40, 512}));
  EXPECT_EQ(steps->dtype, DType::kF32);
  EXPECT_EQ(steps->shape, (std::vector<int64_t>{12, 1, 512}));
  EXPECT_EQ(ids->dtype, DType::kI64);
  EXPECT_EQ(ids->shape, (std::vector<int64_t>{1, 12}));
  const auto got_ids = io::to_i64(*ids);
  EXPECT_EQ(std::vector<int32_t>(got_ids.begin(), got_ids.end()), ref.generated[0]);
  EXPECT_LT(test::relative_l2(io::to_f32(*prefill), ref.prefill_logits), kFixtureTolerance);
  EXPECT_LT(test::relative_l2(io::to_f32(*steps), ref.step_logits), kFixtureTolerance);
}

// The hub layout is the same model under other names: same seed, same tokens.
TEST_F(Cli, HubLayoutGeneratesSameIdsAsHfLayout) {
  std::vector<int64_t> ids[2];
  int i = 0;
  for (const char* layout : {"hf", "hub"}) {
    const fs::path model = dir_ / layout, out = dir_ / (std::string(layout) + ".safetensors");
    const auto made =
        test::run_cli(fmt::format("make-model --preset tiny --seed 11 --layout {} --out {}", layout, quoted(model)));
    ASSERT_EQ(made.exit_code, 0) << made.output;
    const auto r = test::run_cli("generate --device cpu --model " + quoted(model) +
                                 " --prompt-ids 5,9,2,7,11,3,8 --max-new-tokens 6 --dump " + quoted(out));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("warning"), std::string::npos) << layout << ": every tensor should be used\n" << r.output;
    ids[i++] = io::to_i64(*io::SafetensorsSet::open_file(out).find("generated_ids"));
  }
  EXPECT_TRUE(fs::exists(dir_ / "hub" / "model.safetensors"));
  EXPECT_EQ(ids[0].size(), 6u);
  EXPECT_EQ(ids[0], ids[1]);
}

// ---- bad input ----

TEST_F(Cli, TruncatedSafetensorsNamesTheFile) {
  const fs::path model = copy_fixture();
  fs::resize_file(model / "model.safetensors", fs::file_size(model / "model.safetensors") / 2);
  expect_clean_error(generate_on(model), {"model.safetensors"});
}

TEST_F(Cli, HeaderLengthPastTheEndNamesTheFile) {
  const fs::path model = copy_fixture();
  std::string bytes = read_file(model / "model.safetensors");
  bytes[5] = char(0x01);  // header length += 2^40
  write_file(model / "model.safetensors", bytes);
  expect_clean_error(generate_on(model), {"model.safetensors", "header length"});
}

TEST_F(Cli, OffsetsOutOfBoundsNameTheTensor) {
  const fs::path model = copy_fixture();
  const std::string victim = "model.layers.1.self_attn.o_proj.weight";
  edit_safetensors_header(model / "model.safetensors", [&](json& h) {
    auto& off = h[victim]["data_offsets"];
    off[0] = off[0].get<uint64_t>() + (uint64_t(1) << 32);
    off[1] = off[1].get<uint64_t>() + (uint64_t(1) << 32);
  });
  expect_clean_error(generate_on(model), {"model.safetensors", victim, "data_offsets"});
}

TEST_F(Cli, ByteSizeNotMatchingShapeNamesTheTensor) {
  const fs::path model = copy_fixture();
  const std::string victim = "model.layers.2.mlp.gate.weight";
  edit_safetensors_header(model / "model.safetensors", [&](json& h) { h[victim]["dtype"] = "F32"; });  // BF16 bytes
  expect_clean_error(generate_on(model), {"model.safetensors", victim, "needs"});
}

TEST_F(Cli, MissingTensorIsNamed) {
  const std::string victim = "model.layers.1.self_attn.indexer.k_proj.weight";
  const fs::path model = write_tiny([&](auto& t) { ASSERT_EQ(t.erase(victim), 1u); });
  expect_clean_error(generate_on(model), {victim, "missing"});
}

TEST_F(Cli, WrongShapeNamesTensorAndBothShapes) {
  const std::string victim = "model.layers.1.self_attn.q_proj.weight";  // [256,128] in the tiny preset
  const fs::path model = write_tiny([&](auto& t) {
    std::vector<float> values(128 * 128, 0.01f);
    t[victim] = io::OwnedTensor::from_f32({128, 128}, values, DType::kBF16);
  });
  expect_clean_error(generate_on(model), {victim, "[128,128]", "[256,128]"});
}

TEST_F(Cli, InconsistentConfigNamesTheField) {
  const fs::path model = copy_fixture();
  json config = json::parse(read_file(model / "config.json"));
  config["index_n_heads"] = 1;  // the fixture has 2 KV heads
  write_file(model / "config.json", config.dump(2));
  expect_clean_error(generate_on(model), {"config.json", "index_n_heads"});
  expect_clean_error(test::run_cli("inspect --model " + quoted(model)), {"index_n_heads"});
}

TEST_F(Cli, TpNotDividingHeadsNamesTheField) {
  expect_clean_error(test::run_cli("generate --model " + quoted(fixture()) + " --prompt-ids 1,2 --tp 3"),
                     {"--tp 3", "num_attention_heads"});
  expect_clean_error(test::run_cli("inspect --model " + quoted(fixture()) + " --tp 3"), {"num_attention_heads"});
}

TEST_F(Cli, TeacherForceWithoutGeneratedIds) {
  const fs::path input = dir_ / "prompts.safetensors";
  const std::vector<int64_t> ids = {1, 2, 3, 4};
  io::write_safetensors(input, {{"input_ids", io::OwnedTensor::from_i64({1, 4}, ids)}});
  expect_clean_error(
      test::run_cli("generate --model " + quoted(fixture()) + " --input " + quoted(input) + " --teacher-force"),
      {"--teacher-force", "generated_ids"});
}

// ---- text ----

// The embedded default model speaks text out of the box: the preset tokenizer and chat template.
TEST_F(Cli, PromptTextOnTheEmbeddedDefault) {
  const auto r = test::run_cli("generate --device cpu --prompt 'hello there' --max-new-tokens 6");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("sequence 0: "), std::string::npos) << r.output;
  EXPECT_TRUE(r.output.find("[length]") != std::string::npos || r.output.find("[stop]") != std::string::npos)
      << r.output;
}

// make-model writes a tokenizer and chat template beside the weights; --chat renders a conversation
// from stdin with them; the same seed samples the same reply.
TEST_F(Cli, ChatOnAMadeModelWithSamplingIsRepeatable) {
  const fs::path model = dir_ / "tiny";
  ASSERT_EQ(test::run_cli("make-model --preset tiny --layers 2 --out " + quoted(model)).exit_code, 0);
  for (const char* f : {"tokenizer.json", "chat_template.jinja", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(model / f)) << f;
  const fs::path chat = dir_ / "chat.json";
  write_file(chat, R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])");
  const std::string cmd = "generate --device cpu --model " + quoted(model) +
                          " --chat --temperature 0.8 --top-p 0.9 --sampling-seed 42 --max-new-tokens 8 < " +
                          quoted(chat);
  const auto a = test::run_cli(cmd), b = test::run_cli(cmd);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output.substr(0, a.output.find("prefill")), b.output.substr(0, b.output.find("prefill")));
  // The interactive chat reads user lines until an empty one.
  const fs::path lines = dir_ / "lines.txt";
  write_file(lines, "hello\nhow are you\n\n");
  const auto c = test::run_cli("chat --device cpu --model " + quoted(model) + " --max-new-tokens 4 < " + quoted(lines));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("chat with"), std::string::npos) << c.output;
  size_t prompts = 0;  // "> " before each line read: two turns, then the empty line that ends it
  for (size_t at = c.output.find("> "); at != std::string::npos; at = c.output.find("> ", at + 2)) ++prompts;
  EXPECT_GE(prompts, 3u) << c.output;
}

TEST_F(Cli, TextErrorsAreClear) {
  // A checkpoint without a tokenizer cannot take text.
  expect_clean_error(test::run_cli("generate --device cpu --model " + quoted(fixture()) + " --prompt hi"),
                     {"tokenizer.json"});
  // Stop strings need text.
  expect_clean_error(test::run_cli("generate --device cpu --prompt-ids 1,2,3 --stop x"), {"stop strings"});
  // A bad sampling parameter is named.
  expect_clean_error(test::run_cli("generate --device cpu --prompt hi --temperature -1"), {"temperature"});
  // Malformed chat JSON on stdin.
  const fs::path chat = dir_ / "bad.json";
  write_file(chat, "[{\"role\": \"user\",");
  expect_clean_error(test::run_cli("generate --device cpu --chat < " + quoted(chat)), {"--chat"});
}

TEST_F(Cli, ServeErrorsAreClear) {
  // A server speaks text: a checkpoint without a tokenizer is refused before it listens.
  expect_clean_error(test::run_cli("serve --device cpu --port 0 --model " + quoted(fixture())), {"tokenizer.json"});
  expect_clean_error(test::run_cli("bench serve --url ftp://127.0.0.1:1"), {"--url"});
  // Port 1 refuses connections: the first request names what it asked.
  expect_clean_error(test::run_cli("bench serve --url http://127.0.0.1:1"), {"/v1/models"});
  expect_clean_error(test::run_cli("bench serve --url http://127.0.0.1:1 --concurrency 1,x"), {"--concurrency"});
}

TEST_F(Cli, NonexistentModelDirIsNamed) {
  const fs::path missing = dir_ / "no-such-model";
  expect_clean_error(generate_on(missing), {missing.string()});
  expect_clean_error(test::run_cli("inspect --model " + quoted(missing)), {missing.string()});
}

}  // namespace
}  // namespace tpmoe
