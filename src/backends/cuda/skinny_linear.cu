// The skinny linear (skinny_linear.cuh): one pass over the weight for every token of the batch.
//
// Inside a warp (16 weight rows g and g + 8 a lane, tokens in n-tiles of 8): a k chunk is 32 k of
// bf16 or 64 of MXFP8, so that a lane loads 16 bytes of each of its two rows a chunk, at k = chunk *
// kChunk + t * kChunk / 4 (t = lane % 4), as the grouped GEMM does (moe.cu). The mma's k slots take
// those k in order, and the activations are loaded in the same order: token row g of the n-tile, the
// same 8 (bf16) or 16 (MXFP8) k, straight from global memory through L1, where the CTA's other row
// warps (and CTAs on the same SM) find them. A warp keeps two groups of U chunks of weight loads in
// flight (the next group is issued before the current one is multiplied).
#include "backends/cuda/skinny_linear.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <string>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_utils.cuh"
#include "backends/cuda/weight_loads.cuh"

namespace tpmoe::cuda {

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGroupChunks = 4;  // U: k chunks a warp loads at once (two groups in flight)
constexpr int kMaxSplits = 8;    // the portable cluster size

struct KernelParams {
  const uint16_t* x = nullptr;  // [M, K] bf16 bits
  const uint8_t* w = nullptr;   // [N, K] bf16 or e4m3
  const uint8_t* w_scale = nullptr;
  void* out = nullptr;
  bool out_f32 = false;
  int M = 0, N = 0, K = 0;
  int split_chunks = 0;  // k chunks a CTA of the cluster takes (the last may take fewer)
};

template <bool kFp8>
constexpr int chunk_k() {
  return kFp8 ? 64 : 32;
}

// The shared memory a CTA's reduction needs: every warp's accumulators, [kWarps][NT * 4][32] floats.
constexpr size_t reduction_bytes(int nt) { return size_t(kWarps) * nt * 4 * 32 * sizeof(float); }

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// kFp8: e4m3 weights with an E8M0 scale per 32 k. NT: n-tiles of 8 tokens (M <= 8 * NT). WM: row warps
// (16 * WM rows a CTA); the kWarps / WM warps of a row warp's column split the CTA's chunks, U at a time.
template <bool kFp8, int NT, int WM>
__global__ void __launch_bounds__(kThreads, NT <= 8 ? 2 : 1) skinny_linear_kernel(const KernelParams p) {
  constexpr int WK = kWarps / WM;
  constexpr int U = kGroupChunks;
  constexpr int kChunk = chunk_k<kFp8>();
  constexpr int kLaneK = kChunk / 4;   // consecutive k a lane loads of each row, a chunk
  constexpr int kXWords = kLaneK / 8;  // 16-byte activation loads a lane, a chunk and n-tile
  constexpr int kWBytes = kFp8 ? 1 : 2;
  extern __shared__ float red[];  // [kWarps][NT * 4][32], then the CTA's sums in its first WM slots

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp % WM, wk = warp / WM;
  const int K = p.K;
  const int row0 = int(blockIdx.x) * 16 * WM + wm * 16;
  const uint8_t* w_row[2];
  const uint8_t* s_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = min(row0 + g + 8 * h, p.N - 1);  // rows past N repeat the last one; never stored
    w_row[h] = p.w + size_t(r) * K * kWBytes;
    s_row[h] = kFp8 ? p.w_scale + size_t(r) * (K / 32) : nullptr;
  }
  const int num_chunks = (K + kChunk - 1) / kChunk;
  const int c_begin = int(blockIdx.z) * p.split_chunks;
  const int c_end = min(num_chunks, c_begin + p.split_chunks);
  const int first = c_begin + wk * U, step = WK * U;

  // A group: the weight loads of chunks base .. base + U - 1 (zeros past the CTA's range or past K).
  uint4 a[U][2];
  uint32_t s[U][2];
  auto load_group = [&](int base, uint4(&wv)[U][2], uint32_t(&sv)[U][2]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int chunk = base + u;
      const int k = chunk * kChunk + kLaneK * t;
      const bool live = chunk < c_end && k < K;  // K % 8 (bf16) or % 32 (MXFP8): a lane's k are all in or out
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wv[u][h] = live ? ld_weight16(reinterpret_cast<const uint16_t*>(w_row[h] + size_t(k) * kWBytes))
                        : make_uint4(0, 0, 0, 0);
        if constexpr (kFp8) sv[u][h] = live ? __ldg(s_row[h] + k / 32) : 127u;
      }
    }
  };
  load_group(first, a, s);  // before the wait: the weights do not depend on the previous kernel
  pdl_wait();
  pdl_trigger();

  // Token row g of every n-tile (clamped into the batch: a column past M is computed, never stored).
  const uint16_t* x_row[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) x_row[nt] = p.x + size_t(min(nt * 8 + g, p.M - 1)) * K;
  const int live_tiles = (p.M + 7) / 8;

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;

  for (int base = first; base < c_end; base += step) {
    uint4 an[U][2];
    uint32_t sn[U][2];
    load_group(base + step, an, sn);  // the next group in flight while this one is multiplied
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int chunk = base + u;
      const int k = chunk * kChunk + kLaneK * t;
      if (chunk >= c_end) break;  // warp-uniform
      const bool live = k < K;
#pragma unroll
      for (int i = 0; i < kXWords; ++i) {
        uint4 ra, rb;  // rows g and g + 8 as bf16: the lane's k 8i .. 8i + 7 of the chunk
        if constexpr (kFp8) {
          ra = dequant_e4m3x8(i ? make_uint2(a[u][0].z, a[u][0].w) : make_uint2(a[u][0].x, a[u][0].y), s[u][0]);
          rb = dequant_e4m3x8(i ? make_uint2(a[u][1].z, a[u][1].w) : make_uint2(a[u][1].x, a[u][1].y), s[u][1]);
        } else {
          ra = a[u][0];
          rb = a[u][1];
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (nt >= live_tiles) break;  // warp-uniform: empty n-tiles cost nothing
          const uint4 b = live ? __ldg(reinterpret_cast<const uint4*>(x_row[nt] + k + 8 * i)) : make_uint4(0, 0, 0, 0);
          mma_16816(acc[nt], ra.x, rb.x, ra.y, rb.y, b.x, b.y);
          mma_16816(acc[nt], ra.z, rb.z, ra.w, rb.w, b.z, b.w);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        a[u][h] = an[u][h];
        if constexpr (kFp8) s[u][h] = sn[u][h];
      }
  }

  // The CTA's sums: every warp's accumulators into shared memory, then the WK warps of each row warp
  // added in warp order into the first WM slots (item (wm, f, lane) at red[(wm * NT * 4 + f) * 32 +
  // lane]; each item read and written by one thread).
  constexpr int kSlot = NT * 4 * 32;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) red[warp * kSlot + (nt * 4 + q) * 32 + lane] = acc[nt][q];
  __syncthreads();
  constexpr int kItems = WM * kSlot;
  if constexpr (WK > 1) {
    for (int item = threadIdx.x; item < kItems; item += kThreads) {
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < WK; ++j) sum += red[j * kItems + item];  // warp j * WM + wm's copy of the item
      red[item] = sum;
    }
    __syncthreads();
  }

  // The cluster's CTAs (k slices, rank = blockIdx.z) each finish a share of the items, adding the
  // slices in rank order. Item (wm, nt, q, lane): C element q of the lane is row g + 8 (q >= 2), token
  // 2 t + (q & 1) of the n-tile.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  if (splits > 1) cluster.sync();  // every CTA's sums are in its shared memory
  const int share = (kItems + splits - 1) / splits;
  for (int item = rank * share + int(threadIdx.x); item < min(kItems, (rank + 1) * share); item += kThreads) {
    const int l = item & 31, f = (item >> 5) % (NT * 4), iw = (item >> 5) / (NT * 4);
    const int q = f & 3, nt = f >> 2;
    const int col = nt * 8 + 2 * (l & 3) + (q & 1);
    const int n = int(blockIdx.x) * 16 * WM + iw * 16 + (l >> 2) + 8 * (q >> 1);
    if (col >= p.M || n >= p.N) continue;
    float sum = 0.f;
    for (int z = 0; z < splits; ++z) sum += (z == rank ? red : cluster.map_shared_rank(red, z))[item];
    const size_t at = size_t(col) * p.N + n;
    if (p.out_f32)
      static_cast<float*>(p.out)[at] = sum;
    else
      static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(sum);
  }
  if (splits > 1) cluster.sync();  // no CTA leaves while another still reads its shared memory
}

using KernelFn = void (*)(KernelParams);

template <bool kFp8, int NT>
KernelFn kernel_for(int row_warps) {
  switch (row_warps) {
    case 1: return skinny_linear_kernel<kFp8, NT, 1>;
    case 2: return skinny_linear_kernel<kFp8, NT, 2>;
    case 4: return skinny_linear_kernel<kFp8, NT, 4>;
    default: return skinny_linear_kernel<kFp8, NT, 8>;
  }
}

// n-tiles of the kernel that runs M tokens: 2, 4, 8 or 16.
int tiles_for(int M) { return M <= 16 ? 2 : M <= 32 ? 4 : M <= 64 ? 8 : 16; }

KernelFn pick_kernel(bool fp8, int M, int row_warps) {
  switch (tiles_for(M)) {
    case 2: return fp8 ? kernel_for<true, 2>(row_warps) : kernel_for<false, 2>(row_warps);
    case 4: return fp8 ? kernel_for<true, 4>(row_warps) : kernel_for<false, 4>(row_warps);
    case 8: return fp8 ? kernel_for<true, 8>(row_warps) : kernel_for<false, 8>(row_warps);
    default: return fp8 ? kernel_for<true, 16>(row_warps) : kernel_for<false, 16>(row_warps);
  }
}

// Opts the kernel into its shared memory (past the static 48 KiB at 16 n-tiles) on the current device
// and returns its resident CTAs an SM. Host queries, no sync: fine inside a graph capture, and asked
// per launch because a process may drive several GPUs (the attribute is per device).
int prepare_kernel(bool fp8, int M, int row_warps) {
  const KernelFn kernel = pick_kernel(fp8, M, row_warps);
  const size_t smem = reduction_bytes(tiles_for(M));
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  return std::max(per_sm, 1);
}

int num_chunks(const SkinnyLinearParams& p) {
  const int kc = p.w_scale ? chunk_k<true>() : chunk_k<false>();
  return (p.K + kc - 1) / kc;
}

// The largest k split up to `want` that leaves every warp of a CTA at least one group of chunks.
int fit_splits(int want, int chunks, int row_warps) {
  const int per_cta_min = (kWarps / row_warps) * kGroupChunks;
  int s = std::clamp(want, 1, kMaxSplits);
  while (s > 1 && chunks / s < per_cta_min) --s;
  return s;
}

}  // namespace

bool skinny_linear_fits(const SkinnyLinearParams& p) {
  const bool fp8 = p.w_scale != nullptr;
  return p.x && p.w && p.out && p.M >= 1 && p.M <= kSkinnyLinearMaxM && p.N >= 1 && p.K >= 1 &&
         p.K % (fp8 ? 32 : 8) == 0 && aligned16(p.x) && aligned16(p.w) && p.out != static_cast<const void*>(p.x);
}

// Widest row tile first (the activations are read once a row tile), as long as the CTAs still cover
// the SMs once; the k split fills each row tile's cluster up to the CTAs resident at once.
SkinnyLinearTiling skinny_linear_choose(const SkinnyLinearParams& p) {
  const int sms = sm_count(), chunks = num_chunks(p);
  const bool fp8 = p.w_scale != nullptr;
  SkinnyLinearTiling best{};
  int64_t best_ctas = 0;
  for (int rw : {8, 4, 2, 1}) {
    const int64_t tiles = (int64_t(p.N) + 16 * rw - 1) / (16 * rw);
    const int64_t resident = int64_t(sms) * prepare_kernel(fp8, p.M, rw);
    const int splits =
        fit_splits(int(std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, resident / tiles))), chunks, rw);
    const int64_t ctas = tiles * splits;
    if (ctas > best_ctas) best = {rw, splits}, best_ctas = ctas;
    if (ctas >= sms) return {rw, splits};
  }
  return best;
}

void launch_skinny_linear(const SkinnyLinearParams& p, KernelStream on, SkinnyLinearTiling tiling) {
  check_arg(skinny_linear_fits(p),
            "launch_skinny_linear: needs 1 <= M <= 128, K % 8 == 0 (MXFP8: % 32), 16-byte aligned x and "
            "weights, an output that is not x");
  if (tiling.row_warps == 0) tiling = skinny_linear_choose(p);
  const int rw = tiling.row_warps;
  check_arg(rw == 1 || rw == 2 || rw == 4 || rw == 8, "launch_skinny_linear: row_warps must be 1, 2, 4 or 8");
  check_arg(tiling.k_splits >= 1 && tiling.k_splits <= kMaxSplits, "launch_skinny_linear: k_splits must be in [1, 8]");
  const bool fp8 = p.w_scale != nullptr;
  const int chunks = num_chunks(p);
  const int splits = fit_splits(tiling.k_splits, chunks, rw);
  KernelParams kp;
  kp.x = reinterpret_cast<const uint16_t*>(p.x);
  kp.w = static_cast<const uint8_t*>(p.w);
  kp.w_scale = p.w_scale;
  kp.out = p.out;
  kp.out_f32 = p.out_f32;
  kp.M = p.M;
  kp.N = p.N;
  kp.K = p.K;
  kp.split_chunks = (chunks + splits - 1) / splits;
  const int ctas_a_tile = (chunks + kp.split_chunks - 1) / kp.split_chunks;  // none left without chunks
  const int64_t tiles = (int64_t(p.N) + 16 * rw - 1) / (16 * rw);
  check_arg(tiles <= 0x7fffffff, "launch_skinny_linear: N too large for the grid");
  prepare_kernel(fp8, p.M, rw);
  launch_pdl_clusters(pick_kernel(fp8, p.M, rw), dim3(unsigned(tiles), 1, unsigned(ctas_a_tile)), dim3(kThreads),
                      reduction_bytes(tiles_for(p.M)), on, unsigned(ctas_a_tile), kp);
}

}  // namespace tpmoe::cuda
