// MXFP8 checkpoints (SPEC §3, MXFP8 variant): the e4m3/E8M0 conversions, quantization_config, the
// loader in both layouts (validation, dequantize-on-load for the CPU oracle, FP8 kept with its scales
// for the CUDA backend, tensor-parallel slicing on scale-block boundaries) and the fixture
// tests/fixtures/m3-tiny-mxfp8 against logits that transformers computed (fp32, on the values torch
// dequantized), at every tp and fusion setting.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/presets.h"
#include "model/weights.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kSeed = 21;

fs::path fixture_dir() { return fs::path(__FILE__).parent_path() / "fixtures" / "m3-tiny-mxfp8"; }

// Runs `f` and returns the tpmoe::Error message it threw ("" when it threw nothing).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR_HAS(stmt, text)                                      \
  do {                                                                    \
    const std::string msg_ = error_of([&] { stmt; });                     \
    EXPECT_NE(msg_.find(text), std::string::npos) << "message: " << msg_; \
  } while (0)

// ---- element formats -------------------------------------------------------------------------

TEST(Mxfp8Dtype, E4M3KnownValues) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0xb8), -1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), std::ldexp(1.f, -6));  // smallest normal
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x07), 7 * std::ldexp(1.f, -9));
  EXPECT_EQ(fp8_e4m3_to_f32(0x00), 0.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xff)));
  EXPECT_EQ(parse_dtype("F8_E4M3"), DType::kF8E4M3);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
}

TEST(Mxfp8Dtype, E4M3EveryByteRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    const float f = fp8_e4m3_to_f32(uint8_t(b));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_fp8_e4m3(f), b) << "byte " << b << " = " << f;
  }
}

TEST(Mxfp8Dtype, E4M3RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(f32_to_fp8_e4m3(1.0625f), 0x38);  // tie between 1 and 1.125: even mantissa
  EXPECT_EQ(f32_to_fp8_e4m3(1.1875f), 0x3a);  // tie between 1.125 and 1.25: even mantissa
  EXPECT_EQ(f32_to_fp8_e4m3(1.07f), 0x39);
  EXPECT_EQ(f32_to_fp8_e4m3(1000.f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(-1000.f), 0xfe);
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(1.f, -11)), 0x00);  // a quarter of the smallest subnormal
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(1.f, -7)), 0x04);   // subnormal 4 * 2^-9
}

TEST(Mxfp8Dtype, E8M0Scales) {
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.f, -127));
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
}

TEST(Mxfp8Quantize, ErrorWithinE4M3Precision) {
  std::vector<float> v(4 * 64);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::ldexp(std::sin(float(i) * 0.7f), int(i / 32) * 5 - 12);
  const auto [q, s] = quantize_mxfp8({4, 64}, v);
  ASSERT_EQ(q.shape, (std::vector<int64_t>{4, 64}));
  ASSERT_EQ(s.shape, (std::vector<int64_t>{4, 2}));
  for (size_t i = 0; i < v.size(); ++i) {
    const float scale = e8m0_to_f32(uint8_t(s.bytes[i / 32]));
    const float w = fp8_e4m3_to_f32(uint8_t(q.bytes[i])) * scale;
    // 3 mantissa bits: half a unit in the last place is 2^-4 of the value; below the normal range
    // the step is 2^-9 of the scale.
    EXPECT_LE(std::fabs(w - v[i]), std::max(std::fabs(v[i]) * 0.0625f, std::ldexp(scale, -10))) << i;
  }
  EXPECT_ERROR_HAS(quantize_mxfp8({2, 48}, std::vector<float>(96)), "multiple of 32");
}

// ---- quantization_config -------------------------------------------------------------------------

nlohmann::json tiny_text_json() { return preset_config("tiny").to_json(); }

TEST(Mxfp8Config, ParsesQuantizationConfig) {
  nlohmann::json j = tiny_text_json();
  j["quantization_config"] = {{"quant_method", "mxfp8"},
                              {"weight_block_size", {1, 32}},
                              {"activation_scheme", "dynamic"},
                              {"ignored_layers", {"lm_head", "model.embed_tokens"}}};
  const ModelConfig c = ModelConfig::from_json(j);
  EXPECT_EQ(c.quantization.method, QuantMethod::kMxfp8);
  EXPECT_EQ(c.quantization.ignored_layers.size(), 2u);
  EXPECT_EQ(ModelConfig::from_json(tiny_text_json()).quantization.method, QuantMethod::kNone);
  // Both written forms carry it back.
  for (auto form : {ModelConfig::JsonForm::kText, ModelConfig::JsonForm::kMultimodalLegacy}) {
    const ModelConfig back = ModelConfig::from_json(c.to_json(form));
    EXPECT_EQ(back.quantization.method, QuantMethod::kMxfp8);
    EXPECT_EQ(back.quantization.ignored_layers, c.quantization.ignored_layers);
  }
  // The hub files put it at the top level of the multimodal config.
  EXPECT_TRUE(c.to_json(ModelConfig::JsonForm::kMultimodalLegacy).contains("quantization_config"));
}

TEST(Mxfp8Config, RejectsWhatItCannotRead) {
  auto with = [](nlohmann::json q) {
    nlohmann::json j = tiny_text_json();
    j["quantization_config"] = std::move(q);
    return j;
  };
  EXPECT_ERROR_HAS(ModelConfig::from_json(with({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}})),
                   "quant_method' is \"fp8\"");
  EXPECT_ERROR_HAS(ModelConfig::from_json(with({{"quant_method", "mxfp8"}, {"weight_block_size", {1, 16}}})),
                   "weight_block_size' must be [1, 32]");
  EXPECT_ERROR_HAS(ModelConfig::from_json(with({{"weight_block_size", {1, 32}}})), "quant_method' must be a string");
  EXPECT_ERROR_HAS(ModelConfig::from_json(with("mxfp8")), "'quantization_config' must be an object");
  nlohmann::json mm = preset_config("tiny").to_json(ModelConfig::JsonForm::kMultimodalLegacy);
  mm["quantization_config"] = {{"quant_method", "mxfp8"}};
  mm["text_config"]["quantization_config"] = {{"quant_method", "fp8"}};
  EXPECT_ERROR_HAS(ModelConfig::from_json(mm), "differs between the top level and 'text_config'");
}

// ---- loader ------------------------------------------------------------------------------------

ModelConfig tiny_mxfp8_config() {
  ModelConfig c = preset_config("tiny");
  set_mxfp8(c);
  return c;
}

struct RankSetup {
  ParallelLayout layout;
  FusionPlan plan;
};
RankSetup setup(const io::Checkpoint& ckpt, int tp, bool shared_fusion = true) {
  RankSetup s;
  s.layout.tp = tp;
  s.layout.validate(ckpt.config());
  s.plan = build_fusion_plan(ckpt.config(), s.layout, {.allreduce_fusion = true, .shared_expert_fusion = shared_fusion},
                             shared_expert_format_matches(ckpt));
  return s;
}

ModelWeights load(const io::Checkpoint& ckpt, int tp, int rank, bool keep, bool shared_fusion = true) {
  const RankSetup s = setup(ckpt, tp, shared_fusion);
  return load_rank_weights(ckpt, RankShard::make(ckpt.config(), s.layout, rank), s.plan, {.keep_mxfp8 = keep});
}

// Every MXFP8 tensor replaced by its fp32 value (the scale siblings dropped), quantization_config off.
std::map<std::string, io::OwnedTensor> dequantized(const std::map<std::string, io::OwnedTensor>& t) {
  std::map<std::string, io::OwnedTensor> out;
  for (const auto& [name, v] : t) {
    if (name.size() > 10 && name.compare(name.size() - 10, 10, "_scale_inv") == 0) continue;
    if (v.dtype != DType::kF8E4M3) {
      out[name] = v;
      continue;
    }
    const io::OwnedTensor& s = t.at(name + "_scale_inv");
    const int64_t K = v.shape.back();
    std::vector<float> f(size_t(v.numel()));
    for (int64_t i = 0; i < v.numel(); ++i)
      f[i] = fp8_e4m3_to_f32(uint8_t(v.bytes[i])) * e8m0_to_f32(uint8_t(s.bytes[(i / K) * (K / 32) + (i % K) / 32]));
    out[name] = io::OwnedTensor::from_f32(v.shape, f, DType::kF32);
  }
  return out;
}

GenerateRequest small_request(int vocab) {
  GenerateRequest req;
  for (int b = 0; b < 2; ++b) {
    std::vector<int32_t> prompt, forced;
    for (int i = 0; i < 19 + 3 * b; ++i) prompt.push_back(int32_t(1 + (b * 131 + i * 29) % (vocab - 1)));
    for (int i = 0; i < 2; ++i) forced.push_back(int32_t(1 + (b * 17 + i * 53) % (vocab - 1)));
    req.prompts.push_back(prompt);
    req.forced_tokens.push_back(forced);
  }
  req.max_new_tokens = 3;
  req.return_prefill_logits = true;
  return req;
}

void expect_same_logits(const GenerateResult& got, const GenerateResult& want, double tol, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_LT(test::relative_l2(test::concat(got.prefill_logits), test::concat(want.prefill_logits)), tol);
  EXPECT_LT(test::relative_l2(test::concat(got.step_logits), test::concat(want.step_logits)), tol);
  EXPECT_EQ(got.generated, want.generated);
}

class Mxfp8Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = tiny_mxfp8_config();
    tensors_ = random_weights(config_, kSeed, DType::kF8E4M3);
  }
  void TearDown() override {
    for (const auto& d : dirs_) fs::remove_all(d);
  }
  fs::path write(const ModelConfig& config, const std::map<std::string, io::OwnedTensor>& tensors,
                 io::CheckpointLayout layout, int shards = 1) {
    dirs_.push_back(test::make_temp_dir("mxfp8"));
    io::write_checkpoint(dirs_.back(), config, tensors, layout, shards);
    return dirs_.back();
  }
  // Loading `tensors` (mutated from the valid ones) must fail with a message containing `text`.
  void expect_load_error(const std::map<std::string, io::OwnedTensor>& tensors, const std::string& text,
                         bool keep = false, const ModelConfig* config = nullptr) {
    const io::Checkpoint ckpt = io::Checkpoint::from_memory(config ? *config : config_, tensors);
    EXPECT_ERROR_HAS(load(ckpt, 1, 0, keep), text);
  }
  ModelConfig config_;
  std::map<std::string, io::OwnedTensor> tensors_;
  std::vector<fs::path> dirs_;
};

TEST_F(Mxfp8Checkpoint, QuantizesTheLinearsOnly) {
  EXPECT_EQ(tensors_.at("model.layers.1.mlp.experts.gate_up_proj").dtype, DType::kF8E4M3);
  EXPECT_EQ(tensors_.at("model.layers.1.mlp.experts.gate_up_proj_scale_inv").shape, (std::vector<int64_t>{16, 128, 4}));
  EXPECT_EQ(tensors_.at("model.layers.0.self_attn.q_proj.weight_scale_inv").dtype, DType::kU8);
  EXPECT_EQ(tensors_.at("model.layers.0.mlp.down_proj.weight").dtype, DType::kF8E4M3);
  EXPECT_EQ(tensors_.at("model.layers.3.self_attn.indexer.k_proj.weight").dtype, DType::kF8E4M3);
  EXPECT_EQ(tensors_.at("model.layers.1.mlp.gate.weight").dtype, DType::kBF16);
  EXPECT_EQ(tensors_.at("model.embed_tokens.weight").dtype, DType::kBF16);
  EXPECT_EQ(tensors_.at("lm_head.weight").dtype, DType::kBF16);
  EXPECT_EQ(tensors_.at("model.layers.1.self_attn.q_norm.weight").dtype, DType::kBF16);
}

// Both layouts, dequantized on load, compute exactly what an fp32 checkpoint of the dequantized
// values computes; nothing is left unread.
TEST_F(Mxfp8Checkpoint, BothLayoutsEqualTheDequantizedModel) {
  ModelConfig plain = preset_config("tiny");
  const auto want =
      Engine::from_checkpoint(write(plain, dequantized(tensors_), io::CheckpointLayout::kTransformers), {})
          ->generate(small_request(plain.vocab_size));
  for (auto layout : {io::CheckpointLayout::kTransformers, io::CheckpointLayout::kHub}) {
    const fs::path dir = write(config_, tensors_, layout, layout == io::CheckpointLayout::kHub ? 2 : 1);
    auto engine = Engine::from_checkpoint(dir, {});
    EXPECT_TRUE(engine->unknown_tensors().empty()) << fmt::format("{}", fmt::join(engine->unknown_tensors(), ", "));
    expect_same_logits(engine->generate(small_request(plain.vocab_size)), want, test::kTolF32, io::layout_name(layout));
  }
  // The hub names of a quantized expert, as the original files spell them.
  const io::Checkpoint hub = io::Checkpoint::open(dirs_.back());
  EXPECT_EQ(hub.routed_expert(1, 3).gate.dtype, DType::kF8E4M3);
  EXPECT_NE(hub.routed_expert(1, 3).gate.scale, nullptr);
}

// keep_mxfp8: the rank holds FP8 bytes and scales, sliced on block boundaries, the shared expert at
// row E; the dequantize-on-load path holds exactly their values.
TEST_F(Mxfp8Checkpoint, KeptFp8SlicesMatchTheSource) {
  const io::Checkpoint ckpt = io::Checkpoint::from_memory(config_, tensors_);
  const int64_t H = config_.hidden_size, E = config_.num_experts, I = config_.moe_intermediate_size;
  const int tp = 2;
  for (int r = 0; r < tp; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const ModelWeights k = load(ckpt, tp, r, true);
    const ModelWeights d = load(ckpt, tp, r, false);
    const Tensor& gu = k.layers[1].moe.experts_gate_up;
    const Tensor& dn = k.layers[1].moe.experts_down;
    ASSERT_EQ(gu.dtype, DType::kF8E4M3);
    ASSERT_NE(gu.scale, nullptr);
    ASSERT_EQ(gu.dim(0), E + 1);  // fused shared expert
    const int64_t Il = I / tp;
    // Expert 5's up half: rows [I + r*Il, I + (r+1)*Il) of the source [2I, H].
    const auto& src = tensors_.at("model.layers.1.mlp.experts.gate_up_proj");
    const auto& src_s = tensors_.at("model.layers.1.mlp.experts.gate_up_proj_scale_inv");
    const auto* kept = static_cast<const std::byte*>(gu.data) + (5 * 2 * Il + Il) * H;
    EXPECT_EQ(std::memcmp(kept, src.bytes.data() + (5 * 2 * I + I + r * Il) * H, size_t(Il * H)), 0);
    const auto* kept_s = static_cast<const std::byte*>(gu.scale) + (5 * 2 * Il + Il) * H / 32;
    EXPECT_EQ(std::memcmp(kept_s, src_s.bytes.data() + (5 * 2 * I + I + r * Il) * H / 32, size_t(Il * H / 32)), 0);
    // down of the shared expert (row E): columns [r*Il, (r+1)*Il) of the source [H, Is].
    const auto& sd = tensors_.at("model.layers.1.mlp.shared_experts.down_proj.weight");
    const auto& sd_s = tensors_.at("model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv");
    for (int64_t n : {int64_t(0), H - 1}) {
      const auto* row = static_cast<const std::byte*>(dn.data) + (E * H + n) * Il;
      EXPECT_EQ(std::memcmp(row, sd.bytes.data() + n * I + r * Il, size_t(Il)), 0);
      const auto* srow = static_cast<const std::byte*>(dn.scale) + (E * H + n) * Il / 32;
      EXPECT_EQ(std::memcmp(srow, sd_s.bytes.data() + n * I / 32 + r * Il / 32, size_t(Il / 32)), 0);
    }
    // Every element of the kept o_proj slice dequantizes to the CPU oracle's fp32 value.
    const Tensor& ko = k.layers[2].attn.o_proj;
    const Tensor& dq = d.layers[2].attn.o_proj;
    ASSERT_EQ(dq.dtype, DType::kF32);
    ASSERT_EQ(ko.numel(), dq.numel());
    const int64_t K = ko.dim(1);
    for (int64_t i = 0; i < ko.numel(); ++i) {
      const float w = fp8_e4m3_to_f32(ko.as<uint8_t>()[i]) *
                      e8m0_to_f32(static_cast<const uint8_t*>(ko.scale)[(i / K) * (K / 32) + (i % K) / 32]);
      ASSERT_EQ(w, dq.as<float>()[i]) << i;
    }
    // Byte counts include the scales.
    EXPECT_LT(k.bytes, d.bytes);
  }
}

TEST_F(Mxfp8Checkpoint, KeptFp8SliceOffTheBlockGridIsAnError) {
  const io::Checkpoint ckpt = io::Checkpoint::from_memory(config_, tensors_);
  // tp 4 cuts I = 64 into 16 columns per rank: half a scale block.
  EXPECT_ERROR_HAS(load(ckpt, 4, 1, true), "does not lie on 32-element scale-block boundaries");
  // The CPU oracle dequantizes before slicing: any split is fine.
  EXPECT_NO_THROW(load(ckpt, 4, 1, false));
}

TEST_F(Mxfp8Checkpoint, MissingScaleIsAnError) {
  auto t = tensors_;
  t.erase("model.layers.0.self_attn.k_proj.weight_scale_inv");
  expect_load_error(t, "has no scale tensor 'model.layers.0.self_attn.k_proj.weight_scale_inv'");
  t = tensors_;
  t.erase("model.layers.2.mlp.experts.down_proj_scale_inv");
  expect_load_error(t, "has no scale tensor 'model.layers.2.mlp.experts.down_proj_scale_inv'");
}

TEST_F(Mxfp8Checkpoint, ScaleShapeAndDtypeAreChecked) {
  auto t = tensors_;
  auto& s = t.at("model.layers.0.self_attn.v_proj.weight_scale_inv");
  s.shape = {s.shape[1], s.shape[0]};
  expect_load_error(t, "has shape [4,128], expected [128,4]");
  t = tensors_;
  t.at("model.layers.0.self_attn.v_proj.weight_scale_inv").dtype = DType::kI8;
  expect_load_error(t, "has dtype I8, expected U8");
}

TEST_F(Mxfp8Checkpoint, NanScaleIsAnError) {
  for (bool keep : {false, true}) {
    auto t = tensors_;
    t.at("model.layers.3.mlp.experts.gate_up_proj_scale_inv").bytes[7] = std::byte(255);
    expect_load_error(t, "is 255 (NaN)", keep);
  }
}

TEST_F(Mxfp8Checkpoint, QuantizedTensorWhereNoneIsExpected) {
  // The router, norms, embeddings and lm_head are never quantized.
  for (const std::string name :
       {"model.layers.1.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}) {
    auto t = tensors_;
    io::OwnedTensor& v = t.at(name);
    v.dtype = DType::kF8E4M3;
    v.bytes.resize(size_t(v.numel()));
    expect_load_error(t, fmt::format("tensor '{}' is F8_E4M3, but it is never quantized", name));
  }
}

TEST_F(Mxfp8Checkpoint, Fp8WithoutQuantizationConfigIsAnError) {
  const ModelConfig plain = preset_config("tiny");
  expect_load_error(tensors_, "config.json has no quantization_config", false, &plain);
}

TEST_F(Mxfp8Checkpoint, InputWidthNotAMultipleOf32IsAnError) {
  ModelConfig c = config_;
  c.hidden_size = 80;  // K of every projection reading the residual stream
  c.validate("tiny, H = 80");
  ModelConfig bf = c;
  bf.quantization = {};
  auto w = random_weights(bf, kSeed, DType::kBF16);
  io::OwnedTensor& q = w.at("model.layers.0.self_attn.q_proj.weight");
  q.dtype = DType::kF8E4M3;
  q.bytes.resize(size_t(q.numel()));
  w["model.layers.0.self_attn.q_proj.weight_scale_inv"] = io::OwnedTensor{DType::kU8, {q.shape[0], 2}, {}};
  w["model.layers.0.self_attn.q_proj.weight_scale_inv"].bytes.resize(size_t(q.shape[0] * 2));
  expect_load_error(w, "has 80 input columns, not a multiple of the scale block 32", false, &c);
}

// Routed experts in MXFP8, the shared expert left bf16 (an ignored layer): fusion is refused, the
// model still loads and computes the same function with fusion off.
TEST_F(Mxfp8Checkpoint, SharedExpertInAnotherFormatIsNotFused) {
  auto t = tensors_;
  const auto plain = random_weights(preset_config("tiny"), kSeed, DType::kBF16);
  for (int l = 1; l < config_.num_layers; ++l)
    for (const char* n : {"mlp.shared_experts.gate_up_proj.weight", "mlp.shared_experts.down_proj.weight"}) {
      const std::string name = fmt::format("model.layers.{}.{}", l, n);
      t[name] = plain.at(name);
      t.erase(name + "_scale_inv");
    }
  const io::Checkpoint ckpt = io::Checkpoint::from_memory(config_, t);
  EXPECT_FALSE(shared_expert_format_matches(ckpt));
  const RankSetup s = setup(ckpt, 1, true);
  EXPECT_FALSE(s.plan.shared_expert.fused);
  const ModelWeights w = load(ckpt, 1, 0, true);
  EXPECT_EQ(w.layers[1].moe.shared.gate_up.dtype, DType::kBF16);
  EXPECT_EQ(w.layers[1].moe.experts_gate_up.dtype, DType::kF8E4M3);
}

// ---- the fixture -------------------------------------------------------------------------------

// transformers in fp32 on torch's dequantized values against tpmoe's CPU oracle dequantizing on load:
// only the order of fp32 sums differs.
constexpr double kFixtureTolerance = 1e-4;

TEST(Mxfp8Fixture, HubCheckpointIsMxfp8) {
  const io::Checkpoint ckpt = io::Checkpoint::open(fixture_dir());
  EXPECT_EQ(ckpt.layout(), io::CheckpointLayout::kHub);
  EXPECT_EQ(ckpt.config().quantization.method, QuantMethod::kMxfp8);
  EXPECT_EQ(ckpt.routed_expert(1, 0).down.dtype, DType::kF8E4M3);
  EXPECT_EQ(ckpt.dense_mlp(0).gate.dtype, DType::kF8E4M3);
  EXPECT_EQ(ckpt.router(1).dtype, DType::kBF16);
}

TEST(Mxfp8Fixture, MatchesTransformersReference) {
  const test::FixtureReference ref = test::load_fixture_reference(fixture_dir() / "reference.safetensors");
  auto engine = Engine::from_checkpoint(fixture_dir(), {});
  EXPECT_TRUE(engine->unknown_tensors().empty()) << fmt::format("{}", fmt::join(engine->unknown_tensors(), ", "));
  const GenerateResult r = engine->generate(test::teacher_forced_request(ref));
  const double prefill_err = test::relative_l2(test::concat(r.prefill_logits), ref.prefill_logits);
  const double step_err = test::relative_l2(test::concat(r.step_logits), ref.step_logits);
  std::printf("MXFP8 fixture, relative L2 vs transformers: prefill %.3g, steps %.3g\n", prefill_err, step_err);
  EXPECT_LT(prefill_err, kFixtureTolerance);
  EXPECT_LT(step_err, kFixtureTolerance);
  EXPECT_EQ(r.generated, ref.generated);
}

// tp 2 and 4 (dequantized before slicing, so tp 4's 16-column expert slices are fine on the CPU)
// with every fusion switch: the tp-1 function, to fp32 summation order.
TEST(Mxfp8Fixture, EveryTpAndFusionEqualsTp1) {
  const test::FixtureReference ref = test::load_fixture_reference(fixture_dir() / "reference.safetensors");
  const GenerateRequest req = test::teacher_forced_request(ref);
  const GenerateResult base = Engine::from_checkpoint(fixture_dir(), {})->generate(req);
  for (int tp : {1, 2, 4})
    for (bool shared : {true, false})
      for (bool allreduce : {true, false}) {
        if (tp == 1 && shared && allreduce) continue;
        EngineOptions o;
        o.tp = tp;
        o.shared_expert_fusion = shared;
        o.shared_fusion_max_tokens = 0;  // fused in every step, the prefill included
        o.allreduce_fusion = allreduce;
        expect_same_logits(Engine::from_checkpoint(fixture_dir(), o)->generate(req), base, test::kTolF32,
                           fmt::format("tp {}, shared fusion {}, all-reduce fusion {}", tp, shared, allreduce));
      }
  // Fused, with every step over a 1-token limit: the fused rows run as the shared MLP.
  EngineOptions o;
  o.tp = 2;
  o.shared_fusion_max_tokens = 1;
  expect_same_logits(Engine::from_checkpoint(fixture_dir(), o)->generate(req), base, test::kTolF32,
                     "tp 2, shared fusion on up to 1 token a step");
}

}  // namespace
}  // namespace tpmoe
