#include "model/presets.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "model/weight_table.h"

namespace tpmoe {

ModelConfig preset_config(const std::string& name, std::optional<int> layers) {
  ModelConfig c;
  if (name == "tiny") {
    // The fixture's family at a little more width: more heads and experts than m3-tiny, so tp 2 and 4
    // split every dimension and tp 4 replicates nothing it should not.
    c.hidden_size = 128;
    c.num_layers = 4;
    c.num_heads = 8;
    c.num_kv_heads = 4;
    c.head_dim = 32;
    c.rotary_dim = 16;
    c.rope_theta = 5e6;
    c.vocab_size = 512;
    c.num_experts = 16;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 64;
    c.num_shared_experts = 1;
    c.shared_intermediate_size = 64;
    c.dense_intermediate_size = 192;
    c.routed_scaling_factor = 2.0f;
    c.index_n_heads = 4;
    c.index_head_dim = 32;
    c.index_block_size = 8;
    c.index_topk_blocks = 2;
    c.index_local_blocks = 1;
    const int n = layers.value_or(4);
    c.num_layers = n;
    for (int l = 0; l < n; ++l) {
      c.layer_types.push_back(l < n / 2 ? AttentionType::kFull : AttentionType::kSparse);
      c.mlp_layer_types.push_back(l == 0 ? MlpType::kDense : MlpType::kMoe);
    }
  } else if (name == "m3") {
    c.hidden_size = 6144;
    c.num_heads = 64;
    c.num_kv_heads = 4;
    c.head_dim = 128;
    c.rotary_dim = 64;
    c.rope_theta = 5e6;
    c.vocab_size = 200064;
    c.num_experts = 128;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 3072;
    c.num_shared_experts = 1;
    c.shared_intermediate_size = 3072;
    c.dense_intermediate_size = 12288;
    c.routed_scaling_factor = 2.0f;
    // Indexer shapes: one index head per KV head (SPEC §1); the head dim, block size and kept-block
    // counts are this preset's choice, not read from a released config.
    c.index_n_heads = 4;
    c.index_head_dim = 128;
    c.index_block_size = 64;
    c.index_topk_blocks = 16;
    c.index_local_blocks = 1;
    c.num_layers = layers.value_or(60);
    for (int l = 0; l < c.num_layers; ++l) {
      const bool dense = !layers && l < 3;
      c.layer_types.push_back(dense ? AttentionType::kFull : AttentionType::kSparse);
      c.mlp_layer_types.push_back(dense ? MlpType::kDense : MlpType::kMoe);
    }
  } else {
    TPMOE_FAIL("unknown preset '{}' (presets: tiny, m3)", name);
  }
  c.validate("preset " + name);
  return c;
}

uint64_t tensor_key(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

float random_value(uint64_t seed, uint64_t key, uint64_t index, float stddev) {
  const uint64_t bits = splitmix64(splitmix64(seed ^ key) + index);
  const float unit = float(bits >> 40) * (1.0f / float(1ull << 24));  // [0, 1)
  return (2.f * unit - 1.f) * 1.7320508f * stddev;
}

std::map<std::string, io::OwnedTensor> random_weights(const ModelConfig& c, uint64_t seed, DType dtype) {
  std::map<std::string, io::OwnedTensor> out;
  for (const CanonicalTensor& t : canonical_tensors(c)) {
    int64_t n = 1;
    for (auto d : t.shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    const uint64_t key = tensor_key(t.name);
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) v[i] = random_value(seed, key, uint64_t(i), t.stddev);
    out[t.name] = io::OwnedTensor::from_f32(t.shape, v, t.always_f32 ? DType::kF32 : dtype);
  }
  return out;
}

}  // namespace tpmoe
