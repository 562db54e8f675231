#include "model/presets.h"

#include <algorithm>
#include <cmath>
#include <string_view>
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

std::pair<io::OwnedTensor, io::OwnedTensor> quantize_mxfp8(const std::vector<int64_t>& shape,
                                                           std::span<const float> values) {
  TPMOE_CHECK(!shape.empty() && shape.back() % kMxfp8BlockSize == 0,
              "quantize_mxfp8: the last dimension must be a multiple of {}", kMxfp8BlockSize);
  const size_t blocks = values.size() / kMxfp8BlockSize;
  io::OwnedTensor q{DType::kF8E4M3, shape, std::vector<std::byte>(values.size())};
  std::vector<int64_t> scale_shape = shape;
  scale_shape.back() /= kMxfp8BlockSize;
  io::OwnedTensor s{DType::kU8, scale_shape, std::vector<std::byte>(blocks)};
#pragma omp parallel for
  for (int64_t b = 0; b < int64_t(blocks); ++b) {
    const float* v = values.data() + b * kMxfp8BlockSize;
    float amax = 0.f;
    for (int i = 0; i < kMxfp8BlockSize; ++i) amax = std::max(amax, std::fabs(v[i]));
    // Smallest e with amax / 2^e <= 448 (with amax in [2^E, 2^(E+1)): E - 8 or E - 7), found without
    // log2 rounding so the device generator (launch_quantize_mxfp8) gets the same bits; all zeros: 2^0.
    int e = 0;
    if (amax > 0) {
      const int E = std::ilogb(amax);
      e = E - 8 + (std::ldexp(amax, 8 - E) > 448.f ? 1 : 0);
    }
    e = std::clamp(e, -127, 127);
    s.bytes[b] = std::byte(uint8_t(e + 127));
    for (int i = 0; i < kMxfp8BlockSize; ++i)
      q.bytes[b * kMxfp8BlockSize + i] = std::byte(f32_to_fp8_e4m3(std::ldexp(v[i], -e)));
  }
  return {std::move(q), std::move(s)};
}

void set_mxfp8(ModelConfig& config) {
  config.quantization.method = QuantMethod::kMxfp8;
  config.quantization.ignored_layers = {"lm_head", "model.embed_tokens", "mlp.gate"};
}

std::map<std::string, io::OwnedTensor> random_weights(const ModelConfig& c, uint64_t seed, DType dtype) {
  const bool mxfp8 = dtype == DType::kF8E4M3;
  TPMOE_CHECK(!mxfp8 || c.quantization.method == QuantMethod::kMxfp8,
              "random_weights: MXFP8 weights need a config whose quantization_config says mxfp8");
  std::map<std::string, io::OwnedTensor> out;
  for (const CanonicalTensor& t : canonical_tensors(c)) {
    int64_t n = 1;
    for (auto d : t.shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    const uint64_t key = tensor_key(t.name);
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) v[i] = random_value(seed, key, uint64_t(i), t.stddev);
    DType dt = t.always_f32 ? DType::kF32 : dtype;
    if (dt == DType::kF8E4M3) {
      if (t.mxfp8_quantized) {
        // The bf16 weights, quantized: the same values a bf16 preset holds, to MXFP8 precision.
        for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
        auto [q, scale] = quantize_mxfp8(t.shape, v);
        out[t.name] = std::move(q);
        out[t.name + "_scale_inv"] = std::move(scale);
        continue;
      }
      dt = DType::kBF16;  // what MXFP8 leaves unquantized stays bf16
    }
    out[t.name] = io::OwnedTensor::from_f32(t.shape, v, dt);
  }
  return out;
}

}  // namespace tpmoe
