// The generation loop one rank runs: prefill every prompt in one step, then greedy decode steps.
// Backend-agnostic: it drives a Model over any Ops. Every rank of a tensor-parallel group runs it
// (SPMD); only the rank given a result records.
#pragma once

#include "model/model.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {

// Checks the request against the model (ids inside the vocabulary, forced tokens long enough);
// throws naming the problem. Call before starting ranks.
void validate_request(const GenerateRequest& req, int vocab_size);

// Cache slots and positions a request needs: sequences (padded to the decode bucket when the
// backend records steps) and the longest prompt + new tokens.
CacheShape request_cache_shape(const Model& model, const GenerateRequest& req, bool padded);

// Decode batches are padded up to one of these sizes when the backend records steps, so a few
// recordings serve every batch.
int decode_bucket(int batch);

// `seed`: the request's sampling seed (resolve_seed, the same on every rank). Only the rank given
// `out` records results and streams text.
void generate_on_rank(Ops& ops, Model& model, int vocab_size, const GenerateRequest& req, uint64_t seed,
                      GenerateResult* out);

}  // namespace tpmoe
