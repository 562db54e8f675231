// What `tpmoe inspect` prints, computed from the config and the parallel layout alone (no weights
// are loaded, so it works for checkpoints larger than memory).
#pragma once

#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"
#include "model/fusion_plan.h"
#include "model/parallel.h"

namespace tpmoe {

std::string describe_config(const ModelConfig& config);

// Bytes of one rank's weights as load_rank_weights stores them: matrices in `matrix_dtype`, vectors fp32.
size_t rank_weight_bytes(const ModelConfig& config, const RankShard& shard, const FusionPlan& plan, DType matrix_dtype,
                         bool mxfp8_kept = false);
// Expected distinct routed experts a batch of `batch` tokens touches in one MoE layer when routing is
// uniform (each token picks k of E): E * (1 - (1 - k/E)^batch).
double expected_distinct_experts(const ModelConfig& config, int batch);
// Weight bytes one decode step of `batch` tokens reads on one rank (from the weight table): every
// dense weight once, the embedding rows of the batch, and the expert rows touched - shared always,
// routed: `routed_experts_per_layer[l]` distinct experts in MoE layer l when given (what the router
// actually chose), else the uniform-routing expectation above.
// `mxfp8_kept`: an MXFP8 model's quantized linears are held as FP8 + scales (1 + 1/32 bytes an
// element, the CUDA backend) rather than dequantized to matrix_dtype.
double decode_weight_bytes(const ModelConfig& config, const RankShard& shard, const FusionPlan& plan, int batch,
                           DType matrix_dtype, const std::vector<double>* routed_experts_per_layer = nullptr,
                           bool mxfp8_kept = false);

// KV-cache bytes one token costs on one rank (K, V and, on sparse layers, the index key).
size_t rank_kv_bytes_per_token(const ModelConfig& config, const RankShard& shard, DType cache_dtype);

}  // namespace tpmoe
