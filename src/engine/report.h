// What `tpmoe inspect` prints, computed from the config and the parallel layout alone (no weights
// are loaded, so it works for checkpoints larger than memory).
#pragma once

#include <string>

#include "core/dtype.h"
#include "model/config.h"
#include "model/fusion_plan.h"
#include "model/parallel.h"

namespace tpmoe {

std::string describe_config(const ModelConfig& config);

// Bytes of one rank's weights as load_rank_weights stores them: matrices in `matrix_dtype`, vectors fp32.
size_t rank_weight_bytes(const ModelConfig& config, const RankShard& shard, const FusionPlan& plan, DType matrix_dtype);
// KV-cache bytes one token costs on one rank (K, V and, on sparse layers, the index key).
size_t rank_kv_bytes_per_token(const ModelConfig& config, const RankShard& shard, DType cache_dtype);

}  // namespace tpmoe
