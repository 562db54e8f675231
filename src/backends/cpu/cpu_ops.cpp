#include "backends/cpu/cpu_ops.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace tpmoe::cpu {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kMinParallelWork = int64_t(1) << 20;  // multiply-adds

// Row `row` of a [rows, n] weight (bf16 or fp32) widened to fp32 into `dst`.
void load_row(const Tensor& w, int64_t row, int64_t n, float* dst) {
  if (w.dtype == DType::kF32) {
    std::memcpy(dst, w.as<const float>() + row * n, size_t(n) * sizeof(float));
  } else if (w.dtype == DType::kBF16) {
    const uint16_t* src = w.as<const uint16_t>() + row * n;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  } else {
    TPMOE_FAIL("CPU backend: weights must be stored as bf16 or fp32, got {}", dtype_name(w.dtype));
  }
}

float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// out[T, N] = x[T, K] w[N, K]^T for raw pointers; one weight row is widened once and used by all
// T tokens.
void matmul_rows(const float* x, int64_t T, int64_t K, const Tensor& w, int64_t N, float* out) {
  // Threads only pay off once there is real work: a team for a 64x128 product costs more than it saves.
#pragma omp parallel if (T * N * K >= kMinParallelWork)
  {
    std::vector<float> row(static_cast<size_t>(K));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      load_row(w, n, K, row.data());
      for (int64_t t = 0; t < T; ++t) out[t * N + n] = dot(x + t * K, row.data(), K);
    }
  }
}

float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

}  // namespace

void gemma_rmsnorm_row(const float* v, const float* w, int n, float eps, float* y) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += double(v[i]) * v[i];
  const float inv = float(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) y[i] = v[i] * inv * (1.f + w[i]);
}

float swiglu_oai(float gate, float up, const SwigluParams& p) {
  gate = std::min(gate, p.limit);
  up = std::clamp(up, -p.limit, p.limit);
  return (up + 1.f) * gate * sigmoid(p.alpha * gate);
}

std::vector<int> select_blocks(const float* scores, int pos, int block_size, int topk_blocks, int local_blocks) {
  // The same block scores the decision recorder measures margins on.
  const std::vector<float> block_score = indexer_block_scores(scores, pos, block_size, local_blocks);
  const int num_blocks = int(block_score.size());
  std::vector<int> order(static_cast<size_t>(num_blocks));
  std::iota(order.begin(), order.end(), 0);
  const int keep = std::min(topk_blocks, num_blocks);
  // Highest score first, ties to the lower block index, so every backend keeps the same set.
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int a, int b) {
    return block_score[a] != block_score[b] ? block_score[a] > block_score[b] : a < b;
  });
  order.resize(size_t(keep));
  std::erase_if(order, [&](int b) { return block_score[b] == -kInf; });  // a kept -inf block is dropped
  return order;
}

Tensor CpuOps::alloc_typed(int64_t rows, int64_t cols, DType dtype) {
  const size_t bytes = size_t(rows * cols) * dtype_size(dtype);
  workspace_.push_back(std::make_unique<std::byte[]>(std::max<size_t>(bytes, 1)));
  return Tensor::make(workspace_.back().get(), dtype, rows, cols);
}

void CpuOps::init_cache(const CacheShape& shape) {
  shape.validate();
  cache_shape_ = shape;
  cache_.assign(size_t(shape.num_layers), {});
  const size_t rows = size_t(shape.num_pages) * size_t(shape.page_size);
  for (int l = 0; l < shape.num_layers; ++l) {
    cache_[l].k.assign(rows * shape.num_kv_heads * shape.head_dim, 0.f);
    cache_[l].v.assign(rows * shape.num_kv_heads * shape.head_dim, 0.f);
    if (shape.sparse_layer[l]) cache_[l].index_k.assign(rows * shape.index_head_dim, 0.f);
  }
}

void CpuOps::begin_step(const StepTokens& step) {
  workspace_.clear();
  step_ = &step;
  if (std::ranges::find(step.token_ids, StepTokens::kFedBackId) != step.token_ids.end()) {
    TPMOE_CHECK(!kept_ids_.empty(), "a step feeds back the last step's ids, but none were kept");
    const std::vector<int32_t>& fed = kept_ids_.back();
    fed_step_ = step;
    for (size_t t = 0; t < fed_step_.token_ids.size(); ++t)
      if (fed_step_.token_ids[t] == StepTokens::kFedBackId) {
        TPMOE_CHECK(t < fed.size(), "token {} of the step feeds back an id, but the last step kept {}", t, fed.size());
        fed_step_.token_ids[t] = fed[t];
      }
    step_ = &fed_step_;
  }
  if (recorder_) recorder_->begin_step(*step_);
  check_step_fits_cache(*step_, cache_shape_);
}

void CpuOps::embed(Tensor table, Tensor out) {
  const int64_t H = table.dim(1), V = table.dim(0);
  for (int t = 0; t < step_->num_tokens(); ++t) {
    const int32_t id = step_->token_ids[t];
    TPMOE_CHECK(id >= 0 && id < V, "token id {} is outside the vocabulary (size {})", id, V);
    load_row(table, id, H, out.as<float>() + t * H);
  }
}

void CpuOps::rmsnorm(Tensor x, Tensor weight, float eps, Tensor out) {
  const int n = int(weight.dim(0));
  const int64_t rows = x.numel() / n;
#pragma omp parallel for if (rows * n >= kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r)
    gemma_rmsnorm_row(x.as<float>() + r * n, weight.as<float>(), n, eps, out.as<float>() + r * n);
}

void CpuOps::add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor out) {
  add(partial, residual);
  rmsnorm(residual, weight, eps, out);
}

void CpuOps::add(Tensor x, Tensor y) {
  const float* a = x.as<float>();
  float* b = y.as<float>();
  for (int64_t i = 0; i < y.numel(); ++i) b[i] += a[i];
}

void CpuOps::linear(Tensor x, Tensor weight, Tensor out) {
  matmul_rows(x.as<float>(), x.dim(0), x.dim(1), weight, weight.dim(0), out.as<float>());
}

void CpuOps::head_norm_rope(std::span<const HeadNormRope> items) {
  for (const HeadNormRope& item : items) head_norm_rope_one(item.x, item.num_heads, item.weight, item.rope);
}

void CpuOps::head_norm_rope_one(Tensor x, int num_heads, Tensor weight, const RopeParams& p) {
  const int hd = p.head_dim, half = p.rotary_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) inv_freq[i] = float(std::pow(double(p.theta), -2.0 * i / p.rotary_dim));
  const int T = int(x.dim(0));
#pragma omp parallel for if (int64_t(T) * num_heads * hd * 16 >= kMinParallelWork)
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < num_heads; ++h) {
      float* v = x.as<float>() + (int64_t(t) * num_heads + h) * hd;
      gemma_rmsnorm_row(v, weight.as<float>(), hd, p.eps, v);
      for (int i = 0; i < half; ++i) {
        const float angle = float(step_->positions[t]) * inv_freq[i];
        const float c = std::cos(angle), s = std::sin(angle);
        const float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
    }
  }
}

void CpuOps::attention(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k, const AttentionParams& p,
                       Tensor out) {
  LayerCache& cache = cache_[p.layer];
  const int T = step_->num_tokens(), hd = p.head_dim, nkv = p.num_kv_heads;
  const bool sparse = !index_q.empty();
  // Rows of the paged pool (begin_step checked every token's page).
  auto row = [&](int slot, int pos) { return size_t(cache_shape_.row(step_->page_table, slot, pos)); };
  auto kv_offset = [&](int slot, int pos) { return row(slot, pos) * nkv * hd; };
  // Every key of the step is written before any query reads, so prefill tokens see each other.
  for (int t = 0; t < T; ++t) {
    const int slot = step_->seq_slots[t], pos = step_->positions[t];
    std::memcpy(&cache.k[kv_offset(slot, pos)], k.as<float>() + size_t(t) * nkv * hd, sizeof(float) * nkv * hd);
    std::memcpy(&cache.v[kv_offset(slot, pos)], v.as<float>() + size_t(t) * nkv * hd, sizeof(float) * nkv * hd);
    if (sparse)
      std::memcpy(&cache.index_k[row(slot, pos) * p.index_head_dim], index_k.as<float>() + size_t(t) * p.index_head_dim,
                  sizeof(float) * p.index_head_dim);
  }
  const int group = p.num_q_heads / nkv;
  int64_t work = 0;  // query x key pairs
  for (int t = 0; t < T; ++t) work += int64_t(step_->positions[t] + 1) * p.num_q_heads * hd;
#pragma omp parallel for schedule(dynamic) if (work >= kMinParallelWork)
  for (int t = 0; t < T; ++t) {
    const int slot = step_->seq_slots[t], pos = step_->positions[t];
    std::vector<float> scores(size_t(pos) + 1);
    std::vector<char> visible(size_t(pos) + 1, 1);
    for (int g = 0; g < nkv; ++g) {
      if (sparse) {  // the lightning indexer picks the key blocks this KV group may read
        const float* iq = index_q.as<float>() + (size_t(t) * p.num_index_heads + g) * p.index_head_dim;
        for (int s = 0; s <= pos; ++s)
          scores[s] = dot(iq, &cache.index_k[row(slot, s) * p.index_head_dim], p.index_head_dim);
        std::fill(visible.begin(), visible.end(), 0);
        for (int b : select_blocks(scores.data(), pos, p.block_size, p.topk_blocks, p.local_blocks))
          for (int s = b * p.block_size; s < std::min(pos + 1, (b + 1) * p.block_size); ++s) visible[s] = 1;
        if (recorder_) {
          const auto blocks = indexer_block_scores(scores.data(), pos, p.block_size, p.local_blocks);
          if (const auto boundary = indexer_block_boundary(blocks, p.topk_blocks))
            recorder_->record(t, {DecisionKind::kIndexerBlocks, p.layer, g, *boundary});
        }
      }
      for (int j = g * group; j < (g + 1) * group; ++j) {
        const float* qv = q.as<float>() + (size_t(t) * p.num_q_heads + j) * hd;
        float max_logit = -kInf;
        for (int s = 0; s <= pos; ++s) {
          scores[s] = visible[s] ? dot(qv, &cache.k[kv_offset(slot, s) + size_t(g) * hd], hd) * p.scale : -kInf;
          max_logit = std::max(max_logit, scores[s]);
        }
        float* o = out.as<float>() + (size_t(t) * p.num_q_heads + j) * hd;
        std::fill(o, o + hd, 0.f);
        double denom = 0;
        for (int s = 0; s <= pos; ++s) {
          if (!visible[s]) continue;
          const float w = std::exp(scores[s] - max_logit);
          denom += w;
          const float* vv = &cache.v[kv_offset(slot, s) + size_t(g) * hd];
          for (int d = 0; d < hd; ++d) o[d] += w * vv[d];
        }
        for (int d = 0; d < hd; ++d) o[d] = float(o[d] / denom);
      }
    }
  }
}

void CpuOps::swiglu(Tensor gate_up, const SwigluParams& p, Tensor out) {
  const int64_t T = gate_up.dim(0), n = out.dim(1);
  for (int64_t t = 0; t < T; ++t) {
    const float* gu = gate_up.as<float>() + t * 2 * n;
    for (int64_t i = 0; i < n; ++i) out.as<float>()[t * n + i] = swiglu_oai(gu[i], gu[n + i], p);
  }
}

void CpuOps::route(Tensor router_logits, Tensor bias, const RouterParams& p, Tensor slot_ids, Tensor slot_weights) {
  const int T = int(router_logits.dim(0)), E = p.num_experts, k = p.top_k, slots = k + p.num_shared_slots;
  std::vector<float> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  std::vector<int> order(static_cast<size_t>(E));
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) {
      score[e] = sigmoid(router_logits.as<float>()[size_t(t) * E + e]);
      // The bias only chooses. A NaN choice (a NaN logit or bias) ranks as -inf: below every number,
      // tied with -inf (to the lower id), so the order below is a strict one and every id is an
      // expert's. Its score stays NaN and so do the token's weights.
      const float c = score[e] + bias.as<float>()[e];
      choice[e] = std::isnan(c) ? -std::numeric_limits<float>::infinity() : c;
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int a, int b) { return choice[a] != choice[b] ? choice[a] > choice[b] : a < b; });
    if (recorder_)
      if (const auto boundary = top_k_boundary(choice, k))
        recorder_->record(t, {DecisionKind::kRouterTopK, p.layer, -1, *boundary});
    float sum = 0;
    for (int i = 0; i < k; ++i) sum += score[order[i]];
    int32_t* ids = slot_ids.as<int32_t>() + size_t(t) * slots;
    float* w = slot_weights.as<float>() + size_t(t) * slots;
    for (int i = 0; i < k; ++i) {
      ids[i] = order[i];
      w[i] = score[order[i]] / sum;
    }
    for (int i = 0; i < p.num_shared_slots; ++i) {
      ids[k + i] = E + i;
      w[k + i] = p.shared_weight;
    }
    if (!routed_.empty() && t < T - step_->num_padding)
      for (int i = 0; i < k; ++i) routed_[size_t(p.layer) * routed_experts_ + size_t(ids[i])] = 1;
  }
}

void CpuOps::enable_routing_stats(int num_layers, int num_experts) {
  routed_experts_ = num_experts;
  routed_.assign(size_t(num_layers) * size_t(num_experts), 0);
}

std::vector<int> CpuOps::take_routed_experts() {
  std::vector<int> counts;
  for (size_t l = 0; routed_experts_ > 0 && l < routed_.size() / size_t(routed_experts_); ++l) {
    counts.push_back(int(
        std::count(routed_.begin() + l * routed_experts_, routed_.begin() + (l + 1) * routed_experts_, uint8_t(1))));
  }
  std::fill(routed_.begin(), routed_.end(), 0);
  return counts;
}

void CpuOps::moe_experts(Tensor x, Tensor slot_ids, Tensor slot_weights, Tensor gate_up, Tensor down,
                         const SwigluParams& p, float scale, Tensor out) {
  const int64_t T = x.dim(0), H = x.dim(1), slots = slot_ids.dim(1);
  const int64_t R = gate_up.dim(0), I = down.dim(2);
  // Bin (token, slot) pairs by physical expert row, as a grouped GEMM would. The bins are sized by
  // the weights' row count R (routed + fused shared rows): an id outside it is a routing bug.
  std::vector<std::vector<int64_t>> bins(static_cast<size_t>(R));
  for (int64_t ts = 0; ts < T * slots; ++ts) {
    const int32_t e = slot_ids.as<int32_t>()[ts];
    TPMOE_CHECK(e >= 0 && e < R, "MoE: slot {} of token {} routes to expert row {}, but there are {} rows", ts % slots,
                ts / slots, e, R);
    bins[e].push_back(ts);
  }
  // Each (token, slot) output is computed once, then combined in slot order so the sum does not
  // depend on how experts were scheduled.
  std::vector<float> slot_out(size_t(T * slots * H), 0.f);
#pragma omp parallel for schedule(dynamic) if (T * slots * 3 * I * H >= kMinParallelWork)
  for (int64_t e = 0; e < R; ++e) {
    if (bins[e].empty()) continue;
    const int64_t n = int64_t(bins[e].size());
    std::vector<float> xs(static_cast<size_t>(n * H)), gu(size_t(n * 2 * I)), act(size_t(n * I));
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(&xs[i * H], x.as<float>() + (bins[e][i] / slots) * H, sizeof(float) * H);
    Tensor w_gu = Tensor::make(static_cast<std::byte*>(gate_up.data) + e * 2 * I * H * dtype_size(gate_up.dtype),
                               gate_up.dtype, 2 * I, H);
    Tensor w_down =
        Tensor::make(static_cast<std::byte*>(down.data) + e * H * I * dtype_size(down.dtype), down.dtype, H, I);
    matmul_rows(xs.data(), n, H, w_gu, 2 * I, gu.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < I; ++j) act[i * I + j] = swiglu_oai(gu[i * 2 * I + j], gu[i * 2 * I + I + j], p);
    std::vector<float> y(static_cast<size_t>(n * H));
    matmul_rows(act.data(), n, I, w_down, H, y.data());
    for (int64_t i = 0; i < n; ++i) std::memcpy(&slot_out[bins[e][i] * H], &y[i * H], sizeof(float) * H);
  }
  for (int64_t t = 0; t < T; ++t) {
    float* o = out.as<float>() + t * H;
    std::fill(o, o + H, 0.f);
    for (int64_t s = 0; s < slots; ++s) {
      const float w = slot_weights.as<float>()[t * slots + s];
      const float* y = &slot_out[(t * slots + s) * H];
      for (int64_t h = 0; h < H; ++h) o[h] += w * y[h];
    }
    for (int64_t h = 0; h < H; ++h) o[h] *= scale;
  }
}

void CpuOps::gather_logit_rows(Tensor x, Tensor out) {
  const int64_t H = x.dim(1);
  for (size_t r = 0; r < step_->logit_rows.size(); ++r)
    std::memcpy(out.as<float>() + r * H, x.as<float>() + step_->logit_rows[r] * H, sizeof(float) * H);
}

void CpuOps::argmax(Tensor logits, Tensor ids, Tensor values) {
  const int64_t R = logits.dim(0), V = logits.dim(1);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = logits.as<float>() + r * V;
    const float* best = std::max_element(row, row + V);
    ids.as<int32_t>()[r] = int32_t(best - row);
    if (!values.empty()) values.as<float>()[r] = *best;
  }
}

void CpuOps::copy_columns(Tensor src, Tensor dst, int64_t col_offset) {
  const int64_t R = src.dim(0), C = src.dim(1), W = dst.dim(1);
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(dst.as<float>() + r * W + col_offset, src.as<float>() + r * C, sizeof(float) * size_t(C));
}

void CpuOps::upload_ids(const std::vector<int32_t>& ids, Tensor dst) {
  std::memcpy(dst.data, ids.data(), sizeof(int32_t) * ids.size());
}

void CpuOps::combine_vocab_argmax(Tensor gathered, int64_t slice_size, Tensor ids) {
  const int64_t R = ids.numel(), tp = gathered.numel() / (2 * R);
  const int32_t* all = gathered.as<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    auto value = [&](int64_t q) { return std::bit_cast<float>(all[(2 * q + 1) * R + r]); };
    int64_t best = 0;
    for (int64_t q = 1; q < tp; ++q)
      if (!std::isnan(value(best)) && (std::isnan(value(q)) || value(q) > value(best))) best = q;
    ids.as<int32_t>()[r] = int32_t(best * slice_size + all[2 * best * R + r]);
  }
}

void CpuOps::keep_ids(Tensor ids) {
  TPMOE_CHECK(kept_ids_.size() < 2, "keep_ids: two steps' ids kept and not taken");
  kept_ids_.emplace_back(ids.as<int32_t>(), ids.as<int32_t>() + ids.numel());
}

std::vector<int32_t> CpuOps::take_kept_ids() {
  TPMOE_CHECK(!kept_ids_.empty(), "take_kept_ids: no ids kept");
  std::vector<int32_t> ids = std::move(kept_ids_.front());
  kept_ids_.pop_front();
  return ids;
}

std::vector<int32_t> CpuOps::ids_to_host(Tensor ids) { return {ids.as<int32_t>(), ids.as<int32_t>() + ids.numel()}; }

std::vector<float> CpuOps::to_host(Tensor t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::kF32)
    std::memcpy(v.data(), t.data, t.nbytes());
  else
    load_row(t, 0, t.numel(), v.data());
  return v;
}

}  // namespace tpmoe::cpu
