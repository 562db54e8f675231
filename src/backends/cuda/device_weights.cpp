#include "backends/cuda/device_weights.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstring>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/elementwise.cuh"
#include "backends/cuda/mxfp8.cuh"
#include "core/error.h"
#include "model/presets.h"

namespace tpmoe::cuda {

DeviceWeights::~DeviceWeights() {
  for (void* p : allocations_) cudaFree(p);
}

Tensor DeviceWeights::alloc_like(const Tensor& s, DType dtype) {
  Tensor t = s;
  t.dtype = dtype;
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(t.nbytes(), 1)));
  allocations_.push_back(p);
  t.data = p;
  weights_.bytes += t.nbytes();
  t.scale = nullptr;
  if (dtype == DType::kF8E4M3) {  // MXFP8: the E8M0 scales, one byte per 32 elements
    const size_t scale_bytes = t.nbytes() / kMxfp8BlockSize;
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(scale_bytes, 1)));
    allocations_.push_back(p);
    t.scale = p;
    weights_.bytes += scale_bytes;
  }
  return t;
}

std::unique_ptr<DeviceWeights> DeviceWeights::upload(const ModelWeights& host_in) {
  std::unique_ptr<DeviceWeights> d(new DeviceWeights);
  ModelWeights& host = const_cast<ModelWeights&>(host_in);  // for_each_tensor visits; nothing is written
  std::vector<Tensor*> src;
  for_each_tensor(host, [&](Tensor& t) { src.push_back(&t); });
  d->weights_.layers.resize(host.layers.size());
  size_t i = 0;
  for_each_tensor(d->weights_, [&](Tensor& dst) {
    const Tensor& s = *src[i++];
    if (s.empty()) return;
    // Vectors (norms, bias) stay fp32; matrices are bf16 on the device, MXFP8 ones stay FP8 with their
    // scales (weight-only FP8: widened to bf16 in the GEMMs' registers).
    if (s.dtype == DType::kF8E4M3) {
      dst = d->alloc_like(s, DType::kF8E4M3);
      CUDA_CHECK(cudaMemcpy(dst.data, s.data, s.nbytes(), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(dst.scale, s.scale, s.nbytes() / kMxfp8BlockSize, cudaMemcpyHostToDevice));
      return;
    }
    const DType dtype = s.ndim == 1 ? DType::kF32 : DType::kBF16;
    dst = d->alloc_like(s, dtype);
    if (s.dtype == dtype) {
      CUDA_CHECK(cudaMemcpy(dst.data, s.data, s.nbytes(), cudaMemcpyHostToDevice));
      return;
    }
    TPMOE_CHECK(s.dtype == DType::kF32 && dtype == DType::kBF16, "upload: cannot convert {} to {}", dtype_name(s.dtype),
                dtype_name(dtype));
    std::vector<uint16_t> converted(size_t(s.numel()));
    for (size_t k = 0; k < converted.size(); ++k) converted[k] = f32_to_bf16(s.as<const float>()[k]);
    CUDA_CHECK(cudaMemcpy(dst.data, converted.data(), dst.nbytes(), cudaMemcpyHostToDevice));
  });
  return d;
}

namespace {

// Fills a device tensor by concatenating whole preset tensors (at tp 1 every rank tensor is one, or
// for fused experts the routed stack followed by the shared expert).
struct Source {
  std::string name;
  int64_t count;
};

constexpr float kMatrixStd = 0.02f, kNormStd = 0.1f, kBiasStd = 0.01f, kEmbedStd = 1.0f;  // as random_weights

}  // namespace

std::unique_ptr<DeviceWeights> DeviceWeights::random_preset(const ModelConfig& c, const FusionPlan& plan,
                                                            uint64_t seed) {
  TPMOE_CHECK(plan.tp == 1, "device-generated presets are built for tp 1 (got tp {})", plan.tp);
  // The shapes are those load_rank_weights gives the one rank of tp 1; the names and scales those
  // random_weights uses.
  std::unique_ptr<DeviceWeights> d(new DeviceWeights);
  ModelWeights& w = d->weights_;
  const int64_t H = c.hidden_size, hd = c.head_dim, V = c.vocab_size;

  // MXFP8 presets (config.quantization says mxfp8): the linears random_weights quantizes are made as
  // the same bf16 values, then quantized on the device chunk by chunk (bit for bit quantize_mxfp8).
  const bool mxfp8 = c.quantization.method == QuantMethod::kMxfp8;
  constexpr int64_t kChunk = int64_t(1) << 26;  // bf16 staging: 128 MiB
  void* staging = nullptr;
  if (mxfp8) CUDA_CHECK(cudaMalloc(&staging, size_t(kChunk) * 2));
  auto qmatrix = [&](std::vector<int64_t> shape, std::vector<Source> sources, float stddev) {
    Tensor t = shape.size() == 2 ? Tensor::make(nullptr, DType::kF8E4M3, shape[0], shape[1])
                                 : Tensor::make(nullptr, DType::kF8E4M3, shape[0], shape[1], shape[2]);
    t = d->alloc_like(t, DType::kF8E4M3);
    int64_t offset = 0;
    for (const auto& s : sources) {
      for (int64_t i = 0; i < s.count; i += kChunk) {
        const int64_t n = std::min(kChunk, s.count - i);
        launch_fill_random(staging, false, n, seed, tensor_key(s.name), uint64_t(i), stddev, nullptr);
        launch_quantize_mxfp8(static_cast<const __nv_bfloat16*>(staging), static_cast<uint8_t*>(t.data) + offset + i,
                              static_cast<uint8_t*>(t.scale) + (offset + i) / kMxfp8BlockSize, n, nullptr);
      }
      offset += s.count;
    }
    TPMOE_CHECK(offset == t.numel(), "internal: preset tensor sources cover {} of {} elements", offset, t.numel());
    return t;
  };
  auto bf16_matrix = [&](std::vector<int64_t> shape, std::vector<Source> sources, float stddev) {
    Tensor t = shape.size() == 2 ? Tensor::make(nullptr, DType::kBF16, shape[0], shape[1])
                                 : Tensor::make(nullptr, DType::kBF16, shape[0], shape[1], shape[2]);
    t = d->alloc_like(t, DType::kBF16);
    int64_t offset = 0;
    for (const auto& s : sources) {
      launch_fill_random(static_cast<uint16_t*>(t.data) + offset, false, s.count, seed, tensor_key(s.name), 0, stddev,
                         nullptr);
      offset += s.count;
    }
    TPMOE_CHECK(offset == t.numel(), "internal: preset tensor sources cover {} of {} elements", offset, t.numel());
    return t;
  };
  // A quantizable linear: MXFP8 in an MXFP8 preset.
  auto matrix = [&](std::vector<int64_t> shape, std::vector<Source> sources, float stddev) {
    return mxfp8 ? qmatrix(std::move(shape), std::move(sources), stddev)
                 : bf16_matrix(std::move(shape), std::move(sources), stddev);
  };
  // Vectors are tiny: made on the host exactly as random_weights makes them (rounded to the
  // checkpoint dtype when it is bf16), then widened to fp32.
  auto vector = [&](const std::string& name, int64_t n, float stddev, bool rounded) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      v[i] = random_value(seed, tensor_key(name), uint64_t(i), stddev);
      if (rounded) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
    }
    Tensor t = d->alloc_like(Tensor::make(nullptr, DType::kF32, n), DType::kF32);
    CUDA_CHECK(cudaMemcpy(t.data, v.data(), t.nbytes(), cudaMemcpyHostToDevice));
    return t;
  };

  w.embed = bf16_matrix({V, H}, {{"model.embed_tokens.weight", V * H}}, kEmbedStd);
  w.final_norm = vector("model.norm.weight", H, kNormStd, true);
  w.lm_head = bf16_matrix({V, H}, {{"lm_head.weight", V * H}}, kMatrixStd);
  w.layers.resize(size_t(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& lw = w.layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    lw.input_norm = vector(p + "input_layernorm.weight", H, kNormStd, true);
    lw.post_attention_norm = vector(p + "post_attention_layernorm.weight", H, kNormStd, true);
    const int64_t nq = c.num_heads * hd, nkv = c.num_kv_heads * hd;
    lw.attn.q_proj = matrix({nq, H}, {{p + "self_attn.q_proj.weight", nq * H}}, kMatrixStd);
    lw.attn.k_proj = matrix({nkv, H}, {{p + "self_attn.k_proj.weight", nkv * H}}, kMatrixStd);
    lw.attn.v_proj = matrix({nkv, H}, {{p + "self_attn.v_proj.weight", nkv * H}}, kMatrixStd);
    lw.attn.o_proj = matrix({H, nq}, {{p + "self_attn.o_proj.weight", H * nq}}, kMatrixStd);
    lw.attn.q_norm = vector(p + "self_attn.q_norm.weight", hd, kNormStd, true);
    lw.attn.k_norm = vector(p + "self_attn.k_norm.weight", hd, kNormStd, true);
    if (c.layer_types[l] == AttentionType::kSparse) {
      const int64_t ihd = c.index_head_dim, niq = c.index_n_heads * ihd;
      lw.attn.index_q_proj = matrix({niq, H}, {{p + "self_attn.indexer.q_proj.weight", niq * H}}, kMatrixStd);
      lw.attn.index_k_proj = matrix({ihd, H}, {{p + "self_attn.indexer.k_proj.weight", ihd * H}}, kMatrixStd);
      lw.attn.index_q_norm = vector(p + "self_attn.indexer.q_norm.weight", ihd, kNormStd, true);
      lw.attn.index_k_norm = vector(p + "self_attn.indexer.k_norm.weight", ihd, kNormStd, true);
    }
    if (c.mlp_layer_types[l] == MlpType::kDense) {
      const int64_t Id = c.dense_intermediate_size;
      lw.dense.gate_up = matrix({2 * Id, H}, {{p + "mlp.gate_up_proj.weight", 2 * Id * H}}, kMatrixStd);
      lw.dense.down = matrix({H, Id}, {{p + "mlp.down_proj.weight", H * Id}}, kMatrixStd);
      continue;
    }
    const int64_t E = c.num_experts, I = c.moe_intermediate_size, R = plan.shared_expert.physical_rows;
    const int64_t Is = int64_t(c.num_shared_experts) * c.shared_intermediate_size;
    lw.moe.router = bf16_matrix({E, H}, {{p + "mlp.gate.weight", E * H}}, kMatrixStd);
    lw.moe.bias = vector(p + "mlp.gate.e_score_correction_bias", E, kBiasStd, false);
    std::vector<Source> gate_up{{p + "mlp.experts.gate_up_proj", E * 2 * I * H}};
    std::vector<Source> down{{p + "mlp.experts.down_proj", E * H * I}};
    const std::string shared_gate_up = p + "mlp.shared_experts.gate_up_proj.weight";
    const std::string shared_down = p + "mlp.shared_experts.down_proj.weight";
    if (plan.shared_expert.fused) {
      // At tp 1 with one shared expert of the routed shape, its [2I, H] gate_up and [H, I] down are
      // exactly expert row E.
      TPMOE_CHECK(c.num_shared_experts == 1, "device-generated presets fuse exactly one shared expert");
      gate_up.push_back({shared_gate_up, 2 * I * H});
      down.push_back({shared_down, H * I});
    } else if (c.num_shared_experts > 0) {
      lw.moe.shared.gate_up = matrix({2 * Is, H}, {{shared_gate_up, 2 * Is * H}}, kMatrixStd);
      lw.moe.shared.down = matrix({H, Is}, {{shared_down, H * Is}}, kMatrixStd);
    }
    lw.moe.experts_gate_up = matrix({R, 2 * I, H}, gate_up, kMatrixStd);
    lw.moe.experts_down = matrix({R, H, I}, down, kMatrixStd);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  if (staging) CUDA_CHECK(cudaFree(staging));
  return d;
}

}  // namespace tpmoe::cuda
