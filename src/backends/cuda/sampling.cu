// Sampling kernels: each row of logits[rows, V] (fp32) -> one int32 token, on the device.
//
// Three launches, no sort, no host round trip:
//   1 chunk_best  grid (chunks of 4096 logits, rows), 256 threads: each logit's score (penalties
//                 from the row's sorted entry list, mapped into shared memory per chunk, then
//                 / temperature) and the chunk's argmax. Reads R*V*4 bytes.
//   2 collect     same grid: the row's maximum m from the chunk winners, then the candidates
//                 (score - m >= kCandidateCut; nothing else can win the Gumbel race) appended to
//                 the row's list with their Gumbel-perturbed score and exp(score - m), one atomic
//                 per block. Reads R*V*4 again (from L2), writes 16 bytes per candidate; the
//                 Philox/log/exp work is spread over the whole grid here. Greedy rows skip it.
//   3 draw        one block of 1024 threads per row, over its n candidates only: top-k and top-p
//                 thresholds by radix selection on the scores' order keys (3 digit levels of 11, 11
//                 and 10 bits; a level builds a shared histogram, counts for top-k and 64-bit
//                 fixed-point exp weights for top-p, warp-aggregated with __match_any_sync, and a
//                 block suffix scan finds the digit where the mass from the top reaches the
//                 target), a sum pass for top-p's total, then the argmax of the perturbed scores
//                 over the kept candidates. Greedy rows and rows without a finite maximum write the
//                 argmax and stop.
// Passes of kernel 3 over the candidates: 1 (temperature only), +3 (top-k), +4 (top-p); each
// reads 16 bytes per candidate from L2. Expected at V = 200064 on an H200 (to be confirmed by
// test_cuda_sampling's timing table): kernels 1-2 a few us each for a decode batch (latency
// bound); kernel 3 a few us for an LM-like row (hundreds to a few thousand candidates), ~10 us per
// pass for a flat row where all 200064 tokens are candidates, so up to ~100 us for top-k + top-p
// on such rows (one SM per row: a thread-block cluster per row would be the next step). The
// result is bitwise the CPU op's: every value comes from sampling_math.h, the thresholds are order
// keys and exact integer sums, the argmax order is total.
#include "backends/cuda/sampling.cuh"

#include <cstdint>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_utils.cuh"

namespace tpmoe::cuda {

using namespace sampling;

namespace {

constexpr int kChunk = 4096;
constexpr int kChunkThreads = 256;
constexpr int kPerThread = kChunk / kChunkThreads;
constexpr int kDrawThreads = 1024;
constexpr int kRadixBins = 2048;  // the widest digit (11 bits)
constexpr unsigned kFull = 0xffffffffu;

struct Best {
  float value;
  int32_t index;
};

// Everything the draw needs about a candidate, computed by the many blocks of kernel 2 so the one
// block per row of kernel 3 only compares and counts.
struct Candidate {
  int32_t index;
  float score;      // penalised / temperature
  float perturbed;  // score + Gumbel noise
  float e;          // exp(score - max): the top-p weight is floor(e * 2^32)
};

struct Workspace {
  Best* chunk_best;     // [rows][chunks]
  int32_t* cand_count;  // [rows]
  Candidate* cand;      // [rows][vocab]: the row's first cand_count[row] entries
};

int num_chunks(int vocab) { return (vocab + kChunk - 1) / kChunk; }
size_t align256(size_t n) { return (n + 255) / 256 * 256; }

Workspace carve(void* base, int rows, int vocab) {
  std::byte* p = static_cast<std::byte*>(base);
  Workspace w;
  w.chunk_best = reinterpret_cast<Best*>(p);
  p += align256(sizeof(Best) * size_t(rows) * num_chunks(vocab));
  w.cand_count = reinterpret_cast<int32_t*>(p);
  p += align256(sizeof(int32_t) * size_t(rows));
  w.cand = reinterpret_cast<Candidate*>(p);
  return w;
}

__device__ __forceinline__ Best empty_best() { return Best{neg_inf(), INT32_MAX}; }

__device__ __forceinline__ void consider(Best& b, float v, int32_t i) {
  if (better(v, i, b.value, b.index)) b = Best{v, i};
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const float v = __shfl_xor_sync(kFull, b.value, off);
    const int32_t i = __shfl_xor_sync(kFull, b.index, off);
    consider(b, v, i);
  }
  return b;
}

// The block's best under `better` (a total order, so any tree gives the same); every thread gets it.
__device__ Best block_best(Best b) {
  __shared__ Best warp_results[kMaxBlockThreads / kWarp];
  __shared__ Best result;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  b = warp_best(b);
  if (lane == 0) warp_results[warp] = b;
  __syncthreads();
  if (warp == 0) {
    b = lane < int(blockDim.x / kWarp) ? warp_results[lane] : empty_best();
    b = warp_best(b);
    if (lane == 0) result = b;
  }
  __syncthreads();
  return result;
}

// Sum over the block of a 64-bit integer; every thread gets it.
__device__ unsigned long long block_sum_u64(unsigned long long v) {
  __shared__ unsigned long long warp_totals[kMaxBlockThreads / kWarp];
  __shared__ unsigned long long total;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long t = 0;
    for (int w = 0; w < int(blockDim.x / kWarp); ++w) t += warp_totals[w];
    total = t;
  }
  __syncthreads();
  return total;
}

// For each thread, the sum of v over the threads with a larger index.
__device__ unsigned long long block_suffix_exclusive(unsigned long long v) {
  __shared__ unsigned long long warp_totals[kMaxBlockThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  unsigned long long incl = v;  // v over lanes >= lane of this warp
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const unsigned long long t = __shfl_down_sync(kFull, incl, off);
    if (lane + off < kWarp) incl += t;
  }
  if (lane == 0) warp_totals[warp] = incl;
  __syncthreads();
  unsigned long long higher = 0;
  for (int w = warp + 1; w < int(blockDim.x / kWarp); ++w) higher += warp_totals[w];
  __syncthreads();
  return incl - v + higher;
}

__device__ __forceinline__ int lower_bound(const int32_t* ids, int begin, int end, int value) {
  while (begin < end) {
    const int mid = (begin + end) / 2;
    if (ids[mid] < value)
      begin = mid + 1;
    else
      end = mid;
  }
  return begin;
}

// The chunk's tokens that have penalty entries: entry_of[token - c0] = entry - first, or -1.
// Returns false (block-uniformly) when the chunk has none, which is the common case.
__device__ bool map_chunk_penalties(const SampleKernelParams& p, const SampleRowArgs& a, int c0, int c1,
                                    int16_t* entry_of, int& first) {
  if (a.penalty_begin == a.penalty_end) return false;
  const int lo = lower_bound(p.penalty_ids, a.penalty_begin, a.penalty_end, c0);
  const int hi = lower_bound(p.penalty_ids, lo, a.penalty_end, c1);
  if (lo == hi) return false;
  for (int j = threadIdx.x; j < kChunk; j += blockDim.x) entry_of[j] = -1;
  __syncthreads();
  for (int e = lo + threadIdx.x; e < hi; e += blockDim.x) entry_of[p.penalty_ids[e] - c0] = int16_t(e - lo);
  __syncthreads();
  first = lo;
  return true;
}

__device__ __forceinline__ float element_score(const SampleKernelParams& p, const SampleRowArgs& a, const float* row,
                                               int i, int c0, bool has_penalties, const int16_t* entry_of, int first) {
  int32_t count = -1;
  if (has_penalties) {
    const int e = entry_of[i - c0];
    if (e >= 0) count = p.penalty_counts[first + e];
  }
  return row_score(row[i], count, a);
}

// The row's best score over its chunk winners (every thread gets it).
__device__ Best row_best(const Workspace& w, int row, int chunks) {
  Best b = empty_best();
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const Best x = w.chunk_best[int64_t(row) * chunks + c];
    consider(b, x.value, x.index);
  }
  return block_best(b);
}

__device__ __forceinline__ bool finite(float x) { return x > neg_inf() && x < -neg_inf(); }

// ---- kernel 1: scores and chunk winners ---------------------------------------------------------

__global__ void __launch_bounds__(kChunkThreads) chunk_best_kernel(SampleKernelParams p, Workspace w) {
  __shared__ int16_t entry_of[kChunk];
  const int r = blockIdx.y, c = blockIdx.x, chunks = gridDim.x;
  const int c0 = c * kChunk, c1 = min(c0 + kChunk, p.vocab);
  const SampleRowArgs a = p.row_args[r];
  int first = 0;
  const bool has_penalties = map_chunk_penalties(p, a, c0, c1, entry_of, first);
  const float* row = p.logits + int64_t(r) * p.vocab;
  Best b = empty_best();
  for (int i = c0 + threadIdx.x; i < c1; i += kChunkThreads)
    consider(b, element_score(p, a, row, i, c0, has_penalties, entry_of, first), i);
  b = block_best(b);
  if (threadIdx.x == 0) {
    w.chunk_best[int64_t(r) * chunks + c] = b;
    if (c == 0) w.cand_count[r] = 0;
  }
}

// ---- kernel 2: candidates -----------------------------------------------------------------------

__global__ void __launch_bounds__(kChunkThreads) collect_kernel(SampleKernelParams p, Workspace w) {
  __shared__ int16_t entry_of[kChunk];
  __shared__ int warp_offsets[kChunkThreads / kWarp];
  __shared__ int block_base;
  const int r = blockIdx.y, c = blockIdx.x, chunks = gridDim.x;
  const SampleRowArgs a = p.row_args[r];
  if (a.greedy) return;
  const float m = row_best(w, r, chunks).value;
  if (!finite(m)) return;
  const int c0 = c * kChunk, c1 = min(c0 + kChunk, p.vocab);
  int first = 0;
  const bool has_penalties = map_chunk_penalties(p, a, c0, c1, entry_of, first);
  const float* row = p.logits + int64_t(r) * p.vocab;

  float s[kPerThread];
  unsigned mask = 0;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = c0 + threadIdx.x + k * kChunkThreads;
    s[k] = 0.f;
    if (i < c1) {
      s[k] = element_score(p, a, row, i, c0, has_penalties, entry_of, first);
      if (sub_rn(s[k], m) >= kCandidateCut) mask |= 1u << k;
    }
  }
  // Block-wide exclusive scan of the per-thread counts, one atomic for the block's slots.
  const int n = __popc(mask), lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int incl = n;
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const int t = __shfl_up_sync(kFull, incl, off);
    if (lane >= off) incl += t;
  }
  if (lane == kWarp - 1) warp_offsets[warp] = incl;
  __syncthreads();
  Candidate* out = w.cand + int64_t(r) * p.vocab;
  if (threadIdx.x == 0) {
    int total = 0;
    for (int v = 0; v < kChunkThreads / kWarp; ++v) {
      const int t = warp_offsets[v];
      warp_offsets[v] = total;
      total += t;
    }
    block_base = total ? atomicAdd(&w.cand_count[r], total) : 0;
  }
  __syncthreads();
  int pos = block_base + warp_offsets[warp] + incl - n;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    if (!(mask >> k & 1u)) continue;
    const int i = c0 + int(threadIdx.x) + k * kChunkThreads;
    out[pos++] = Candidate{i, s[k], add_rn(s[k], gumbel_noise(a, uint32_t(i))), exp_nonpositive(sub_rn(s[k], m))};
  }
}

// ---- kernel 3: thresholds and the draw ----------------------------------------------------------

struct RadixShared {
  unsigned long long hist[kRadixBins];
  unsigned long long lane_weight[kDrawThreads];
  uint32_t digit;
  unsigned long long above;
};

// The largest key t with W(key >= t) >= target over the candidates with key >= min_key, W counting
// candidates (top-k) or summing their top-p weights. Needs 0 < target <= W(key >= min_key).
// after each level: keys with the chosen prefix hold the threshold; `above` = W of larger prefixes.
template <bool kWeighted>
__device__ uint32_t radix_select(const Candidate* cand, int n, uint32_t min_key, unsigned long long target,
                                 RadixShared& sh) {
  const int lane = threadIdx.x % kWarp;
  uint32_t prefix = 0, prefix_mask = 0;
  unsigned long long above = 0;
  for (int level = 0; level < 3; ++level) {
    // Digits of 11, 11 and 10 bits: a 2048-bin histogram of 64-bit sums fits shared memory.
    const int shift = level == 0 ? 21 : level == 1 ? 10 : 0, bins = level == 2 ? 1024 : 2048;
    for (int b = threadIdx.x; b < bins; b += blockDim.x) sh.hist[b] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += blockDim.x) {  // warp-uniform trip count
      const int j = base + threadIdx.x;
      bool active = false;
      uint32_t digit = 0xffffffffu;  // no real digit: inactive lanes never join a group
      unsigned long long weight = 0;
      if (j < n) {
        const Candidate c = cand[j];
        const uint32_t key = order_key(c.score);
        if (key >= min_key && (key & prefix_mask) == prefix) {
          active = true;
          digit = (key >> shift) & uint32_t(bins - 1);
          weight = kWeighted ? weight_from_exp(c.e) : 1ull;
        }
      }
      if (__ballot_sync(kFull, active) == 0) continue;
      // Lanes with the same digit add once (a flat row puts most keys in a few top-level bins).
      const unsigned peers = __match_any_sync(kFull, digit);
      if constexpr (kWeighted) sh.lane_weight[threadIdx.x] = weight;
      __syncwarp();
      if (active && lane == __ffs(peers) - 1) {
        unsigned long long sum = 0;
        if constexpr (kWeighted) {
          const int warp_base = threadIdx.x - lane;
          for (unsigned m = peers; m; m &= m - 1) sum += sh.lane_weight[warp_base + __ffs(m) - 1];
        } else {
          sum = __popc(peers);
        }
        atomicAdd(&sh.hist[digit], sum);
      }
      __syncwarp();
    }
    __syncthreads();
    // Thread t owns bins [t * per, (t + 1) * per); the mass above its bins comes from a suffix scan.
    const int per = bins / int(blockDim.x);
    unsigned long long own = 0;
    for (int b = 0; b < per; ++b) own += sh.hist[threadIdx.x * per + b];
    unsigned long long run = above + block_suffix_exclusive(own);
    for (int b = per - 1; b >= 0; --b) {
      const int bin = threadIdx.x * per + b;
      if (run < target && run + sh.hist[bin] >= target) {
        sh.digit = uint32_t(bin);
        sh.above = run;
      }
      run += sh.hist[bin];
    }
    __syncthreads();
    prefix |= sh.digit << shift;
    prefix_mask |= uint32_t(bins - 1) << shift;
    above = sh.above;
    __syncthreads();
  }
  return prefix;
}

__global__ void __launch_bounds__(kDrawThreads) draw_kernel(SampleKernelParams p, Workspace w, int chunks) {
  __shared__ RadixShared sh;
  const int r = blockIdx.x;
  const SampleRowArgs a = p.row_args[r];
  const Best top = row_best(w, r, chunks);
  if (a.greedy || !finite(top.value)) {
    if (threadIdx.x == 0) p.ids[r] = top.index < p.vocab ? top.index : 0;
    return;
  }
  const float m = top.value;
  const int n = w.cand_count[r];
  const Candidate* cand = w.cand + int64_t(r) * p.vocab;

  uint32_t top_k_key = 0;
  if (a.top_k > 0 && a.top_k < n) top_k_key = radix_select<false>(cand, n, 0u, uint64_t(a.top_k), sh);
  uint32_t top_p_key = 0;
  if (a.top_p < 1.0f) {
    unsigned long long total = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const Candidate c = cand[j];
      if (order_key(c.score) >= top_k_key) total += weight_from_exp(c.e);
    }
    total = block_sum_u64(total);
    top_p_key = radix_select<true>(cand, n, top_k_key, top_p_target(a.top_p, total), sh);
  }
  const uint32_t threshold = max(top_k_key, top_p_key);
  Best b = empty_best();
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const Candidate c = cand[j];
    if (order_key(c.score) < threshold || !(sub_rn(c.score, m) >= a.log_min_p)) continue;
    consider(b, c.perturbed, c.index);
  }
  b = block_best(b);
  if (threadIdx.x == 0) p.ids[r] = b.index;
}

}  // namespace

size_t sample_workspace_bytes(int rows, int vocab) {
  return align256(sizeof(Best) * size_t(rows) * num_chunks(vocab)) + align256(sizeof(int32_t) * size_t(rows)) +
         sizeof(Candidate) * size_t(rows) * size_t(vocab);
}

void launch_sample(const SampleKernelParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  check_arg(p.rows > 0 && p.rows <= 65535, "sample: rows must be in [1, 65535]");
  check_arg(p.vocab > 0 && p.vocab <= (1 << 21), "sample: vocab must be in [1, 2^21]");
  check_arg(p.logits && p.row_args && p.ids && p.workspace, "sample: null pointer");
  check_arg(p.workspace_bytes >= sample_workspace_bytes(p.rows, p.vocab), "sample: workspace too small");
  const Workspace w = carve(p.workspace, p.rows, p.vocab);
  const int chunks = num_chunks(p.vocab);
  const dim3 grid(unsigned(chunks), unsigned(p.rows));
  chunk_best_kernel<<<grid, kChunkThreads, 0, stream>>>(p, w);
  CUDA_CHECK_LAUNCH();
  collect_kernel<<<grid, kChunkThreads, 0, stream>>>(p, w);
  CUDA_CHECK_LAUNCH();
  draw_kernel<<<unsigned(p.rows), kDrawThreads, 0, stream>>>(p, w, chunks);
  CUDA_CHECK_LAUNCH();
}

}  // namespace tpmoe::cuda
