// The skinny linear (skinny_linear.cuh): one pass over the weight for every token of the batch.
//
// A CTA is row_warps warps, each owning 16 weight rows (g and g + 8 a lane, t = lane % 4), all
// walking the CTA's k slice together, a stage of 128 k at a time:
// - the weights go straight to registers, each lane 16 bytes of each of its two rows a k chunk (32 k
//   of bf16, 64 of MXFP8: 4 or 2 chunks a stage), the next stage's loads issued before this one is
//   multiplied, the first stage's before the PDL wait;
// - the activations of every token for the stage's 128 k are copied to shared memory (cp.async, two
//   buffers: the next stage's copy runs while this one is multiplied), where every warp of the CTA
//   reads them: a first version read them from global memory inside the multiply loop, one L2 round
//   trip after another, and ran 3-10x slower than cuBLASLt (docs/PERF.md).
// The mma's k slots take a lane's k in order (k = chunk * kChunk + t * kChunk / 4 + j, as the grouped
// GEMM of moe.cu), and the activations are read in the same order: token row g of the n-tile, the
// same 8 (bf16) or 16 (MXFP8) k. A k split adds its CTAs' sums through distributed shared memory.
#include "backends/cuda/skinny_linear.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <string>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_utils.cuh"
#include "backends/cuda/weight_loads.cuh"

namespace tpmoe::cuda {

namespace {

constexpr int kStageK = 128;  // k a stage
constexpr int kMaxSplits = int(kPortableClusterSize);

struct KernelParams {
  const uint16_t* x = nullptr;  // [M, K] bf16 bits
  const uint8_t* w = nullptr;   // [N, K] bf16 or e4m3
  const uint8_t* w_scale = nullptr;
  void* out = nullptr;
  bool out_f32 = false;
  int M = 0, N = 0, K = 0;
  int split_chunks = 0;  // k chunks a CTA of the cluster takes (whole stages; the last CTA may take fewer)
};

template <bool kFp8>
constexpr int chunk_k() {
  return kFp8 ? 64 : 32;
}
template <bool kFp8>
constexpr int stage_chunks() {
  return kStageK / chunk_k<kFp8>();
}
// A token's 128 k of a stage in shared memory, padded so that the two token rows a quarter warp's
// 16-byte reads touch fall in distinct banks (bf16: 2 rows x 64 bytes, row stride = 64 mod 128;
// MXFP8: 2 rows x 4 lanes 32 bytes apart, row stride = 16 mod 128).
template <bool kFp8>
constexpr int x_row_bytes() {
  return kStageK * 2 + (kFp8 ? 16 : 64);
}
template <bool kFp8>
constexpr size_t smem_bytes(int nt, int row_warps) {
  const size_t stages = size_t(2) * nt * 8 * x_row_bytes<kFp8>();
  const size_t reduction = size_t(row_warps) * nt * 4 * 32 * sizeof(float);
  return stages > reduction ? stages : reduction;
}

// kFp8: e4m3 weights with an E8M0 scale per 32 k. NT: n-tiles of 8 tokens (M <= 8 * NT). WM: warps a
// CTA, 16 weight rows each. Resident warps an SM asked of the compiler: 16 (NT <= 8) or 8.
template <bool kFp8, int NT, int WM>
__global__ void __launch_bounds__(WM * 32, (NT <= 8 ? 16 : 8) / WM > 0 ? (NT <= 8 ? 16 : 8) / WM : 1)
    skinny_linear_kernel(const KernelParams p) {
  constexpr int U = stage_chunks<kFp8>();
  constexpr int kChunk = chunk_k<kFp8>();
  constexpr int kLaneK = kChunk / 4;   // consecutive k a lane loads of each row, a chunk
  constexpr int kXWords = kLaneK / 8;  // 16-byte activation reads a lane, a chunk and n-tile
  constexpr int kWBytes = kFp8 ? 1 : 2;
  constexpr int kRowBytes = x_row_bytes<kFp8>();
  constexpr int kRows = NT * 8;              // token rows of a stage (past M: zeros)
  constexpr int kPieces = kStageK * 2 / 16;  // 16-byte copies a token row, a stage
  constexpr int kStageBytes = kRows * kRowBytes;
  extern __shared__ __align__(16) unsigned char smem[];  // two stages; after the loop, the k split's sums

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int K = p.K;
  const int row0 = int(blockIdx.x) * 16 * WM + warp * 16;
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
  const int stages = c_end > c_begin ? (c_end - c_begin + U - 1) / U : 0;

  // Stage j's weights: zeros past the CTA's chunks or past K (K % 8, MXFP8 K % 32: a lane's k are all
  // in or all out).
  auto load_weights = [&](int j, uint4(&wv)[U][2], uint32_t(&sv)[U][2]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int chunk = c_begin + j * U + u;
      const int k = chunk * kChunk + kLaneK * t;
      const bool live = j < stages && chunk < c_end && k < K;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wv[u][h] = live ? ld_weight16(reinterpret_cast<const uint16_t*>(w_row[h] + size_t(k) * kWBytes))
                        : make_uint4(0, 0, 0, 0);
        if constexpr (kFp8) sv[u][h] = live ? __ldg(s_row[h] + k / 32) : 127u;
      }
    }
  };
  // Stage j's activations into buffer j % 2: every token row's 128 k (zeros past M, past K and past
  // the CTA's chunks, so that a zero weight never meets a stale NaN), one cp.async group a thread (an
  // empty one past the last stage, so that the waits below count the same).
  auto copy_x = [&](int j) {
    if (j < stages) {
      unsigned char* buf = smem + (j & 1) * kStageBytes;
      const int k0 = (c_begin + j * U) * kChunk, k_end = min(K, c_end * kChunk);
      for (int i = int(threadIdx.x); i < kRows * kPieces; i += WM * 32) {
        const int r = i / kPieces, k = k0 + (i % kPieces) * 8;
        const bool valid = r < p.M && k < k_end;
        cp_async16(buf + r * kRowBytes + (i % kPieces) * 16, valid ? p.x + size_t(r) * K + k : p.x, valid);
      }
    }
    cp_async_commit();
  };

  uint4 a[U][2];
  uint32_t s[U][2];
  load_weights(0, a, s);  // before the wait: the weights do not depend on the previous kernel
  pdl_wait();
  pdl_trigger();
  copy_x(0);

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
  const int live_tiles = (p.M + 7) / 8;

  for (int j = 0; j < stages; ++j) {
    uint4 an[U][2];
    uint32_t sn[U][2];
    load_weights(j + 1, an, sn);  // the next stage's weights and activations in flight
    copy_x(j + 1);
    cp_async_wait_group<1>();  // this thread's copies of stage j have landed
    __syncthreads();           // ... and every thread's
    const unsigned char* buf = smem + (j & 1) * kStageBytes;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c_begin + j * U + u >= c_end) break;  // CTA-uniform
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
        const int byte = (u * kChunk + kLaneK * t + 8 * i) * 2;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (nt >= live_tiles) break;  // CTA-uniform: empty n-tiles cost nothing
          const uint4 b = *reinterpret_cast<const uint4*>(buf + (nt * 8 + g) * kRowBytes + byte);
          mma_bf16_16816(acc[nt], ra.x, rb.x, ra.y, rb.y, b.x, b.y);
          mma_bf16_16816(acc[nt], ra.z, rb.z, ra.w, rb.w, b.z, b.w);
        }
      }
    }
    __syncthreads();  // every warp is done with buffer j % 2 before stage j + 2 is copied into it
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        a[u][h] = an[u][h];
        if constexpr (kFp8) s[u][h] = sn[u][h];
      }
  }
  cp_async_wait_all();  // the last, empty group

  // C element q of a lane: row g + 8 (q >= 2) of the warp's 16, token 2 t + (q & 1) of the n-tile.
  auto store = [&](int col, int n, float v) {
    const size_t at = size_t(col) * p.N + n;
    if (p.out_f32)
      static_cast<float*>(p.out)[at] = v;
    else
      static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(v);
  };
  if (gridDim.z == 1) {  // no k split: each lane stores its own sums
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int col = nt * 8 + 2 * t + (q & 1), n = row0 + g + 8 * (q >> 1);
        if (col < p.M && n < p.N) store(col, n, acc[nt][q]);
      }
    return;
  }

  // A k split: every warp's sums into shared memory (item (warp, f, lane) at red[(warp * NT * 4 + f) *
  // 32 + lane]), then the cluster's CTAs (k slices, rank = blockIdx.z) each finish a share of the items,
  // adding the slices in rank order: the bits do not depend on which CTA adds them.
  constexpr int kItems = WM * NT * 4 * 32;
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) red[(warp * NT * 4 + nt * 4 + q) * 32 + lane] = acc[nt][q];
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  cluster.sync();  // every CTA's sums are in its shared memory
  const int share = (kItems + splits - 1) / splits;
  for (int item = rank * share + int(threadIdx.x); item < min(kItems, (rank + 1) * share); item += WM * 32) {
    const int l = item & 31, f = (item >> 5) % (NT * 4), iw = (item >> 5) / (NT * 4);
    const int q = f & 3, nt = f >> 2;
    const int col = nt * 8 + 2 * (l & 3) + (q & 1);
    const int n = int(blockIdx.x) * 16 * WM + iw * 16 + (l >> 2) + 8 * (q >> 1);
    if (col >= p.M || n >= p.N) continue;
    float part[kMaxSplits];
#pragma unroll
    for (int z = 0; z < kMaxSplits; ++z)  // all loads first: one round trip, not one a split
      part[z] = z < splits ? cluster.map_shared_rank(red, z)[item] : 0.f;
    float sum = 0.f;
#pragma unroll
    for (int z = 0; z < kMaxSplits; ++z)
      if (z < splits) sum += part[z];
    store(col, n, sum);
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
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

size_t kernel_smem(bool fp8, int M, int row_warps) {
  const int nt = tiles_for(M);
  return fp8 ? smem_bytes<true>(nt, row_warps) : smem_bytes<false>(nt, row_warps);
}

int num_chunks(const SkinnyLinearParams& p) {
  const int kc = p.w_scale ? chunk_k<true>() : chunk_k<false>();
  return (p.K + kc - 1) / kc;
}

int stage_chunks_of(const SkinnyLinearParams& p) { return p.w_scale ? stage_chunks<true>() : stage_chunks<false>(); }

// The k split actually launched for `want`: at most one CTA a stage, and none left without chunks.
// Returns the CTAs a row tile; *split_chunks the chunks each takes (whole stages).
int fit_splits(int want, int chunks, int stage, int* split_chunks) {
  const int stages = (chunks + stage - 1) / stage;
  const int s = std::clamp(want, 1, std::min(kMaxSplits, stages));
  *split_chunks = (stages + s - 1) / s * stage;
  return (chunks + *split_chunks - 1) / *split_chunks;
}

}  // namespace

bool skinny_linear_fits(const SkinnyLinearParams& p) {
  const bool fp8 = p.w_scale != nullptr;
  return p.x && p.w && p.out && p.M >= 1 && p.M <= kSkinnyLinearMaxM && p.N >= 1 && p.K >= 1 &&
         p.K % (fp8 ? 32 : 8) == 0 && aligned16(p.x) && aligned16(p.w) && p.out != static_cast<const void*>(p.x);
}

// The rule below was read off bench_cuda_gemm's sweep of every tiling over the dense linears of a tp-8
// and a tp-4 rank at 9-128 tokens (H100, docs/PERF.md). Where the engine runs the kernel (bf16 at 16
// tokens, MXFP8 at 16 and 64) it chose within 1% of the sweep's fastest tiling at most shapes and
// 6-20% slower at four:
// - 64 rows a CTA; 128 from 33 tokens where N >= 1024 (the activations are copied once a row tile,
//   and from 33 tokens they are as many bytes as a row tile's weights); 32 for N <= 1024 at up to 16
//   tokens (a narrow weight wants more CTAs);
// - the k split a power of two, at most 8, keeping every CTA at least 2 stages (128 k each: the pipeline
//   is 2 deep) and the CTAs under 4 an SM.
SkinnyLinearTiling skinny_linear_choose(const SkinnyLinearParams& p) {
  const int rw = p.M > 32 && p.N >= 1024 ? 8 : p.M <= 16 && p.N <= 1024 ? 2 : 4;
  const int64_t tiles = (int64_t(p.N) + 16 * rw - 1) / (16 * rw);
  const int64_t stages = (int64_t(p.K) + kStageK - 1) / kStageK;
  const int64_t most = std::min<int64_t>({kMaxSplits, stages / 2, 4 * int64_t(sm_count()) / tiles});
  int splits = 1;
  while (splits * 2 <= most) splits *= 2;
  return {rw, splits};
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
  KernelParams kp;
  kp.x = reinterpret_cast<const uint16_t*>(p.x);
  kp.w = static_cast<const uint8_t*>(p.w);
  kp.w_scale = p.w_scale;
  kp.out = p.out;
  kp.out_f32 = p.out_f32;
  kp.M = p.M;
  kp.N = p.N;
  kp.K = p.K;
  const int splits = fit_splits(tiling.k_splits, num_chunks(p), stage_chunks_of(p), &kp.split_chunks);
  const int64_t tiles = (int64_t(p.N) + 16 * rw - 1) / (16 * rw);
  check_arg(tiles <= 0x7fffffff, "launch_skinny_linear: N too large for the grid");
  launch_pdl_clusters(pick_kernel(fp8, p.M, rw), dim3(unsigned(tiles), 1, unsigned(splits)), dim3(unsigned(rw) * 32),
                      kernel_smem(fp8, p.M, rw), on, unsigned(splits), kp);
}

}  // namespace tpmoe::cuda
