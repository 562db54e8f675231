// From a step's logits to the next token of each row, for every rank of a tensor-parallel group
// alike: the generation loop (generation.cpp) and the serving loop (serve_loop.cpp) both end a
// step here. With a vocab-parallel lm_head each rank holds a slice of every row, so these are
// collective: every rank calls them with the same shapes.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model.h"
#include "model/ops.h"

namespace tpmoe {

// The greedy id of every row of `logits` (this rank's vocabulary slice of each row): the first
// maximum over the whole vocabulary, NaN first, as torch.argmax. Vocab-parallel: each rank's best
// (value, index) per row, one all-gather of those, then the best over ranks (on the device).
// The _on_device forms leave the ids there ([R] int32, step scratch), for Ops::keep_ids.
Tensor greedy_ids_on_device(Ops& ops, Model& model, Tensor logits);
std::vector<int32_t> greedy_ids(Ops& ops, Model& model, Tensor logits);

// The device logits of every row over the whole vocabulary, [R, V]: this rank's rows as they are,
// or (vocab-parallel) every rank's slice gathered and laid side by side.
Tensor full_logits_on_device(Ops& ops, Model& model, Tensor logits);

// The whole vocabulary of each row on the host, [R * V].
std::vector<float> full_logits_to_host(Ops& ops, Model& model, Tensor logits);

// The drawn id of every row under `batch` (one SampleRowParams per row; Ops::sample).
Tensor sampled_ids_on_device(Ops& ops, Model& model, Tensor logits, const SampleBatch& batch);
std::vector<int32_t> sampled_ids(Ops& ops, Model& model, Tensor logits, const SampleBatch& batch);

}  // namespace tpmoe
