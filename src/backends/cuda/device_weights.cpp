#include "backends/cuda/device_weights.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstring>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/elementwise.cuh"
#include "core/error.h"
#include "model/presets.h"
#include "model/weight_table.h"

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
    // Vectors (norms, bias) stay fp32; matrices are bf16 on the device.
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

std::unique_ptr<DeviceWeights> DeviceWeights::random_preset(const ModelConfig& c, const FusionPlan& plan,
                                                            const RankShard& shard, uint64_t seed) {
  // Every tensor of the shard from the weight table: each block's values come from its canonical
  // tensor's name and element index (as random_weights computes them), generated in place, so no
  // rank ever needs the whole model. Matrices are bf16 on the device; vectors are made on the host
  // exactly as random_weights makes them (rounded to bf16 as the preset checkpoint stores them,
  // but for the fp32 router bias), then widened to fp32.
  std::unique_ptr<DeviceWeights> d(new DeviceWeights);
  ModelWeights& w = d->weights_;
  w.layers.resize(size_t(c.num_layers));
  for (const WeightEntry& e : rank_weight_table(c, shard, plan)) {
    Tensor shape = e.shape.size() == 1   ? Tensor::make(nullptr, DType::kF32, e.shape[0])
                   : e.shape.size() == 2 ? Tensor::make(nullptr, DType::kBF16, e.shape[0], e.shape[1])
                                         : Tensor::make(nullptr, DType::kBF16, e.shape[0], e.shape[1], e.shape[2]);
    Tensor& t = e.slot(w);
    t = d->alloc_like(shape, shape.dtype);
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
    const int64_t row_length = e.shape.back();
    int64_t offset = 0;  // elements (concat_columns: columns) written so far
    for (const Block& b : e.blocks) {
      const CanonicalLocation at = canonical_location(c, b.source);
      FillRandomParams p;
      p.out = static_cast<uint16_t*>(t.data) + offset;
      p.rows = b.rows;
      p.cols = b.cols;
      p.out_row_stride = e.concat_columns ? row_length : b.cols;
      p.seed = seed;
      p.key = tensor_key(at.name);
      p.index_offset = uint64_t(at.offset + b.row_begin * at.row_stride + b.col_begin);
      p.index_row_stride = at.row_stride;
      p.stddev = preset_stddev(c, b.source);
      launch_fill_random(p, nullptr);
      offset += e.concat_columns ? b.cols : b.rows * b.cols;
    }
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

}  // namespace tpmoe::cuda
