// The ops the model forward is written against. Each backend (CPU oracle, CUDA) implements them;
// the forward in model.cpp runs unchanged on either. Ops are coarse where a backend profits from
// fusing inside (attention with its cache writes and block selection, the routed-expert GEMMs with
// their combine) and fine where the model's structure must stay visible (norms, projections, the
// places partial sums are reduced).
//
// Shapes are validated once, when the model is built; ops trust them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "model/tensor.h"

namespace tpmoe {

// The tokens of one forward step, flattened over sequences: prefill of several prompts and decode
// of a batch are the same thing (token t belongs to cache slot seq_slot[t] at position position[t]).
struct StepTokens {
  // kFedBackId (decode steps that overlap the host): the id this token's row drew in the step
  // before, as the backend kept it (Ops::keep_ids), which the host has not seen yet.
  static constexpr int32_t kFedBackId = -1;
  std::vector<int32_t> token_ids;
  std::vector<int32_t> positions;
  std::vector<int32_t> seq_slots;
  // Rows of the step whose logits are wanted (the last prompt token of each sequence, or every row).
  std::vector<int32_t> logit_rows;
  // The last num_padding tokens only pad the batch to a recorded size: their results are ignored.
  int num_padding = 0;
  // The paged cache's page table, [slots][pages_per_seq] with slots <= max_seqs (CacheShape):
  // position p of slot s is row page_table[s * pages_per_seq + p / page_size] * page_size +
  // p % page_size of the pool; -1 marks a page the slot does not hold. A slot is only the step's
  // name for a sequence: where its keys live is the table's business, so a scheduler may number
  // the step's sequences 0, 1, ... and send only their rows. Empty: slot s holds pages
  // [s * pages_per_seq, (s + 1) * pages_per_seq), the table of a pool with a page for every
  // position of every slot.
  std::vector<int32_t> page_table;
  int num_tokens() const { return int(token_ids.size()); }
};

// Positions per KV-cache page unless a caller chooses (a power of two: kernels shift, not divide).
inline constexpr int kDefaultPageSize = 16;

// Per-rank shape of the KV cache (and the index-key cache of sparse layers): a pool of num_pages
// pages of page_size positions each, which sequence slots map through StepTokens::page_table.
struct CacheShape {
  int num_layers = 0;
  std::vector<bool> sparse_layer;  // layer has an index-key cache
  int num_kv_heads = 0;            // local to the rank
  int head_dim = 0;
  int index_head_dim = 0;
  int max_seqs = 0;  // sequence slots (rows of the page table)
  int max_len = 0;   // positions one slot may hold
  int page_size = kDefaultPageSize;
  int num_pages = 0;
  int pages_per_seq() const { return (max_len + page_size - 1) / page_size; }
  // Throws naming the problem: page_size not a power of two, an empty cache.
  void validate() const;
  // The row of (slot, position) in the pool, -1 where the slot holds no page for it (page_table as
  // in StepTokens, empty for the identity table).
  int64_t row(const std::vector<int32_t>& page_table, int slot, int position) const {
    const int page = position / page_size, pps = pages_per_seq();
    const int32_t phys = page_table.empty() ? slot * pps + page : page_table[size_t(slot) * pps + page];
    return phys < 0 ? -1 : int64_t(phys) * page_size + position % page_size;
  }
};

struct RopeParams {
  int head_dim = 0;
  int rotary_dim = 0;
  float theta = 0;
  float eps = 0;  // of the per-head Gemma norm that precedes RoPE
};

// One projection of Ops::linears: out[T, N] = x[T, K] weight[N, K]^T.
struct Projection {
  Tensor weight;
  Tensor out;
};

// One tensor for head_norm_rope: x[T, num_heads * rope.head_dim] in place, its per-head norm weight.
struct HeadNormRope {
  Tensor x;
  int num_heads = 0;
  Tensor weight;
  RopeParams rope;
};

struct AttentionParams {
  int layer = 0;
  int num_q_heads = 0;   // local
  int num_kv_heads = 0;  // local
  int head_dim = 0;
  float scale = 0;
  // Lightning indexer (sparse layers only; index_q empty on full-attention layers).
  int num_index_heads = 0;  // local, == num_kv_heads
  int index_head_dim = 0;
  int block_size = 0;
  int topk_blocks = 0;
  int local_blocks = 0;
};

struct SwigluParams {
  float alpha = 1.702f;
  float limit = 7.0f;
};

struct RouterParams {
  int layer = 0;
  int num_experts = 0;       // E: routed experts, the router's width
  int top_k = 0;             // k
  int num_shared_slots = 0;  // n appended shared slots (0 when shared-expert fusion is off)
  float shared_weight = 0;   // weight of each appended slot (1 / rsf)
};

// The router's half of a MoE layer, for Ops::route_experts: its logits and bias in, the slots out.
struct Routing {
  Tensor logits;  // [T, E] fp32
  Tensor bias;    // [E] fp32
  RouterParams params;
  Tensor slot_ids, slot_weights;  // [T, k+n]: written
};

// One row of a sampling op: the request's SamplingParams as the op needs them (sampling.h says
// what each filter does; SamplingParams::validate has checked them) plus the row's RNG key.
struct SampleRowParams {
  float temperature = 0;  // below kGreedyTemperature: greedy argmax (of the penalised logits)
  int32_t top_k = 0;      // <= 0: off
  float top_p = 1;        // 1: off
  float min_p = 0;        // 0: off
  float repetition_penalty = 1, presence_penalty = 0, frequency_penalty = 0;
  uint64_t seed = 0;
  // The sequence's own step counter: 0 for its first generated token (sampled from the prefill's
  // logits), n for its (n+1)-th. Never the batch's step: a draw must not depend on batch-mates.
  uint32_t step = 0;
};

// What the sampling op reads for a batch of logit rows. The penalty inputs are CSR over the rows:
// row r's entries are [penalty_offsets[r], penalty_offsets[r+1]), token ids strictly increasing,
// each a token the sequence has seen with the times it was generated (0: only in the prompt). A row
// without penalties has no entries. Small: built on the host each step (SampleBatchBuilder).
struct SampleBatch {
  std::vector<SampleRowParams> rows;
  std::vector<int32_t> penalty_offsets;  // rows + 1 (empty: no row has entries)
  std::vector<int32_t> penalty_token_ids;
  std::vector<int32_t> penalty_counts;
};

// Throws naming the problem when a token's slot, position or page is outside the cache (what
// every backend's begin_step checks before it writes there).
void check_step_fits_cache(const StepTokens& step, const CacheShape& cache);

// Whether every key a token of the step attends to below its own position is one an earlier step
// wrote: no sequence has tokens at two positions (a decode step; padding rows may share a slot at
// one position), and no page the step writes is mapped, below a token's position, in the page-table
// row of another slot or at another place in its own. Then a backend may read those keys before the
// step's own cache writes are done (the GPU's attention kernel does, under programmatic dependent
// launch). The cost is the step's tokens and the pages its sequences hold below their positions, not
// the whole table, and no allocation once `scratch` has held a step as large. A step that fails
// check_step_fits_cache may give either answer.
struct EarlierKeysScratch {
  std::vector<int32_t> page_writer;               // a page each, all -1 between calls
  std::vector<std::pair<int32_t, int32_t>> seqs;  // the step's (slot, position) pairs
  explicit EarlierKeysScratch(int num_pages = 0) : page_writer(size_t(std::max(num_pages, 0)), -1) {}
};
bool step_keeps_earlier_keys(const StepTokens& step, const CacheShape& cache, EarlierKeysScratch& scratch);

class Ops {
 public:
  virtual ~Ops() = default;

  // Activations in the backend's activation dtype (fp32 on the CPU); they live until the next
  // begin_step, and the backend owns them.
  virtual Tensor alloc(int64_t rows, int64_t cols) = 0;
  // The same for an explicit dtype (slot ids are int32, slot weights fp32 on every backend).
  virtual Tensor alloc_typed(int64_t rows, int64_t cols, DType dtype) = 0;
  // Activations allocated after mark() are released by release(mark): the forward frees each
  // layer's temporaries, so a step needs one layer's worth of scratch, not num_layers'.
  virtual size_t mark() = 0;
  virtual void release(size_t mark) = 0;
  // Runs `body` (the launches of one step, already made current by begin_step). A backend that can
  // record a step (CUDA graphs) records it the first time a `key` is seen and replays it after;
  // the body must then allocate the same way every time (it does: allocation follows shapes only).
  // Keys are the caller's: the engine records a padded decode batch's forward under its bucket size
  // and, with the batch's greedy ids after it, under minus that size.
  virtual Tensor run_step(int key, const std::function<Tensor()>& body) { return body(); }
  // True when run_step records: the engine then pads decode batches to a few bucket sizes so a
  // handful of recordings serve every batch.
  virtual bool records_steps() const { return false; }
  // Kernel launches the last run_step replayed (0 where steps are not recorded).
  virtual int last_step_launches() const { return 0; }
  // Allocates the KV cache; called once before the first step.
  virtual void init_cache(const CacheShape& shape) = 0;
  // Makes `step` the current step (the CPU keeps a pointer, CUDA uploads ids/positions/slots and
  // the page table). Checks that every token's (slot, position) has a page in the pool.
  virtual void begin_step(const StepTokens& step) = 0;

  // out[T, H] = table[token_ids[t]]
  virtual void embed(Tensor table, Tensor out) = 0;
  // out = gemma_rmsnorm(x) * (1 + w); rows of length w.dim(0).
  virtual void rmsnorm(Tensor x, Tensor weight, float eps, Tensor out) = 0;
  // residual += partial; out = gemma_rmsnorm(residual) * (1 + w): the tp-1 / already-reduced form.
  virtual void add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor out) = 0;
  // add_rmsnorm(partial, residual, weight, eps, out) and then linears(out, items), as one call, so
  // that a backend may run the norm inside its projection kernel (the GPU does for a decode batch
  // when its GEMV takes the projections and every block reading the rows costs less than a launch:
  // gemv.cuh). The same results, out and the new residual included. The new residual (residual +
  // partial) goes into `residual` in place or into `spare`, a buffer of its shape and type, leaving
  // `residual` as it was: the backend chooses (a kernel whose every block reads the residual rows
  // would otherwise have to wait for all of them before one may write), and returns the one that
  // holds it.
  virtual Tensor add_rmsnorm_linears(Tensor partial, Tensor residual, Tensor spare, Tensor weight, float eps,
                                     Tensor out, std::span<const Projection> items) {
    (void)spare;
    add_rmsnorm(partial, residual, weight, eps, out);
    linears(out, items);
    return residual;
  }
  // y += x
  virtual void add(Tensor x, Tensor y) = 0;
  // out[T, N] = x[T, K] w[N, K]^T
  virtual void linear(Tensor x, Tensor weight, Tensor out) = 0;
  // linear(x, weight, out) for each item, all of one input (a layer's q, k, v and indexer
  // projections): a backend may run them as one launch, with the same result.
  virtual void linears(Tensor x, std::span<const Projection> items) {
    for (const Projection& p : items) linear(x, p.weight, p.out);
  }
  // In place on each x[T, heads * head_dim]: per-head Gemma norm with weight[head_dim], then NeoX
  // RoPE on the first rotary_dim channels at the step's positions. Several tensors in one call (a
  // layer's q, k and the indexer's q, k): a backend may do them in one launch.
  virtual void head_norm_rope(std::span<const HeadNormRope> items) = 0;
  // Writes k, v (and index_k) of the step into the cache, then out[T, nq*hd] = causal GQA attention
  // of q over the cached keys; on sparse layers (index_q non-empty) only over the blocks the
  // lightning indexer keeps for each query's KV group.
  virtual void attention(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k, const AttentionParams& p,
                         Tensor out) = 0;
  // head_norm_rope(rotate) and then attention(q, k, v, index_q, index_k, p, out), as one call, so that
  // a backend may store the normed, rotated keys into the cache from its norm + RoPE kernel (the GPU
  // does: no cache-write launch of its own). `rotate` normalises q, k and (sparse layers) index_q and
  // index_k in place, as the layer's forward lists them; v is not rotated. The same results, the
  // rotated tensors and the cache included.
  virtual void rotate_and_attend(std::span<const HeadNormRope> rotate, Tensor q, Tensor k, Tensor v, Tensor index_q,
                                 Tensor index_k, const AttentionParams& p, Tensor out) {
    head_norm_rope(rotate);
    attention(q, k, v, index_q, index_k, p, out);
  }
  // gate_up[T, 2n] (gate half, then up half) -> out[T, n]: SwiGLU-OAI.
  virtual void swiglu(Tensor gate_up, const SwigluParams& p, Tensor out) = 0;
  // logits[T, E] -> slot_ids[T, k+n] (int32), slot_weights[T, k+n] (fp32): sigmoid scores, top-k
  // of score + bias, weights renormalised over the k; shared ids E..E+n-1 appended with shared_weight.
  virtual void route(Tensor router_logits, Tensor bias, const RouterParams& p, Tensor slot_ids,
                     Tensor slot_weights) = 0;
  // out[T, H] = scale * sum_s slot_weights[t, s] * expert_{slot_ids[t, s]}(x[t]) with SwiGLU-OAI experts
  // gate_up[R, 2I, H], down[R, H, I]; R is the physical row count (routed + fused shared rows).
  virtual void moe_experts(Tensor x, Tensor slot_ids, Tensor slot_weights, Tensor gate_up, Tensor down,
                           const SwigluParams& p, float scale, Tensor out) = 0;
  // route(r...) and then moe_experts on the slots it chose, as one call, so that a backend may route
  // inside its expert kernels (the GPU does for a single token): the same results, slots included.
  virtual void route_experts(Tensor x, const Routing& r, Tensor gate_up, Tensor down, const SwigluParams& p,
                             float scale, Tensor out) {
    route(r.logits, r.bias, r.params, r.slot_ids, r.slot_weights);
    moe_experts(x, r.slot_ids, r.slot_weights, gate_up, down, p, scale, out);
  }
  // out[R, H] = x[rows[r]] for the step's logit_rows.
  virtual void gather_logit_rows(Tensor x, Tensor out) = 0;
  // ids[R] (int32) = argmax of each row of logits[R, V] (the first maximum, as torch.argmax); when
  // `values` is given, values[R] (fp32) = that maximum (for a distributed argmax over vocab slices).
  virtual void argmax(Tensor logits, Tensor ids, Tensor values) = 0;
  // Routing statistics, for a benchmark's bandwidth floor: once enabled, route() marks the routed
  // experts that the step's real (non-padding) tokens chose, per layer; take_routed_experts()
  // returns how many distinct ones each layer chose since the last call, and clears the marks
  // (waits for the backend: not inside a captured step).
  virtual void enable_routing_stats(int num_layers, int num_experts) = 0;
  virtual std::vector<int> take_routed_experts() = 0;

  // ids[R] (int32) = the token each row of logits[R, V] (fp32) draws under batch.rows[r] (R rows);
  // greedy rows give the argmax of their penalised logits (the first maximum, NaN first, as
  // torch.argmax). The logits are not modified. Same inputs -> the same ids on every backend.
  virtual void sample(Tensor logits, const SampleBatch& batch, Tensor ids) = 0;
  // dst[:, col_offset : col_offset + src.cols] = src (fp32 rows): the vocabulary slices of a
  // vocab-parallel lm_head laid side by side.
  virtual void copy_columns(Tensor src, Tensor dst, int64_t col_offset) = 0;
  // dst[i] = ids[i] (int32), from the host.
  virtual void upload_ids(const std::vector<int32_t>& ids, Tensor dst) = 0;
  // The greedy ids of a vocab-parallel step from every rank's winners, gathered as [rank][ids R |
  // value bits R] (int32; a rank's ids are local to its slice of slice_size): ids[r] = the winner
  // of the rank with the largest value, NaN first, ties to the lower rank (the lower vocabulary
  // index), so what one argmax over the whole row gives.
  virtual void combine_vocab_argmax(Tensor gathered, int64_t slice_size, Tensor ids) = 0;

  // Decode steps that overlap the host: keep_ids(ids) keeps a step's drawn ids[R] (int32) where the
  // next begin_step finds them (its token t, where kFedBackId, takes ids[t]) and starts their
  // copy to the host; take_kept_ids() waits for the oldest kept ids not yet taken and returns them.
  // At most two may be kept and not taken (the step running and the one queued behind it).
  virtual void keep_ids(Tensor ids) = 0;
  virtual std::vector<int32_t> take_kept_ids() = 0;

  // Host copies (these wait for the backend: not inside a captured step).
  virtual std::vector<float> to_host(Tensor t) = 0;
  virtual std::vector<int32_t> ids_to_host(Tensor ids) = 0;
};

}  // namespace tpmoe
