// One rank's weights in GPU memory: bf16 matrices (MXFP8 ones kept as e4m3 + E8M0 scales), fp32 vectors, the same
// ModelWeights structure the forward reads on the CPU. Either uploaded from host weights (a checkpoint) or, for
// presets, generated straight on the device (a full-width MiniMax-M3 layer is ~15 GB: no file, no host copy).
// A layer's projections of the attention input (q, k, v, the indexer's q and k) lie back to back in one
// allocation, in that order (MXFP8: their scales too, in another), so that CudaOps::linears can run them as one
// matmul.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "model/fusion_plan.h"
#include "model/parallel.h"
#include "model/weights.h"

namespace tpmoe::cuda {

class DeviceWeights {
 public:
  // Copies `host` to the device, converting fp32 matrices to bf16.
  static std::unique_ptr<DeviceWeights> upload(const ModelWeights& host);
  // Rank `shard`'s slice of the preset weights random_weights(config, seed, BF16) would give, made
  // on the device block by block (bitwise what loading that checkpoint would give the rank).
  static std::unique_ptr<DeviceWeights> random_preset(const ModelConfig& config, const FusionPlan& plan,
                                                      const RankShard& shard, uint64_t seed);
  ~DeviceWeights();

  const ModelWeights& weights() const { return weights_; }
  size_t bytes() const { return weights_.bytes; }

 private:
  DeviceWeights() = default;
  // Device memory for the tensor that goes into `slot` (a tensor of weights_), of shape_of's shape
  // (and MXFP8 scales): its place among the slots place_together set aside, or allocations of its own.
  Tensor alloc_like(const Tensor& shape_of, DType dtype, const Tensor* slot = nullptr);
  // One allocation for the slots (shapes and device dtypes given, all bf16 or all MXFP8), back to back
  // in the order given, and for MXFP8 one more for their scales, back to back too. Only where every
  // size keeps the next slot 256-byte aligned, as an allocation of its own would be (scales: 16-byte,
  // what the kernels' vector loads need; an index key head's scales at K 128 are 128 bytes).
  void place_together(const std::vector<std::pair<const Tensor*, Tensor>>& slots);
  struct Place {
    void* data;
    void* scale;  // MXFP8
    size_t bytes;
    DType dtype;
  };
  ModelWeights weights_;
  std::vector<void*> allocations_;
  std::map<const Tensor*, Place> placed_;
};

}  // namespace tpmoe::cuda
