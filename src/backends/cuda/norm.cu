// Gemma RMSNorm kernels (SPEC §1.2): y = v / sqrt(mean(v^2) + eps) * (1 + w), fp32 math.
//
// add_rmsnorm: one block per row. residual[T,H] (fp32) += partial[T,H] (bf16, optional), then
//   out[T,H] (bf16) = norm(residual). Pass 1 adds, writes the residual back and sums squares in
//   fp32 (warp shuffles, then one float per warp through shared memory); pass 2 re-reads the row it
//   just wrote (each thread reads back only the elements it wrote itself, so no barrier is needed
//   for the data; the row is hot in L1/L2) and writes bf16. 16-byte vectors (8 elements per step)
//   when H % 8 == 0 and every pointer is 16-byte aligned, a scalar loop otherwise, so any H works.
//   Bytes from DRAM: T*H*(2 read partial + 4 read + 4 write residual + 2 write out) + H*4 weight.
// head_norm_rope: one warp per (token, head), in place on x[T, heads*hd] (bf16), hd <= 256.
//   Per-head Gemma norm (weight [hd], fp32; sum of squares by warp shuffle), then NeoX RoPE on the
//   first rotary_dim channels: lane l owns the rotary pairs (i, i + rd/2) for i = l + 32k and the
//   pass-through channels rd + l + 32k, all in registers; every element belongs to exactly one lane,
//   so reading and writing in place never races. inv_freq[i] = float(pow(double(theta), -2i/rd)) as
//   the CPU oracle computes it, once per block into shared memory; cos/sin by sincosf (full-range accurate, not __sinf:
//   angles reach pos * 1 rad, far outside the fast intrinsics' range). Bytes: 2 x T*heads*hd*2.
//   Before the PDL wait (step inputs and weights only: kernel_utils.cuh) a warp computes its cos /
//   sin and loads its norm weights, so that only x's loads, the norm and the stores follow the wait.
//   Cache store (items with `cache`/`copy`, CudaOps::rotate_and_attend): the warp looks up its
//   token's pool row (seq_slots, page table: kv_cache.cuh) before the wait, writes each bf16 result
//   to the cache row as well as back to x (the same value, so the cache holds what x holds), and
//   copies the head of `copy` (v) to its cache row with one 16-byte access per lane (hd <= 256: at
//   most 32 vectors). This replaces attention's cache-write launch; as a launch before attention's,
//   every key of the step is still in the cache before any query reads. Bytes added: T*heads*hd*2
//   written per stored item, T*heads*hd*2*2 per copy.
// Layouts: row-major, rows contiguous. Grids depend only on the sizes (graph-capturable); no sync,
// no allocation. Both launch with PDL (kernel_utils.cuh).
#include "backends/cuda/norm.cuh"

#include "backends/cuda/kernel_utils.cuh"
#include "backends/cuda/norm_math.cuh"

#include <algorithm>
#include <cstdint>

#include "backends/cuda/cuda_check.h"

namespace tpmoe::cuda {

namespace {

constexpr int kMaxNormThreads = kMaxBlockThreads;  // block_sum (kernel_utils.cuh) holds that many
constexpr int kMaxHeadDim = 256;
constexpr int kRopeWarpsPerBlock = 8;
constexpr int kMaxPairsPerLane = kMaxHeadDim / 2 / kWarp;  // rotary pairs (i, i + rd/2), i < rd/2 <= 128
constexpr int kMaxPassPerLane = kMaxHeadDim / kWarp;       // pass-through channels rd..hd

// kVec: H % 8 == 0 and all pointers 16-byte aligned (then every row start is too: H*2 and H*4 bytes
// are multiples of 16).
template <bool kVec>
__global__ void __launch_bounds__(kMaxNormThreads) add_rmsnorm_kernel(AddRmsNormParams p) {
  const int H = p.hidden;
  const int64_t row = blockIdx.x;
  float* res = p.residual + row * H;
  const __nv_bfloat16* part = p.partial ? p.partial + row * H : nullptr;
  __nv_bfloat16* out = p.out + row * H;
  // The weights of this thread's first two chunks before the wait (weights: kernel_utils.cuh), so
  // that their latency overlaps the kernel before instead of following the sum of squares; more
  // chunks a thread (H > 16 x the block) load theirs where they multiply.
  float4 w_early[2][2] = {};
  if constexpr (kVec) {
    const float4* w4 = reinterpret_cast<const float4*>(p.weight);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (c < H / 8) {
        w_early[k][0] = __ldg(&w4[2 * c]);
        w_early[k][1] = __ldg(&w4[2 * c + 1]);
      }
    }
  }
  pdl_wait();
  pdl_trigger();

  float ss = 0.f;
  if constexpr (kVec) {
    float4* res4 = reinterpret_cast<float4*>(res);
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
      float4 r0 = res4[2 * c], r1 = res4[2 * c + 1];
      ss = add_chunk_sum_squares(r0, r1, part ? reinterpret_cast<const uint4*>(part) + c : nullptr, ss);
      if (part) {
        res4[2 * c] = r0;
        res4[2 * c + 1] = r1;
      }
    }
  } else {
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
      float v = res[i];
      if (part) {
        v += __bfloat162float(part[i]);
        res[i] = v;
      }
      ss += v * v;
    }
  }
  ss = block_sum(ss);
  const float inv = inverse_rms(ss, H, p.eps);

  // Same stride as pass 1: each thread reads back exactly the residual elements it wrote.
  if constexpr (kVec) {
    const float4* res4 = reinterpret_cast<const float4*>(res);
    const float4* w4 = reinterpret_cast<const float4*>(p.weight);
    for (int c = threadIdx.x, k = 0; c < H / 8; c += blockDim.x, ++k) {
      const float4 w0 = k == 0 ? w_early[0][0] : k == 1 ? w_early[1][0] : __ldg(&w4[2 * c]);
      const float4 w1 = k == 0 ? w_early[0][1] : k == 1 ? w_early[1][1] : __ldg(&w4[2 * c + 1]);
      reinterpret_cast<uint4*>(out)[c] = normed_chunk(res4[2 * c], res4[2 * c + 1], w0, w1, inv);
    }
  } else {
    for (int i = threadIdx.x; i < H; i += blockDim.x)
      out[i] = __float2bfloat16_rn(res[i] * inv * (1.f + __ldg(&p.weight[i])));
  }
}

// The tensors of one launch; block b works on items[i] for block_begin[i] <= b < block_begin[i + 1].
struct HeadNormRopeBatch {
  HeadNormRopeParams items[kMaxHeadNormRopeItems];
  int64_t block_begin[kMaxHeadNormRopeItems + 1] = {};
  int count = 0;
  CacheRowStore store;  // read only by items with a cache or copy destination
};

__global__ void __launch_bounds__(kRopeWarpsPerBlock* kWarp) head_norm_rope_kernel(HeadNormRopeBatch batch) {
  int item = 0;
  while (item + 1 < batch.count && int64_t(blockIdx.x) >= batch.block_begin[item + 1]) ++item;
  const HeadNormRopeParams& p = batch.items[item];
  const int hd = p.head_dim, rd = p.rotary_dim, half = rd / 2;
  // inv_freq once per block (8 heads share it), in double as the CPU oracle computes it.
  __shared__ float inv_freq[kMaxHeadDim / 2];
  for (int i = threadIdx.x; i < half; i += blockDim.x) inv_freq[i] = float(pow(double(p.theta), -2.0 * i / rd));
  __syncthreads();

  // Before the PDL wait, what no kernel of the step writes (kernel_utils.cuh), so that it overlaps
  // the kernel before: the head's cache row (slots, positions and the page table are step inputs),
  // this lane's norm weights and the rotation's cos / sin at the token's position. x, that kernel's
  // output, is read after the wait.
  // token * heads + h
  const int64_t head = (int64_t(blockIdx.x) - batch.block_begin[item]) * kRopeWarpsPerBlock + threadIdx.x / kWarp;
  const bool live = head < int64_t(p.num_tokens) * p.num_heads;  // the same for the whole warp
  const int lane = threadIdx.x % kWarp;
  const int64_t t = head / p.num_heads;
  // The cache store: head (t, h) goes to pool row r of the cache at r*heads*hd + h*hd, i.e. head
  // h of token t's row.
  size_t cache_offset = 0;
  if (live && (p.cache != nullptr || p.copy != nullptr)) {
    const size_t row = batch.store.pages.row(batch.store.seq_slots[t], p.positions[t]);
    cache_offset = (row * size_t(p.num_heads) + size_t(head - t * p.num_heads)) * size_t(hd);
  }
  float wa[kMaxPairsPerLane] = {}, wb[kMaxPairsPerLane] = {}, wc[kMaxPassPerLane] = {};
  float sn[kMaxPairsPerLane] = {}, cs[kMaxPairsPerLane] = {};
  if (live) {
    const float pos = float(p.positions[t]);
#pragma unroll
    for (int k = 0; k < kMaxPairsPerLane; ++k) {
      const int i = lane + kWarp * k;
      if (i < half) {
        wa[k] = __ldg(&p.weight[i]);
        wb[k] = __ldg(&p.weight[i + half]);
        sincosf(pos * inv_freq[i], &sn[k], &cs[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kMaxPassPerLane; ++k) {
      const int j = rd + lane + kWarp * k;
      if (j < hd) wc[k] = __ldg(&p.weight[j]);
    }
  }
  pdl_wait();
  pdl_trigger();
  if (!live) return;  // the whole warp leaves together

  __nv_bfloat16* v = p.x + head * hd;  // [T, heads, hd] contiguous: head (t, h) starts at (t*heads + h)*hd
  __nv_bfloat16* cache_head = p.cache != nullptr ? p.cache + cache_offset : nullptr;

  float a[kMaxPairsPerLane], b[kMaxPairsPerLane], c[kMaxPassPerLane];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kMaxPairsPerLane; ++k) {
    const int i = lane + kWarp * k;
    a[k] = b[k] = 0.f;
    if (i < half) {
      a[k] = __bfloat162float(v[i]);
      b[k] = __bfloat162float(v[i + half]);
      ss += a[k] * a[k] + b[k] * b[k];
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxPassPerLane; ++k) {
    const int j = rd + lane + kWarp * k;
    c[k] = 0.f;
    if (j < hd) {
      c[k] = __bfloat162float(v[j]);
      ss += c[k] * c[k];
    }
  }
  // The copy (the layer's V tensor beside K): no norm, no rotation. Placed after x's loads: a store
  // the compiler cannot prove disjoint from x would hold them back.
  if (p.copy != nullptr && lane < hd / 8)
    reinterpret_cast<uint4*>(p.copy_cache + cache_offset)[lane] =
        reinterpret_cast<const uint4*>(p.copy + head * hd)[lane];
  ss = warp_sum(ss);
  const float inv = 1.f / sqrtf(ss / float(hd) + p.eps);

#pragma unroll
  for (int k = 0; k < kMaxPairsPerLane; ++k) {
    const int i = lane + kWarp * k;
    if (i < half) {
      const float an = a[k] * inv * (1.f + wa[k]);
      const float bn = b[k] * inv * (1.f + wb[k]);
      const __nv_bfloat16 ya = __float2bfloat16_rn(an * cs[k] - bn * sn[k]);
      const __nv_bfloat16 yb = __float2bfloat16_rn(bn * cs[k] + an * sn[k]);
      v[i] = ya;
      v[i + half] = yb;
      if (cache_head != nullptr) {
        cache_head[i] = ya;
        cache_head[i + half] = yb;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxPassPerLane; ++k) {
    const int j = rd + lane + kWarp * k;
    if (j < hd) {
      const __nv_bfloat16 y = __float2bfloat16_rn(c[k] * inv * (1.f + wc[k]));
      v[j] = y;
      if (cache_head != nullptr) cache_head[j] = y;
    }
  }
}

}  // namespace

void launch_add_rmsnorm(const AddRmsNormParams& p, KernelStream on) {
  if (p.rows <= 0 || p.hidden <= 0) return;
  check_arg(p.residual && p.weight && p.out, "add_rmsnorm: residual, weight and out must be set");
  const bool vec = p.hidden % 8 == 0 && aligned16(p.residual) && aligned16(p.weight) && aligned16(p.out) &&
                   (p.partial == nullptr || aligned16(p.partial));
  // The vector path's block is norm_math.cuh's norm threads (the GEMV that normalises its own input
  // sums a row in that shape too); the scalar one a thread per element, up to the same limit.
  const int threads = vec ? norm_threads(p.hidden) : std::min((p.hidden + kWarp - 1) / kWarp * kWarp, kMaxNormThreads);
  launch_pdl(vec ? add_rmsnorm_kernel<true> : add_rmsnorm_kernel<false>, dim3(unsigned(p.rows)),
             dim3(unsigned(threads)), 0, on, p);
}

void launch_head_norm_rope(const HeadNormRopeParams& p, KernelStream on) { launch_head_norm_rope_batch(&p, 1, on); }

void launch_head_norm_rope_batch(const HeadNormRopeParams* items, int count, KernelStream on,
                                 const CacheRowStore& store) {
  check_arg(count >= 0 && count <= kMaxHeadNormRopeItems, "head_norm_rope: at most 4 tensors in one launch");
  HeadNormRopeBatch batch;
  batch.store = store;
  for (int i = 0; i < count; ++i) {
    const HeadNormRopeParams& p = items[i];
    if (p.num_tokens <= 0 || p.num_heads <= 0) continue;
    check_arg(p.head_dim > 0 && p.head_dim <= kMaxHeadDim, "head_norm_rope: head_dim must be in [1, 256]");
    check_arg(p.rotary_dim >= 0 && p.rotary_dim <= p.head_dim && p.rotary_dim % 2 == 0,
              "head_norm_rope: rotary_dim must be even and <= head_dim");
    check_arg(p.x && p.weight && p.positions, "head_norm_rope: x, weight and positions must be set");
    check_arg((p.copy == nullptr) == (p.copy_cache == nullptr),
              "head_norm_rope: copy and copy_cache must be set together");
    if (p.cache != nullptr || p.copy != nullptr)
      check_arg(store.seq_slots && store.pages.table && store.pages.shift >= 0 && store.pages.shift < 31 &&
                    store.pages.pages_per_seq > 0,
                "head_norm_rope: a cache store needs the launch's CacheRowStore (seq_slots and a page table)");
    if (p.copy != nullptr)
      check_arg(p.head_dim % 8 == 0 && aligned16(p.copy) && aligned16(p.copy_cache),
                "head_norm_rope: the copy into the cache needs head_dim a multiple of 8 and 16-byte aligned "
                "copy and copy_cache");
    const int64_t warps = int64_t(p.num_tokens) * p.num_heads;
    batch.items[batch.count] = p;
    batch.block_begin[batch.count + 1] =
        batch.block_begin[batch.count] + (warps + kRopeWarpsPerBlock - 1) / kRopeWarpsPerBlock;
    ++batch.count;
  }
  if (batch.count == 0) return;
  const int64_t blocks = batch.block_begin[batch.count];
  check_arg(blocks <= 0x7fffffff, "head_norm_rope: too many (token, head) pairs for one launch");
  launch_pdl(head_norm_rope_kernel, dim3(unsigned(blocks)), dim3(kRopeWarpsPerBlock * kWarp), 0, on, batch);
}

}  // namespace tpmoe::cuda
