#include "backends/cuda/device_weights.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstddef>
#include <cstring>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/elementwise.cuh"
#include "backends/cuda/mxfp8.cuh"
#include "core/error.h"
#include "model/presets.h"
#include "model/weight_table.h"

namespace tpmoe::cuda {

DeviceWeights::~DeviceWeights() {
  for (void* p : allocations_) cudaFree(p);
}

namespace {

// A layer's projections of the attention input, in the order Model::attention passes them to
// Ops::linears (q, k, v, then the indexer's q and k): what CudaOps::linears joins where they lie
// back to back (bf16, or MXFP8 with their scales back to back too).
std::vector<const Tensor*> attention_input_projections(const LayerWeights& l) {
  return {&l.attn.q_proj, &l.attn.k_proj, &l.attn.v_proj, &l.attn.index_q_proj, &l.attn.index_k_proj};
}

}  // namespace

void DeviceWeights::place_together(const std::vector<std::pair<const Tensor*, Tensor>>& slots) {
  if (slots.size() < 2) return;
  const DType dtype = slots[0].second.dtype;
  const bool fp8 = dtype == DType::kF8E4M3;
  if (dtype != DType::kBF16 && !fp8) return;
  size_t total = 0, total_scales = 0;
  for (const auto& [slot, shape] : slots) {
    const size_t bytes = size_t(shape.numel()) * dtype_size(dtype), scale_bytes = fp8 ? bytes / kMxfp8BlockSize : 0;
    if (shape.dtype != dtype || bytes == 0 || bytes % 256 != 0 || scale_bytes % 16 != 0) return;
    total += bytes;
    total_scales += scale_bytes;
  }
  std::byte *data = nullptr, *scales = nullptr;
  CUDA_CHECK(cudaMalloc(&data, total));
  allocations_.push_back(data);
  if (fp8) {
    CUDA_CHECK(cudaMalloc(&scales, total_scales));
    allocations_.push_back(scales);
  }
  for (const auto& [slot, shape] : slots) {
    const size_t bytes = size_t(shape.numel()) * dtype_size(dtype);
    placed_[slot] = {data, fp8 ? scales : nullptr, bytes, dtype};
    data += bytes;
    if (fp8) scales += bytes / kMxfp8BlockSize;
  }
}

Tensor DeviceWeights::alloc_like(const Tensor& s, DType dtype, const Tensor* slot) {
  Tensor t = s;
  t.dtype = dtype;
  const size_t scale_bytes = dtype == DType::kF8E4M3 ? t.nbytes() / kMxfp8BlockSize : 0;  // MXFP8: E8M0, 1 per 32
  weights_.bytes += t.nbytes() + scale_bytes;
  if (auto it = placed_.find(slot); slot != nullptr && it != placed_.end()) {
    const Place& at = it->second;
    TPMOE_CHECK(at.dtype == dtype && at.bytes == t.nbytes(),
                "internal: a weight set aside for {} bytes of {} is {} of {}", at.bytes, dtype_name(at.dtype),
                t.nbytes(), dtype_name(dtype));
    t.data = at.data;
    t.scale = at.scale;
    return t;
  }
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(t.nbytes(), 1)));
  allocations_.push_back(p);
  t.data = p;
  t.scale = nullptr;
  if (scale_bytes > 0) {
    CUDA_CHECK(cudaMalloc(&p, scale_bytes));
    allocations_.push_back(p);
    t.scale = p;
  }
  return t;
}

std::unique_ptr<DeviceWeights> DeviceWeights::upload(const ModelWeights& host_in) {
  std::unique_ptr<DeviceWeights> d(new DeviceWeights);
  ModelWeights& host = const_cast<ModelWeights&>(host_in);  // for_each_tensor visits; nothing is written
  std::vector<Tensor*> src;
  for_each_tensor(host, [&](Tensor& t) { src.push_back(&t); });
  d->weights_.layers.resize(host.layers.size());
  for (size_t l = 0; l < host.layers.size(); ++l) {  // as they will be on the device: MXFP8 kept, else bf16
    const std::vector<const Tensor*> from = attention_input_projections(host.layers[l]),
                                     to = attention_input_projections(d->weights_.layers[l]);
    std::vector<std::pair<const Tensor*, Tensor>> together;
    for (size_t k = 0; k < from.size(); ++k) {
      if (from[k]->empty()) continue;
      Tensor shape = *from[k];
      shape.dtype = shape.dtype == DType::kF8E4M3 ? DType::kF8E4M3 : DType::kBF16;
      together.push_back({to[k], shape});
    }
    d->place_together(together);
  }
  size_t i = 0;
  for_each_tensor(d->weights_, [&](Tensor& dst) {
    const Tensor& s = *src[i++];
    if (s.empty()) return;
    // Vectors (norms, bias) stay fp32; matrices are bf16 on the device, MXFP8 ones stay FP8 with their
    // scales (weight-only FP8: widened to bf16 in the GEMMs' registers).
    if (s.dtype == DType::kF8E4M3) {
      dst = d->alloc_like(s, DType::kF8E4M3, &dst);
      CUDA_CHECK(cudaMemcpy(dst.data, s.data, s.nbytes(), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(dst.scale, s.scale, s.nbytes() / kMxfp8BlockSize, cudaMemcpyHostToDevice));
      return;
    }
    const DType dtype = s.ndim == 1 ? DType::kF32 : DType::kBF16;
    dst = d->alloc_like(s, dtype, &dst);
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

std::unique_ptr<DeviceWeights> DeviceWeights::random_preset(const ModelConfig& c, const FusionPlan& plan,
                                                            const RankShard& shard, uint64_t seed) {
  // Every tensor of the shard from the weight table: each block's values come from its canonical
  // tensor's name and element index (as random_weights computes them), generated in place, so no
  // rank ever needs the whole model. Matrices are bf16 on the device - or, in an MXFP8 preset, the
  // linears MXFP8 quantizes are generated as those bf16 values into a staging buffer and quantized
  // there (bit for bit quantize_mxfp8; a block of whole 32-element runs of a row quantizes as it
  // would within the whole tensor). Vectors are made on the host exactly as random_weights makes
  // them (rounded to bf16 as the preset checkpoint stores them, but for the fp32 router bias),
  // then widened to fp32.
  std::unique_ptr<DeviceWeights> d(new DeviceWeights);
  ModelWeights& w = d->weights_;
  const bool mxfp8 = c.quantization.method == QuantMethod::kMxfp8;
  constexpr int64_t kStagingElements = int64_t(1) << 26;  // 128 MiB of bf16
  void* staging = nullptr;
  if (mxfp8) CUDA_CHECK(cudaMalloc(&staging, size_t(kStagingElements) * 2));
  w.layers.resize(size_t(c.num_layers));
  const std::vector<WeightEntry> table = rank_weight_table(c, shard, plan);
  auto quantized_entry = [&](const WeightEntry& e) { return mxfp8 && preset_mxfp8_quantized(e.blocks.front().source); };
  for (const LayerWeights& layer : w.layers) {  // the projections of its attention input, back to back
    std::vector<std::pair<const Tensor*, Tensor>> together;
    for (const Tensor* slot : attention_input_projections(layer))
      for (const WeightEntry& e : table)
        if (&e.slot(w) == slot && e.shape.size() == 2)
          together.push_back({slot, Tensor::make(nullptr, quantized_entry(e) ? DType::kF8E4M3 : DType::kBF16,
                                                 e.shape[0], e.shape[1])});
    d->place_together(together);
  }
  for (const WeightEntry& e : table) {
    const bool quantized = quantized_entry(e);
    const DType dtype = e.vector ? DType::kF32 : quantized ? DType::kF8E4M3 : DType::kBF16;
    Tensor shape = e.shape.size() == 1   ? Tensor::make(nullptr, dtype, e.shape[0])
                   : e.shape.size() == 2 ? Tensor::make(nullptr, dtype, e.shape[0], e.shape[1])
                                         : Tensor::make(nullptr, dtype, e.shape[0], e.shape[1], e.shape[2]);
    Tensor& t = e.slot(w);
    t = d->alloc_like(shape, dtype, &t);
    if (e.vector) {
      std::vector<float> v;
      for (const Block& b : e.blocks) {
        const CanonicalLocation at = canonical_location(c, b.source);
        const bool rounded = !preset_always_f32(b.source);
        for (int64_t i = 0; i < b.rows; ++i) {
          float x = random_value(seed, tensor_key(at.name), uint64_t(at.offset + b.row_begin + i),
                                 preset_stddev(c, b.source));
          v.push_back(rounded ? bf16_to_f32(f32_to_bf16(x)) : x);
        }
      }
      TPMOE_CHECK(int64_t(v.size()) == t.numel(), "internal: preset vector {} has {} of {} values", e.name, v.size(),
                  t.numel());
      CUDA_CHECK(cudaMemcpy(t.data, v.data(), t.nbytes(), cudaMemcpyHostToDevice));
      continue;
    }
    // A column gather of one block is the block itself, row-major: only several blocks interleave.
    TPMOE_CHECK(!quantized || !e.concat_columns || e.blocks.size() == 1,
                "MXFP8 presets: {} gathers columns of {} shared experts; generate it with one shared expert or "
                "with shared-expert fusion on",
                e.name, e.blocks.size());
    const int64_t row_length = e.shape.back();
    int64_t offset = 0;  // elements (concat_columns: columns) written so far
    for (const Block& b : e.blocks) {
      const CanonicalLocation at = canonical_location(c, b.source);
      FillRandomParams p;
      p.seed = seed;
      p.key = tensor_key(at.name);
      p.index_row_stride = at.row_stride;
      p.stddev = preset_stddev(c, b.source);
      p.cols = b.cols;
      if (!quantized) {
        p.out = static_cast<uint16_t*>(t.data) + offset;
        p.rows = b.rows;
        p.out_row_stride = e.concat_columns ? row_length : b.cols;
        p.index_offset = uint64_t(at.offset + b.row_begin * at.row_stride + b.col_begin);
        launch_fill_random(p, nullptr);
        offset += e.concat_columns ? b.cols : b.rows * b.cols;
        continue;
      }
      TPMOE_CHECK(b.cols % kMxfp8BlockSize == 0 && b.col_begin % kMxfp8BlockSize == 0,
                  "MXFP8 presets: {} takes columns [{}, {}) of its weight, not whole 32-element scale blocks (use a "
                  "smaller tp)",
                  e.name, b.col_begin, b.col_begin + b.cols);
      // Through the staging buffer, as many whole rows at a time as fit.
      const int64_t rows_per_chunk = std::max<int64_t>(1, kStagingElements / b.cols);
      for (int64_t r0 = 0; r0 < b.rows; r0 += rows_per_chunk) {
        p.rows = std::min(rows_per_chunk, b.rows - r0);
        p.out = staging;
        p.out_row_stride = b.cols;
        p.index_offset = uint64_t(at.offset + (b.row_begin + r0) * at.row_stride + b.col_begin);
        launch_fill_random(p, nullptr);
        const int64_t n = p.rows * b.cols;
        launch_quantize_mxfp8(static_cast<const __nv_bfloat16*>(staging), static_cast<uint8_t*>(t.data) + offset,
                              static_cast<uint8_t*>(t.scale) + offset / kMxfp8BlockSize, n, nullptr);
        offset += n;
      }
    }
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  if (staging) CUDA_CHECK(cudaFree(staging));
  return d;
}

}  // namespace tpmoe::cuda
