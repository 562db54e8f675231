#include "engine/next_tokens.h"

namespace tpmoe {

Tensor greedy_ids_on_device(Ops& ops, Model& model, Tensor logits) {
  const int64_t R = logits.dim(0);
  const RankShard& shard = model.shard();
  Tensor ids = ops.alloc_typed(R, 1, DType::kI32);
  if (!shard.vocab_parallel()) {
    ops.argmax(logits, ids, Tensor());
    return ids;
  }
  // This rank's winners, ids then their values' bits, in one buffer: one all-gather a step.
  Tensor mine = ops.alloc_typed(2 * R, 1, DType::kI32);
  ops.argmax(logits, Tensor::make(mine.data, DType::kI32, R, 1),
             Tensor::make(mine.as<int32_t>() + R, DType::kF32, R, 1));
  Tensor all = ops.alloc_typed(shard.tp * 2 * R, 1, DType::kI32);
  model.comm().all_gather(mine, all);
  ops.combine_vocab_argmax(all, shard.vocab_size, ids);
  return ids;
}

std::vector<int32_t> greedy_ids(Ops& ops, Model& model, Tensor logits) {
  return ops.ids_to_host(greedy_ids_on_device(ops, model, logits));
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

Tensor sampled_ids_on_device(Ops& ops, Model& model, Tensor logits, const SampleBatch& batch) {
  Tensor full = full_logits_on_device(ops, model, logits);
  Tensor ids = ops.alloc_typed(full.dim(0), 1, DType::kI32);
  ops.sample(full, batch, ids);
  return ids;
}

std::vector<int32_t> sampled_ids(Ops& ops, Model& model, Tensor logits, const SampleBatch& batch) {
  return ops.ids_to_host(sampled_ids_on_device(ops, model, logits, batch));
}

}  // namespace tpmoe
