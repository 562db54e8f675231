// ModelConfig: the fixture parses to the expected values, both output forms round-trip exactly, the
// legacy multimodal form means the same model, and every rejection names the offending field.
#include "model/config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "test_util.h"

namespace tpmoe {
namespace {

using json = nlohmann::json;
using A = AttentionType;
using M = MlpType;

std::filesystem::path fixture_config() { return test::fixtures_dir() / "m3-tiny" / "config.json"; }

json fixture_json() {
  std::ifstream in(fixture_config());
  return json::parse(in);
}

// The fixture written by hand in the original hub naming, independent of to_json(), so a wrong
// alias in both the parser and the writer cannot go unnoticed.
json legacy_fixture_json() {
  return json::parse(R"({
    "model_type": "minimax_m3_vl",
    "architectures": ["MiniMaxM3VLForConditionalGeneration"],
    "vision_config": {"hidden_size": 32, "num_hidden_layers": 1},
    "text_config": {
      "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "rms_norm_eps": 1e-06,
      "rope_theta": 5000000.0, "rope_parameters": {"partial_rotary_factor": 0.5},
      "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
      "shared_intermediate_size": 64, "n_shared_experts": 1, "dense_intermediate_size": 192,
      "routed_scaling_factor": 2.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
      "tie_word_embeddings": false, "eos_token_id": 2,
      "moe_layer_freq": [0, 1, 1, 1],
      "sparse_attention_config": {
        "sparse_num_index_heads": 2, "sparse_index_dim": 32, "sparse_block_size": 8,
        "sparse_topk_blocks": 2, "sparse_local_block": 1, "sparse_attention_freq": [0, 0, 1, 1]
      }
    }
  })");
}

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.rotary_dim, b.rotary_dim);
  EXPECT_EQ(a.rope_theta, b.rope_theta);  // exact, not near: round trips must be lossless
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.num_shared_experts, b.num_shared_experts);
  EXPECT_EQ(a.shared_intermediate_size, b.shared_intermediate_size);
  EXPECT_EQ(a.dense_intermediate_size, b.dense_intermediate_size);
  EXPECT_EQ(a.routed_scaling_factor, b.routed_scaling_factor);
  EXPECT_EQ(a.swiglu_alpha, b.swiglu_alpha);
  EXPECT_EQ(a.swiglu_limit, b.swiglu_limit);
  EXPECT_EQ(a.index_n_heads, b.index_n_heads);
  EXPECT_EQ(a.index_head_dim, b.index_head_dim);
  EXPECT_EQ(a.index_block_size, b.index_block_size);
  EXPECT_EQ(a.index_topk_blocks, b.index_topk_blocks);
  EXPECT_EQ(a.index_local_blocks, b.index_local_blocks);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.layer_types, b.layer_types);
  EXPECT_EQ(a.mlp_layer_types, b.mlp_layer_types);
}

// Runs `parse`, expects a tpmoe::Error, and returns its message.
std::string error_of(const std::function<void()>& parse) {
  try {
    parse();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a tpmoe::Error";
  return "";
}

std::string error_parsing(const json& j) {
  return error_of([&] { ModelConfig::from_json(j); });
}

TEST(Config, FixtureParsesToExpectedValues) {
  const ModelConfig c = ModelConfig::from_file(fixture_config());
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_layers, 4);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.rotary_dim, 16);
  EXPECT_EQ(c.rope_theta, 5e6);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.shared_intermediate_size, 64);
  EXPECT_EQ(c.num_shared_experts, 1);  // absent, implied by shared_intermediate_size
  EXPECT_EQ(c.dense_intermediate_size, 192);
  EXPECT_EQ(c.routed_scaling_factor, 2.0f);
  EXPECT_EQ(c.swiglu_alpha, 1.702f);
  EXPECT_EQ(c.swiglu_limit, 7.0f);
  EXPECT_EQ(c.index_n_heads, 2);
  EXPECT_EQ(c.index_head_dim, 32);
  EXPECT_EQ(c.index_block_size, 8);
  EXPECT_EQ(c.index_topk_blocks, 2);
  EXPECT_EQ(c.index_local_blocks, 1);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.layer_types, (std::vector<A>{A::kFull, A::kFull, A::kSparse, A::kSparse}));
  EXPECT_EQ(c.mlp_layer_types, (std::vector<M>{M::kDense, M::kMoe, M::kMoe, M::kMoe}));
  EXPECT_TRUE(c.any_sparse_attention());
  EXPECT_TRUE(c.any_moe());
}

TEST(Config, TextFormRoundTrips) {
  const ModelConfig c = ModelConfig::from_file(fixture_config());
  const json j = c.to_json(ModelConfig::JsonForm::kText);
  EXPECT_EQ(j.at("model_type"), "minimax_m3_vl_text");
  EXPECT_EQ(j.at("rope_parameters").at("partial_rotary_factor"), 0.5);
  EXPECT_EQ(j.at("rotary_dim"), 16);
  expect_same(ModelConfig::from_json(j), c);
  // Through text as well: the shortest float spelling must read back to the same float.
  expect_same(ModelConfig::from_json(json::parse(j.dump())), c);
}

TEST(Config, LegacyFormRoundTrips) {
  const ModelConfig c = ModelConfig::from_file(fixture_config());
  const json j = c.to_json(ModelConfig::JsonForm::kMultimodalLegacy);
  EXPECT_EQ(j.at("model_type"), "minimax_m3_vl");
  ASSERT_TRUE(j.contains("vision_config"));
  const json& t = j.at("text_config");
  EXPECT_EQ(t.at("moe_layer_freq"), json({0, 1, 1, 1}));
  EXPECT_EQ(t.at("sparse_attention_config").at("sparse_attention_freq"), json({0, 0, 1, 1}));
  EXPECT_EQ(t.at("rope_theta"), 5e6);
  EXPECT_FALSE(t.contains("rotary_dim"));
  EXPECT_FALSE(t.contains("layer_types"));
  expect_same(ModelConfig::from_json(json::parse(j.dump())), c);
}

TEST(Config, RoundTripsUnusualValues) {
  // Values the fixture does not exercise: odd floats, no shared expert, tied embeddings, all
  // layers full attention and dense.
  ModelConfig c = ModelConfig::from_file(fixture_config());
  c.rope_theta = 123456.789;
  c.rms_norm_eps = 1.2345e-5f;
  c.routed_scaling_factor = 0.1f;
  c.swiglu_alpha = -0.3f;
  c.shared_intermediate_size = 0;
  c.num_shared_experts = 0;
  c.head_dim = 96;
  c.rotary_dim = 36;  // 36/96 is not a short decimal
  c.index_head_dim = 96;
  c.tie_word_embeddings = true;
  c.mlp_layer_types.assign(4, M::kDense);
  c.layer_types.assign(4, A::kFull);
  c.validate();
  for (auto form : {ModelConfig::JsonForm::kText, ModelConfig::JsonForm::kMultimodalLegacy}) {
    expect_same(ModelConfig::from_json(json::parse(c.to_json(form).dump())), c);
  }
}

TEST(Config, LegacyMultimodalFormParsesToSameConfig) {
  expect_same(ModelConfig::from_json(legacy_fixture_json()), ModelConfig::from_file(fixture_config()));
}

TEST(Config, EosTokenIdIsOneIdOrAList) {
  json j = fixture_json();
  EXPECT_EQ(ModelConfig::from_json(j).eos_token_ids, std::vector<int32_t>{2});
  j["eos_token_id"] = {1, 2, 7};
  EXPECT_EQ(ModelConfig::from_json(j).eos_token_ids, (std::vector<int32_t>{1, 2, 7}));
  j.erase("eos_token_id");
  EXPECT_TRUE(ModelConfig::from_json(j).eos_token_ids.empty());
  j["eos_token_id"] = 512;  // vocab_size 512
  EXPECT_NE(error_of([&] { ModelConfig::from_json(j); }).find("eos_token_id"), std::string::npos);
  j["eos_token_id"] = "two";
  EXPECT_NE(error_of([&] { ModelConfig::from_json(j); }).find("eos_token_id"), std::string::npos);
}

TEST(Config, MissingListsDefaultToFullAttentionAndMoe) {
  json j = fixture_json();
  j.erase("layer_types");
  j.erase("mlp_layer_types");
  const ModelConfig c = ModelConfig::from_json(j);
  EXPECT_EQ(c.layer_types, std::vector<A>(4, A::kFull));
  EXPECT_EQ(c.mlp_layer_types, std::vector<M>(4, M::kMoe));
  EXPECT_FALSE(c.any_sparse_attention());
}

TEST(Config, DefaultsForHeadDimRotaryAndSharedExperts) {
  json j = fixture_json();
  j.erase("head_dim");  // 128 / 4 heads
  j.erase("rotary_dim");
  j.erase("rope_parameters");
  j.erase("shared_intermediate_size");
  const ModelConfig c = ModelConfig::from_json(j);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.rotary_dim, 32);  // no factor given: the whole head rotates
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.num_shared_experts, 0);
}

TEST(Config, PartialRotaryFactorAloneSetsRotaryDim) {
  json j = fixture_json();
  j.erase("rotary_dim");
  j["rope_parameters"]["partial_rotary_factor"] = 0.25;
  EXPECT_EQ(ModelConfig::from_json(j).rotary_dim, 8);
}

TEST(Config, NullMeansAbsent) {
  json j = fixture_json();
  j["head_dim"] = nullptr;
  j["layer_types"] = nullptr;
  const ModelConfig c = ModelConfig::from_json(j);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.layer_types, std::vector<A>(4, A::kFull));
}

// --- Rejections: each message starts with the origin and names the field. ---

TEST(Config, RejectsIndexHeadsNotEqualKvHeads) {
  json j = fixture_json();
  j["index_n_heads"] = 4;
  const std::string msg = error_parsing(j);
  EXPECT_EQ(msg.rfind("config.json", 0), 0u) << msg;
  EXPECT_NE(msg.find("'index_n_heads'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'num_key_value_heads'"), std::string::npos) << msg;
}

TEST(Config, RejectsListLengthMismatch) {
  json j = fixture_json();
  j["mlp_layer_types"].push_back("sparse");
  const std::string msg = error_parsing(j);
  EXPECT_NE(msg.find("'mlp_layer_types' has 5 entries"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_hidden_layers is 4"), std::string::npos) << msg;
}

TEST(Config, RejectsHeadsNotMultipleOfKvHeads) {
  json j = fixture_json();
  j["num_attention_heads"] = 3;
  j["head_dim"] = 32;
  const std::string msg = error_parsing(j);
  EXPECT_NE(msg.find("'num_attention_heads' (3) must be a multiple of 'num_key_value_heads' (2)"), std::string::npos)
      << msg;
}

TEST(Config, RejectsWrongType) {
  json j = fixture_json();
  j["num_key_value_heads"] = "four";
  EXPECT_EQ(error_parsing(j), "config.json: field 'num_key_value_heads' must be a positive integer, got \"four\"");
  j = fixture_json();
  j["hidden_size"] = 127.5;
  EXPECT_NE(error_parsing(j).find("'hidden_size' must be a positive integer, got 127.5"), std::string::npos);
  j = fixture_json();
  j["vocab_size"] = -3;
  EXPECT_NE(error_parsing(j).find("'vocab_size' must be positive"), std::string::npos);
  j = fixture_json();
  j["rms_norm_eps"] = "small";
  EXPECT_NE(error_parsing(j).find("'rms_norm_eps' must be a number"), std::string::npos);
  j = fixture_json();
  j["tie_word_embeddings"] = 0;
  EXPECT_NE(error_parsing(j).find("'tie_word_embeddings'"), std::string::npos);
}

TEST(Config, AcceptsIntegralFloatForInteger) {
  json j = fixture_json();
  j["hidden_size"] = 128.0;
  EXPECT_EQ(ModelConfig::from_json(j).hidden_size, 128);
}

TEST(Config, RejectsBadLayerTypeString) {
  json j = fixture_json();
  j["layer_types"][2] = "linear_attention";
  const std::string msg = error_parsing(j);
  EXPECT_NE(msg.find("'layer_types[2]'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"linear_attention\""), std::string::npos) << msg;

  j = fixture_json();
  j["mlp_layer_types"][0] = "moe";
  EXPECT_NE(error_parsing(j).find("'mlp_layer_types[0]'"), std::string::npos);

  json legacy = legacy_fixture_json();
  legacy["text_config"]["moe_layer_freq"][1] = 2;
  EXPECT_NE(error_parsing(legacy).find("'moe_layer_freq[1]' must be 0 or 1"), std::string::npos);
}

TEST(Config, RejectsAliasDisagreement) {
  json j = fixture_json();
  j["sparse_attention_config"] = {{"sparse_block_size", 16}};
  std::string msg = error_parsing(j);
  EXPECT_NE(msg.find("'index_block_size'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'sparse_attention_config.sparse_block_size'"), std::string::npos) << msg;

  j = fixture_json();
  j["rope_theta"] = 10000.0;
  msg = error_parsing(j);
  EXPECT_NE(msg.find("'rope_parameters.rope_theta'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'rope_theta'"), std::string::npos) << msg;

  j = fixture_json();
  j["moe_layer_freq"] = {1, 1, 1, 1};
  msg = error_parsing(j);
  EXPECT_NE(msg.find("'mlp_layer_types'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'moe_layer_freq'"), std::string::npos) << msg;

  j = fixture_json();
  j["rotary_dim"] = 8;  // partial_rotary_factor 0.5 says 16
  msg = error_parsing(j);
  EXPECT_NE(msg.find("'rotary_dim'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("partial_rotary_factor"), std::string::npos) << msg;

  // Agreeing aliases are fine.
  j = fixture_json();
  j["rope_theta"] = 5e6;
  j["moe_layer_freq"] = {0, 1, 1, 1};
  EXPECT_NO_THROW(ModelConfig::from_json(j));
}

TEST(Config, RejectsMissingRequiredField) {
  json j = fixture_json();
  j.erase("num_hidden_layers");
  EXPECT_EQ(error_parsing(j), "config.json: missing required field 'num_hidden_layers'");

  json legacy = legacy_fixture_json();
  legacy["text_config"].erase("vocab_size");
  const std::string msg = error_parsing(legacy);
  EXPECT_NE(msg.find("[text_config]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'vocab_size'"), std::string::npos) << msg;

  j = fixture_json();
  j.erase("num_local_experts");  // needed because MoE layers exist
  EXPECT_NE(error_parsing(j).find("'num_local_experts'"), std::string::npos);
}

TEST(Config, RejectsRotaryDimAboveHeadDim) {
  json j = fixture_json();
  j["rotary_dim"] = 64;
  j["rope_parameters"].erase("partial_rotary_factor");
  const std::string msg = error_parsing(j);
  EXPECT_NE(msg.find("'rotary_dim' must be even and at most head_dim 32, got 64"), std::string::npos) << msg;
}

TEST(Config, RejectsTopKAboveExperts) {
  json j = fixture_json();
  j["num_experts_per_tok"] = 9;
  const std::string msg = error_parsing(j);
  EXPECT_NE(msg.find("'num_experts_per_tok' must be in 1..num_local_experts (8), got 9"), std::string::npos) << msg;
}

TEST(Config, RejectsAbsurdSizes) {
  json j = fixture_json();
  j["vocab_size"] = int64_t{1} << 40;
  const std::string msg = error_parsing(j);
  EXPECT_NE(msg.find("'vocab_size'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sanity bound"), std::string::npos) << msg;

  j = fixture_json();
  j["num_hidden_layers"] = 100000;
  EXPECT_NE(error_parsing(j).find("sanity bound"), std::string::npos);
}

TEST(Config, RejectsOtherInconsistencies) {
  json j = fixture_json();
  j["n_shared_experts"] = 2;
  j["shared_intermediate_size"] = 0;
  EXPECT_NE(error_parsing(j).find("'n_shared_experts'"), std::string::npos);

  j = fixture_json();
  j["index_head_dim"] = 8;  // below rotary_dim 16
  EXPECT_NE(error_parsing(j).find("'index_head_dim'"), std::string::npos);

  j = fixture_json();
  j["dense_intermediate_size"] = 0;
  EXPECT_NE(error_parsing(j).find("'dense_intermediate_size'"), std::string::npos);

  j = fixture_json();
  j["model_type"] = "llama";
  EXPECT_NE(error_parsing(j).find("'model_type'"), std::string::npos);

  j = fixture_json();
  j["sparse_attention_config"] = 3;
  EXPECT_NE(error_parsing(j).find("'sparse_attention_config' must be an object"), std::string::npos);

  EXPECT_NE(error_parsing(json::array()).find("expected a JSON object"), std::string::npos);
}

TEST(Config, FileErrorsNameThePath) {
  const auto dir = test::make_temp_dir("config");
  std::string msg = error_of([&] { ModelConfig::from_file(dir / "nope.json"); });
  EXPECT_NE(msg.find("nope.json"), std::string::npos) << msg;

  const auto bad = dir / "bad.json";
  std::ofstream(bad) << "{\n  \"hidden_size\": 128,\n  oops\n}\n";
  msg = error_of([&] { ModelConfig::from_file(bad); });
  EXPECT_NE(msg.find("bad.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 3"), std::string::npos) << msg;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tpmoe
