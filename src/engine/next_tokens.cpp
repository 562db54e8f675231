#include "engine/next_tokens.h"

#include <algorithm>
#include <cmath>

namespace tpmoe {

std::vector<int32_t> greedy_ids(Ops& ops, Model& model, Tensor logits) {
  const int64_t R = logits.dim(0);
  const RankShard& shard = model.shard();
  Tensor ids = ops.alloc_typed(R, 1, DType::kI32);
  if (!shard.vocab_parallel()) {
    ops.argmax(logits, ids, Tensor());
    return ops.ids_to_host(ids);
  }
  Tensor values = ops.alloc_typed(R, 1, DType::kF32);
  ops.argmax(logits, ids, values);
  const int tp = shard.tp;
  Tensor all_ids = ops.alloc_typed(tp * R, 1, DType::kI32), all_values = ops.alloc_typed(tp * R, 1, DType::kF32);
  model.comm().all_gather(ids, all_ids);
  model.comm().all_gather(values, all_values);
  const std::vector<int32_t> host_ids = ops.ids_to_host(all_ids);
  const std::vector<float> host_values = ops.to_host(all_values);
  std::vector<int32_t> out(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    // NaN first, then the larger value, ties to the lower rank (the lower vocabulary index): what
    // one argmax over the whole row would choose.
    int best = 0;
    for (int q = 1; q < tp; ++q) {
      const float v = host_values[size_t(q * R + r)], b = host_values[size_t(best * R + r)];
      if (!std::isnan(b) && (std::isnan(v) || v > b)) best = q;
    }
    out[r] = best * shard.vocab_size + host_ids[size_t(best * R + r)];
  }
  return out;
}

Tensor full_logits_on_device(Ops& ops, Model& model, Tensor logits) {
  const RankShard& shard = model.shard();
  if (!shard.vocab_parallel()) return logits;
  const int64_t R = logits.dim(0), Vl = logits.dim(1);
  Tensor gathered = ops.alloc_typed(shard.tp * R, Vl, DType::kF32),
         full = ops.alloc_typed(R, Vl * shard.tp, DType::kF32);
  model.comm().all_gather(logits, gathered);
  for (int q = 0; q < shard.tp; ++q)
    ops.copy_columns(Tensor::make(gathered.as<float>() + q * R * Vl, DType::kF32, R, Vl), full, q * Vl);
  return full;
}

std::vector<float> full_logits_to_host(Ops& ops, Model& model, Tensor logits) {
  const RankShard& shard = model.shard();
  if (!shard.vocab_parallel()) return ops.to_host(logits);
  const int64_t R = logits.dim(0), Vl = logits.dim(1), V = Vl * shard.tp;
  Tensor gathered = ops.alloc_typed(shard.tp * R, Vl, DType::kF32);
  model.comm().all_gather(logits, gathered);
  const std::vector<float> host = ops.to_host(gathered);  // [rank][row][Vl]
  std::vector<float> out(static_cast<size_t>(R * V));
  for (int q = 0; q < shard.tp; ++q)
    for (int64_t r = 0; r < R; ++r) std::copy_n(&host[size_t((q * R + r) * Vl)], Vl, &out[size_t(r * V + q * Vl)]);
  return out;
}

std::vector<int32_t> sampled_ids(Ops& ops, Model& model, Tensor logits, const SampleBatch& batch) {
  Tensor full = full_logits_on_device(ops, model, logits);
  Tensor ids = ops.alloc_typed(full.dim(0), 1, DType::kI32);
  ops.sample(full, batch, ids);
  return ops.ids_to_host(ids);
}

}  // namespace tpmoe
