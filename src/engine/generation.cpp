#include "engine/generation.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"

namespace tpmoe {

namespace {

int max_prompt_length(const GenerateRequest& req) {
  size_t n = 0;
  for (const auto& p : req.prompts) n = std::max(n, p.size());
  return int(n);
}

// Greedy ids of `logits`, this rank's vocabulary slice of each row. With a vocab-parallel lm_head:
// each rank's best (value, index) per row, one all-gather of those, then the best over ranks - NaN
// first, then the larger value, ties to the lower rank (the lower vocabulary index), as one argmax
// over the whole row would choose. Collective: every rank calls it with the same shapes.
std::vector<int32_t> greedy(Ops& ops, Model& model, Tensor logits) {
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
    int best = 0;
    for (int q = 1; q < tp; ++q) {
      const float v = host_values[size_t(q * R + r)], b = host_values[size_t(best * R + r)];
      if (!std::isnan(b) && (std::isnan(v) || v > b)) best = q;
    }
    out[r] = best * shard.vocab_size + host_ids[size_t(best * R + r)];
  }
  return out;
}

// The whole vocabulary of each row of `logits` on the host, [R * V]: gathered from every rank when
// lm_head is vocab-parallel (collective), this rank's rows otherwise.
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

}  // namespace

void validate_request(const GenerateRequest& req, int vocab_size) {
  const int B = int(req.prompts.size()), G = req.max_new_tokens;
  TPMOE_CHECK(B > 0, "generate: no prompts");
  TPMOE_CHECK(G >= 1, "generate: max_new_tokens must be at least 1, got {}", G);
  for (int b = 0; b < B; ++b) {
    TPMOE_CHECK(!req.prompts[b].empty(), "generate: prompt {} is empty", b);
    for (int32_t id : req.prompts[b])
      TPMOE_CHECK(id >= 0 && id < vocab_size, "generate: prompt {} has token id {}, outside the vocabulary (size {})",
                  b, id, vocab_size);
  }
  if (req.forced_tokens.empty()) return;
  TPMOE_CHECK(int(req.forced_tokens.size()) == B, "teacher forcing: {} rows of forced tokens for {} prompts",
              req.forced_tokens.size(), B);
  for (const auto& f : req.forced_tokens) {
    TPMOE_CHECK(int(f.size()) >= G - 1, "teacher forcing: {} forced tokens, need {} for {} new tokens", f.size(), G - 1,
                G);
    for (int32_t id : f)
      TPMOE_CHECK(id >= 0 && id < vocab_size, "teacher forcing: token id {} outside the vocabulary (size {})", id,
                  vocab_size);
  }
}

int decode_bucket(int batch) {
  int bucket = 1;
  while (bucket < batch) bucket *= 2;
  return bucket;
}

CacheShape request_cache_shape(const Model& model, const GenerateRequest& req, bool padded) {
  const int B = int(req.prompts.size());
  return model.cache_shape(padded ? decode_bucket(B) : B, max_prompt_length(req) + req.max_new_tokens);
}

void generate_on_rank(Ops& ops, Model& model, int V, const GenerateRequest& req, GenerateResult* out) {
  const int B = int(req.prompts.size()), G = req.max_new_tokens;
  // Prefill: every prompt in one step. Logits only where they are wanted: the last prompt token of
  // each sequence, or every position when prefill logits are asked for.
  StepTokens step;
  std::vector<int> last_row(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) {
    const auto& p = req.prompts[b];
    for (int i = 0; i < int(p.size()); ++i) {
      if (req.return_prefill_logits || i + 1 == int(p.size())) step.logit_rows.push_back(step.num_tokens());
      step.token_ids.push_back(p[i]);
      step.positions.push_back(i);
      step.seq_slots.push_back(b);
    }
    last_row[b] = int(step.logit_rows.size()) - 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (req.record_routing) ops.enable_routing_stats(model.num_layers(), model.num_experts());
  ops.begin_step(step);
  Tensor logits = model.forward(step);
  std::vector<int32_t> next = greedy(ops, model, logits);  // one id per logit row
  std::vector<std::vector<int32_t>> generated(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) generated[b].push_back(next[last_row[b]]);
  // Logits reach the host only when asked for (every rank gathers; rank 0 keeps them).
  if (req.return_step_logits || req.return_prefill_logits) {
    const std::vector<float> host = full_logits_to_host(ops, model, logits);
    std::vector<float> step_logits(size_t(B) * V);
    for (int b = 0; b < B; ++b) std::copy_n(&host[size_t(last_row[b]) * V], V, &step_logits[size_t(b) * V]);
    if (out && req.return_step_logits) out->step_logits.push_back(std::move(step_logits));
    if (out && req.return_prefill_logits) {
      size_t row = 0;
      for (int b = 0; b < B; ++b) {
        const size_t n = req.prompts[b].size() * size_t(V);
        out->prefill_logits.emplace_back(host.begin() + row * V, host.begin() + row * V + n);
        row += req.prompts[b].size();
      }
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  if (req.record_routing) ops.take_routed_experts();  // the prefill's choices are not a decode step's

  // Decode: one token per sequence per step. A recording backend gets the batch padded to its
  // bucket; the padding rows decode token 0 at position 0 in slots of their own and are ignored.
  const int rows = ops.records_steps() ? decode_bucket(B) : B;
  std::vector<double> step_seconds;
  step_seconds.reserve(size_t(std::max(0, G - 1)));
  for (int i = 1; i < G; ++i) {
    const auto step_start = std::chrono::steady_clock::now();
    StepTokens d;
    for (int b = 0; b < rows; ++b) {
      const bool real = b < B;
      d.token_ids.push_back(!real ? 0 : req.forced_tokens.empty() ? generated[b][i - 1] : req.forced_tokens[b][i - 1]);
      d.positions.push_back(real ? int(req.prompts[b].size()) + i - 1 : 0);
      d.seq_slots.push_back(b);
      d.logit_rows.push_back(b);
    }
    d.num_padding = rows - B;
    ops.begin_step(d);
    logits = ops.run_step(rows, [&] { return model.forward(d); });
    next = greedy(ops, model, logits);
    for (int b = 0; b < B; ++b) generated[b].push_back(next[b]);
    if (req.return_step_logits) {
      std::vector<float> host = full_logits_to_host(ops, model, logits);
      host.resize(size_t(B) * V);
      if (out) out->step_logits.push_back(std::move(host));
    }
    step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count());
    if (req.record_routing) {  // outside the timed step: it waits for the device
      std::vector<int> routed = ops.take_routed_experts();
      if (out) out->step_routed_experts.push_back(std::move(routed));
    }
  }
  const auto t2 = std::chrono::steady_clock::now();
  if (out) {
    out->vocab_size = V;
    out->generated = std::move(generated);
    out->prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
    out->decode_seconds = std::chrono::duration<double>(t2 - t1).count();
    out->step_seconds = std::move(step_seconds);
    out->launches_per_step = ops.last_step_launches();
  }
}

}  // namespace tpmoe
