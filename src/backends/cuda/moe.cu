// The routed MoE layer on the GPU (SPEC §1.6, §1.8, §4 shared-expert fusion).
//
// Router: logits[T, E] (fp32) -> slot_ids/slot_weights[T, k + n]. One warp per token (route_top_k.cuh):
//   sigmoid in fp32, k rounds of a warp argmax of score + bias (ties to the lower id, as the CPU
//   oracle), weights = score / sum of the k chosen scores (summed in choice order, as the oracle),
//   then the n shared slots E..E+n-1 with weight shared_weight. E <= 256 (8 values per lane in
//   registers). Bytes: T*E*4 + E*4 read, T*(k+n)*8 written. launch_moe runs it first when the layer
//   routes itself (MoeKernelParams::route), except for a single token, whose GEMVs route inside.
//
// Experts: a single token (the batch-1 decode step) takes the two GEMV kernels of moe_gemv.cuh
// unless MoeTuning says otherwise; 2-4 tokens with MXFP8 weights (MoeTuning: 2-8 tokens of either
// format) take the alignment below and then moe_gemv.cuh's few-token GEMVs in place of 2.-4.
// Otherwise four launches, all with grids computed from the arguments only (CUDA-graph safe; no
// host sync, no allocation):
//   1. align (one CTA): counts the (token, slot) pairs per physical expert row (num_rows bins, i.e.
//      routed + fused shared rows: binning by E would drop the shared slots), prefix-sums them into
//      offsets[num_rows + 1], cuts every row's pairs into token blocks of bm pairs (below) and
//      writes the block table (expert, first sorted position) and perm[P] (sorted position -> pair
//      index t*slots + s). Counts and scatter cursors live in shared memory only.
//   2. gate_up GEMM with SwiGLU-OAI fused into the epilogue: act[pos, I] (bf16, sorted order) =
//      swiglu(x[token(pos)] Wgu[e]^T).
//   3. down GEMM: y[pair, H] (fp32) = w[pair] * act[pos] Wdown[e]^T, stored by pair index.
//   4. combine: out[t, h] = bf16(scale * sum_s y[t*slots + s, h]), slots summed in slot order (as the
//      oracle: the result does not depend on how experts were scheduled).
//
// GEMM work decomposition: grid = (token block b, row tile). The number of token blocks is data
// dependent, so the grid is sized for the worst case, max_blocks = ceil(P/bm) + min(P, num_rows)
// (sum over rows of ceil(c_e/bm) <= P/bm + active rows), and a CTA whose b >= num_blocks (read on
// the device) exits at once. The token block bm (8, 16 or 32 pairs: 1, 2 or 4 mma n-tiles) is chosen
// from the batch (<= 64 tokens: 8, <= 128: 16, else 32; any bm is correct, a row with more pairs gets
// more blocks); the kernels are templated on it, so a small batch carries no dead n-tiles and the
// registers go to loads in flight. For decode the row tiles carry the parallelism: gate_up tiles
// 8 intermediate rows j per m16 tile (the 8 gate rows and the matching 8 up rows share one m16 tile,
// so each lane holds both halves of its SwiGLU), 1 m-tile per CTA for bm <= 16 (384 CTAs per active
// expert at I = 3072), 2 for bm = 32; down tiles 32 hidden rows (192 CTAs per expert). Inside a CTA
// the 4 warps split K: warp w takes U contiguous 32-wide chunks (U * 64 bytes of every weight row),
// then skips 4U, with all U * MT * 2 16-byte weight loads issued before its mmas (U = 8 for the
// bm = 8 gate_up: 16 loads, 256 bytes in flight per thread, 4 CTAs per SM at 128 registers), and
// the warps reduce through shared memory in a fixed order (deterministic). Weight loads bypass L1
// and ask L2 for 256-byte fetches. Each CTA reads its weight rows once per token block: for decode
// every weight element is read exactly once per expert; prefill re-reads a row tile once per block,
// and those re-reads are adjacent in the grid (blockIdx.x runs over token blocks) so they hit L2.
//
// Launches: align, gate_up, down and combine go out with programmatic dependent launch: each kernel
// waits (griddepcontrol.wait) for its predecessor before reading its outputs or writing anything,
// then lets its dependents launch, so the next grid's CTAs are already resident when one finishes.
// At a single token (MoeTuning; measured slower at larger batches, where it doubles the L2 requests
// of every down CTA) the down CTAs prefetch the first 64 KiB of their weight tile into L2 before
// their wait (cp.async.bulk.prefetch). PDL is used up to 64 tokens (measured slower beyond). The combine runs on a (T,
// hidden / 1024) grid of float4 loads.
//
// Bytes (decode): each active expert row reads 3*I*H*2 bytes of weights once (113 MB at M3 shapes);
// x, act, y are small next to that. FLOPs: 2 * P * 3 * I * H.
//
// Layouts: x [T, H] bf16, gate_up [num_rows, 2I, H] (gate half then up half), down [num_rows, H, I],
// out [T, H] bf16, all row-major. `out` must not alias x (nor any other input or the workspace):
// the current kernels only write out after the last read of x, but a fused version may not.
// Slot ids outside [0, num_rows) are a routing bug: their pairs are skipped and the token's out row
// is NaN (a kernel cannot throw).
//
// MXFP8 weights (weight-only FP8, SPEC §3): the same kernels, templated on the weight format. Each lane
// loads its 16 weights of a 64-wide k chunk as 16 e4m3 bytes (one 16-byte load, as a bf16 lane loads
// 8 weights: with 8-byte loads a warp's load held 32 bytes of each row and the layer ran 4-12% slower
// at 8-256 tokens, docs/PERF.md) and their E8M0 scale (the 16 lie in one 32-wide block; 2 chunks'
// scales in one 32-bit load when K/32 % 4 == 0), and widens them to bf16 in registers right before
// the mma (dequant_e4m3x8: a bit shuffle and one bf16 multiply by 2^(s-7), exact). Decode bytes per
// active row: 3*I*H*(1 + 1/32). The same GEMM also serves the MXFP8 linears (launch_fp8_linear: one
// expert, tokens in order, no routing) and the bf16 linears of a few tokens (launch_bf16_linear). A
// linear has only its own row tiles to spread (a tp-8 rank's k_proj at 16 tokens: 8 CTAs, each
// walking all of k), so where they are few its k range is split over a cluster of up to 8 CTAs a
// tile (kSplitK), which add their sums through distributed shared memory in rank order: the bits do
// not depend on the schedule. An 8-layer tp-8 rank's MXFP8 step of 16 tokens went 18% faster with it
// (docs/PERF.md).
//
// Measured on an H200: see docs/PERF.md, bench_moe's tables (the whole layer, routing included, as
// CUDA graphs with a cold L2, against a floor over the measured read bandwidth). Before this
// version (bm = 32 always, 16 j per gate_up CTA, no PDL): T=1 0.215 ms = 2.6 TB/s of weights.
#include "backends/cuda/moe.cuh"

#include "backends/cuda/gemv.cuh"
#include "backends/cuda/kernel_utils.cuh"
#include "backends/cuda/moe_gemv.cuh"
#include "backends/cuda/route_top_k.cuh"
#include "backends/cuda/skinny_linear.cuh"
#include "backends/cuda/weight_loads.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>

#include "backends/cuda/cuda_check.h"

namespace tpmoe::cuda {

namespace {

// ----------------------------------------------------------------------------------------------
// Router
// ----------------------------------------------------------------------------------------------

constexpr int kRouteWarps = 4;

// A warp per token (route_top_k.cuh).
__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(const RouteKernelParams p) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kRouteWarps + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;
  store_route(p, t, route_top_k(p, t, lane), lane);
}

// ----------------------------------------------------------------------------------------------
// Workspace layout
// ----------------------------------------------------------------------------------------------

constexpr int kMinBlockM = 8;  // the smallest token block: sizes the block tables
constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int64_t max_token_blocks(int64_t pairs, int num_rows, int block_m) {
  return (pairs + block_m - 1) / block_m + std::min<int64_t>(pairs, num_rows);
}

struct WorkspaceLayout {
  size_t offsets = 0;       // int32 [num_rows + 1]: first sorted position of each row's pairs
  size_t num_blocks = 0;    // int32 [1]
  size_t block_expert = 0;  // int32 [max_blocks]
  size_t block_start = 0;   // int32 [max_blocks]: first sorted position of the block
  size_t perm = 0;          // int32 [P]: sorted position -> pair index t*slots + s
  size_t act = 0;           // bf16 [P, inter], sorted order
  size_t y = 0;             // fp32 [P, hidden], by pair index, already times the slot weight
  size_t total = 0;
  int64_t max_blocks = 0;  // for the smallest token block (any block_m fits)
};

WorkspaceLayout workspace_layout(int64_t tokens, int slots, int hidden, int inter, int num_rows) {
  const int64_t pairs = tokens * slots;
  WorkspaceLayout l;
  l.max_blocks = max_token_blocks(pairs, num_rows, kMinBlockM);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t start = at;
    at += align_up(bytes);
    return start;
  };
  l.offsets = take(size_t(num_rows + 1) * 4);
  l.num_blocks = take(4);
  l.block_expert = take(size_t(l.max_blocks) * 4);
  l.block_start = take(size_t(l.max_blocks) * 4);
  l.perm = take(size_t(pairs) * 4);
  l.act = take(size_t(pairs) * size_t(inter) * 2);
  l.y = take(size_t(pairs) * size_t(hidden) * 4);
  l.total = at;
  return l;
}

// Programmatic dependent launch: the kernels of launch_moe keep kernel_utils.cuh's pdl_wait contract
// (the down GEMM relies on the kernel two back being complete to read the block table before its wait).

// ----------------------------------------------------------------------------------------------
// 1. Alignment: pairs binned by physical expert row
// ----------------------------------------------------------------------------------------------

constexpr int kAlignThreads = 1024;
constexpr int kMaxAlignRows = 4096;  // two int32 per row in shared memory

struct AlignParams {
  const int32_t* slot_ids = nullptr;  // [P]
  int32_t* offsets = nullptr;
  int32_t* num_blocks = nullptr;
  int32_t* block_expert = nullptr;
  int32_t* block_start = nullptr;
  int32_t* perm = nullptr;
  int pairs = 0;
  int num_rows = 0;
  int block_m = 32;
};

__global__ void __launch_bounds__(kAlignThreads) moe_align_kernel(const AlignParams p) {
  extern __shared__ int32_t align_smem[];
  pdl_wait();
  pdl_trigger();
  int32_t* count = align_smem;                // [num_rows]
  int32_t* cursor = align_smem + p.num_rows;  // [num_rows]
  const int R = p.num_rows;
  const int bm = p.block_m;
  for (int e = threadIdx.x; e < R; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < p.pairs; i += blockDim.x) {
    const int e = p.slot_ids[i];
    if (e >= 0 && e < R) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // Warp 0 scans counts and token-block counts 32 rows at a time.
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int run = 0, block_run = 0;
    for (int base = 0; base < R; base += 32) {
      const int e = base + lane;
      const int c = e < R ? count[e] : 0;
      const int nb = (c + bm - 1) / bm;
      int inc_c = c, inc_nb = nb;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int uc = __shfl_up_sync(0xffffffffu, inc_c, off);
        const int unb = __shfl_up_sync(0xffffffffu, inc_nb, off);
        if (lane >= off) {
          inc_c += uc;
          inc_nb += unb;
        }
      }
      if (e < R) {
        const int off = run + inc_c - c;
        const int boff = block_run + inc_nb - nb;
        p.offsets[e] = off;
        cursor[e] = off;
        for (int j = 0; j < nb; ++j) {
          p.block_expert[boff + j] = e;
          p.block_start[boff + j] = off + j * bm;
        }
      }
      run += __shfl_sync(0xffffffffu, inc_c, 31);
      block_run += __shfl_sync(0xffffffffu, inc_nb, 31);
    }
    if (lane == 0) {
      p.offsets[R] = run;
      *p.num_blocks = block_run;
    }
  }
  __syncthreads();
  // Order inside a row is arbitrary (atomics); each pair's result does not depend on its position.
  for (int i = threadIdx.x; i < p.pairs; i += blockDim.x) {
    const int e = p.slot_ids[i];
    if (e >= 0 && e < R) p.perm[atomicAdd(&cursor[e], 1)] = i;
  }
}

// ----------------------------------------------------------------------------------------------
// 2./3. Grouped GEMMs on tensor cores
// ----------------------------------------------------------------------------------------------

constexpr int kGemmWarps = 4;  // split K
constexpr int kGemmThreads = kGemmWarps * 32;

// Shapes per token-block width NT (n8 tiles: block_m = 8 * NT):
//   MT: m16 tiles per CTA. gate_up: each m16 tile is 8 gate rows (j) + the matching 8 up rows
//       (I + j), so a lane holds both halves of its SwiGLU; the CTA covers 8 * MT j. down: 16 * MT
//       hidden rows.
//   U:  32-wide k chunks each warp loads before it multiplies (16-byte weight loads in flight per
//       thread: U * MT * 2); contiguous, so a warp reads U * 64 bytes of each row per step.
template <bool kFp8, bool kGateUp, int NT>
struct GemmShape;
template <>
struct GemmShape<false, true, 1> {
  static constexpr int MT = 1, U = 8;
};
template <>
struct GemmShape<false, true, 2> {
  static constexpr int MT = 1, U = 4;
};
template <>
struct GemmShape<false, true, 4> {
  static constexpr int MT = 2, U = 2;
};
template <>
struct GemmShape<false, false, 1> {
  static constexpr int MT = 2, U = 4;
};
template <>
struct GemmShape<false, false, 2> {
  static constexpr int MT = 2, U = 3;
};
template <>
struct GemmShape<false, false, 4> {
  static constexpr int MT = 2, U = 2;
};
// MXFP8 weights: the same tiles, U counted in 64-wide k chunks (a lane's 16 e4m3 of a row in one
// 16-byte load; see moe_gemm_kernel), so the same U holds twice the bf16 kernel's k a step in the
// same weight registers, and twice the activation registers. U even: a lane reads the scales of 2
// chunks as one 32-bit word.
template <>
struct GemmShape<true, true, 1> {
  static constexpr int MT = 1, U = 4;
};
template <>
struct GemmShape<true, true, 2> {
  static constexpr int MT = 1, U = 4;
};
template <>
struct GemmShape<true, true, 4> {
  static constexpr int MT = 2, U = 1;
};
template <>
struct GemmShape<true, false, 1> {
  static constexpr int MT = 2, U = 2;
};
template <>
struct GemmShape<true, false, 2> {
  static constexpr int MT = 2, U = 2;
};
template <>
struct GemmShape<true, false, 4> {
  static constexpr int MT = 2, U = 1;
};

template <bool kGateUp, int NT>
constexpr int rows_per_cta() {
  return kGateUp ? 8 * GemmShape<false, kGateUp, NT>::MT : 16 * GemmShape<false, kGateUp, NT>::MT;
}
static_assert(GemmShape<true, true, 1>::MT == GemmShape<false, true, 1>::MT &&
                  GemmShape<true, true, 2>::MT == GemmShape<false, true, 2>::MT &&
                  GemmShape<true, true, 4>::MT == GemmShape<false, true, 4>::MT &&
                  GemmShape<true, false, 1>::MT == GemmShape<false, false, 1>::MT &&
                  GemmShape<true, false, 2>::MT == GemmShape<false, false, 2>::MT &&
                  GemmShape<true, false, 4>::MT == GemmShape<false, false, 4>::MT,
              "the grid (rows_per_cta) must not depend on the weight format");

struct GemmParams {
  const void* w = nullptr;           // gate_up [R, 2I, H] or down [R, H, I]: bf16 bits, or e4m3 bytes with w_scale
  const uint8_t* w_scale = nullptr;  // MXFP8: E8M0 exponents [R, rows, K/32]
  const uint16_t* b = nullptr;       // x [T, H] (gate_up) or act [P, I] (down)
  const int32_t* perm = nullptr;
  const int32_t* offsets = nullptr;
  const int32_t* num_blocks = nullptr;
  const int32_t* block_expert = nullptr;
  const int32_t* block_start = nullptr;
  const float* slot_weights = nullptr;  // down: [P]
  uint16_t* act = nullptr;              // gate_up output [P, I]
  float* y = nullptr;                   // down output [P, H]
  int K = 0;                            // H for gate_up, I for down
  int rows = 0;                         // output rows: I (per half) for gate_up, H for down
  int slots = 0;
  int block_m = 32;
  int prefetch_row_bytes = 0;  // down: bytes of each weight row prefetched into L2 before the wait
  bool vec = false;            // K % 8 == 0 and 16-byte aligned bases: 16-byte loads
  bool scale_vec = false;      // MXFP8: (K/32) % 4 == 0 and a 4-byte aligned scale base: word loads
  bool w_vec16 = false;        // MXFP8: a 16-byte aligned weight base: 16-byte loads (else 2 x 8)
  // Plain linear (launch_fp8_linear): no block table (num_blocks == nullptr); token block b is rows
  // [b*bm, b*bm + bm) of b (the activations), expert 0, output row-major [linear_tokens, rows] into
  // y (fp32) or out_bf16; no slot weight.
  int linear_tokens = 0;
  uint16_t* out_bf16 = nullptr;
  // Plain linear, split k (moe_gemm_kernel's kSplitK; gridDim.z == k_splits > 1, launched as
  // clusters of k_splits CTAs along z): CTA z multiplies k chunks [z * split_chunks, (z + 1) *
  // split_chunks) and the cluster adds its CTAs' sums in z order through distributed shared memory.
  int k_splits = 1;
  int split_chunks = 0;
  float alpha = 1.702f;
  float limit = 7.0f;
};

// The E8M0 scales of chunks [c, c + 4) of one weight row, byte j = chunk c + j (127, i.e. 1.0, past
// the row's end: those chunks are never multiplied).
__device__ __forceinline__ uint32_t load_scale4(const uint8_t* row, int c, int num_chunks, bool vec) {
  if (vec) return c < num_chunks ? __ldg(reinterpret_cast<const uint32_t*>(row + c)) : 0x7f7f7f7fu;
  uint32_t v = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) v |= uint32_t(c + j < num_chunks ? __ldg(row + c + j) : 127) << (8 * j);
  return v;
}

__device__ __forceinline__ uint4 load8_masked(const uint16_t* row, int k, int K) {
  uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (k + j < K) v[j / 2] |= uint32_t(__ldg(row + k + j)) << (16 * (j & 1));
  return make_uint4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ uint4 load8_w(const uint16_t* row, int k, int K, bool vec) {
  if (vec && k + 8 <= K) return ld_weight16(row + k);
  return load8_masked(row, k, K);
}

__device__ __forceinline__ uint4 load8(const uint16_t* row, int k, int K, bool vec) {
  if (vec && k + 8 <= K) return __ldg(reinterpret_cast<const uint4*>(row + k));
  return load8_masked(row, k, K);
}

__device__ __forceinline__ uint16_t f32_to_bf16_bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

// kGateUp: act[pos, j] = swiglu(<x[tok], Wgu[e, j]>, <x[tok], Wgu[e, I + j]>) for the CTA's 8 * MT j.
// else:    y[pair, n] = w[pair] * <act[pos], Wd[e, n]> for the CTA's 16 * MT n (or, as a plain
//          linear, out[row, n] = <b[row], W[n]>).
// kFp8: the weights are MXFP8 (e4m3 bytes + E8M0 scale per 32 k), widened to bf16 in registers right
// before their mma; everything else (tiles, split-K, reduction order) is the bf16 kernel's.
// kSplitK (plain linears only): this CTA takes k split blockIdx.z of gridDim.z, and its cluster adds
// the splits (GemmParams::k_splits).
template <bool kFp8, bool kGateUp, int NT, bool kSplitK = false>
__global__ void __launch_bounds__(kGemmThreads, NT == 1 ? 4 : 3) moe_gemm_kernel(const GemmParams p) {
  static_assert(!kSplitK || !kGateUp, "k splits are for plain linears");
  constexpr int MT = GemmShape<kFp8, kGateUp, NT>::MT;
  constexpr int U = GemmShape<kFp8, kGateUp, NT>::U;
  constexpr int kWBytes = kFp8 ? 1 : 2;
  constexpr int kRows = rows_per_cta<kGateUp, NT>();
  __shared__ float red[kGemmWarps][MT * NT * 4][32];

  const int blk = blockIdx.x;
  const int row0 = blockIdx.y * kRows;
  if constexpr (!kGateUp) {
    // Before the wait: start this CTA's weight rows towards L2 while the gate_up GEMM finishes. The
    // block table is already complete (align finished before any gate_up CTA let this grid launch).
    if (p.prefetch_row_bytes > 0 && threadIdx.x < kRows && blk < *p.num_blocks &&
        (blk == 0 || p.block_expert[blk - 1] != p.block_expert[blk])) {
      const int e = p.block_expert[blk];
      const int r = min(row0 + int(threadIdx.x), p.rows - 1);
      const auto* ptr = static_cast<const uint8_t*>(p.w) + (size_t(e) * p.rows + r) * p.K * kWBytes;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(ptr), "r"(p.prefetch_row_bytes) : "memory");
    }
  }
  pdl_wait();
  pdl_trigger();
  int e, start, cnt;
  if (p.num_blocks == nullptr) {  // plain linear: fixed token blocks
    e = 0;
    start = blk * 8 * NT;
    if (start >= p.linear_tokens) return;
    cnt = min(8 * NT, p.linear_tokens - start);
  } else {
    if (blk >= *p.num_blocks) return;  // idle work item: fewer blocks than the worst case
    e = p.block_expert[blk];
    start = p.block_start[blk];
    cnt = min(8 * NT, p.offsets[e + 1] - start);
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int K = p.K;

  // Weight rows this lane loads: [m-tile][h], clamped into range. gate_up: h = 0 the gate row j,
  // h = 1 the up row I + j; down: rows g and g + 8 of the m-tile.
  const size_t expert_rows = kGateUp ? size_t(2) * p.rows : size_t(p.rows);
  const uint8_t* w_e = static_cast<const uint8_t*>(p.w) + size_t(e) * expert_rows * K * kWBytes;
  // A k chunk: 32 wide for bf16 weights (a lane's 8 consecutive k of a row: one 16-byte load), 64
  // for MXFP8 (a lane's 16 consecutive k: also one 16-byte load, so a warp's load covers 64 bytes of
  // each of its 8 rows, as with bf16, not 32: half the L2 requests a weight byte). A lane's 16 k lie
  // in one 32-wide scale block (2c + t / 2 of chunk c). Any k order works for the mma as long as A
  // and B use the same one: k = kChunk * c + kLaneK * t + i feeds the mma's k slots in order.
  constexpr int kChunk = kFp8 ? 64 : 32, kLaneK = kChunk / 4, kBWords = kLaneK / 8;
  const int num_chunks = (K + kChunk - 1) / kChunk;
  // This CTA's k chunks: all of them, or its split's (split_chunks is even, so a step's first chunk
  // stays even and the MXFP8 scale words below 4-block aligned).
  const int c_begin = kSplitK ? int(blockIdx.z) * p.split_chunks : 0;
  const int c_end = kSplitK ? min(num_chunks, c_begin + p.split_chunks) : num_chunks;
  const int scale_blocks = (K + 31) / 32;  // MXFP8: scale bytes a weight row
  const uint8_t* a_row[MT][2];
  const uint8_t* s_row[MT][2];  // MXFP8 only
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int r;
      if constexpr (kGateUp) {
        r = min(row0 + mt * 8 + g, p.rows - 1) + h * p.rows;
      } else {
        r = min(row0 + mt * 16 + g + 8 * h, p.rows - 1);
      }
      a_row[mt][h] = w_e + size_t(r) * K * kWBytes;
      if constexpr (kFp8) s_row[mt][h] = p.w_scale + (size_t(e) * expert_rows + r) * scale_blocks;
    }
  // Token columns: n-tile nt, column g; nullptr past the block's count (reads as zero).
  const uint16_t* b_row[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int c = nt * 8 + g;
    b_row[nt] = nullptr;
    if (c < cnt) {
      const size_t src_row = kGateUp ? size_t(p.perm[start + c] / p.slots) : size_t(start + c);
      b_row[nt] = p.b + src_row * K;
    }
  }

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.f;

  // The registers of a step: 16 weight bytes per (chunk, m-tile, row half), 8 bf16 activations per
  // (chunk, n-tile, 8 k), and for MXFP8 the scales, word i holding blocks 2 (base + 2i) .. + 3.
  constexpr int kScaleWords = kFp8 ? (U + 1) / 2 : 1;
  // Word loads of 4 scales need the block index 4-aligned: U % 2 == 0 (else byte loads).
  const bool scale_vec = p.scale_vec && U % 2 == 0;
  for (int base = c_begin + warp * U; base < c_end; base += kGemmWarps * U) {
    uint4 a[U][MT][2];
    uint4 b[U][NT][kBWords];
    uint32_t sc[kScaleWords][MT][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int chunk = base + u;
      const int k = chunk * kChunk + kLaneK * t;  // >= K past the last chunk: masked loads give zeros
      // MXFP8: K % 32 == 0, so a lane's 16 k are all in the row or all past it.
      const bool live = chunk < c_end && (!kFp8 || k < K);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kFp8) {
            const uint8_t* ptr = a_row[mt][h] + k;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (live && p.w_vec16) {
              v = ld_weight16(reinterpret_cast<const uint16_t*>(ptr));
            } else if (live) {
              const uint2 lo = ld_weight8(ptr), hi = ld_weight8(ptr + 8);
              v = make_uint4(lo.x, lo.y, hi.x, hi.y);
            }
            a[u][mt][h] = v;
          } else {
            a[u][mt][h] =
                live ? load8_w(reinterpret_cast<const uint16_t*>(a_row[mt][h]), k, K, p.vec) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < kBWords; ++i)
          b[u][nt][i] = (live && b_row[nt]) ? load8(b_row[nt], k + 8 * i, K, p.vec) : make_uint4(0, 0, 0, 0);
    }
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < kScaleWords; ++i)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            sc[i][mt][h] = load_scale4(s_row[mt][h], 2 * (base + 2 * i), scale_blocks, scale_vec);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u >= c_end) break;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < kBWords; ++i) {
          uint4 ra, rb;  // rows g and g + 8 as bf16, the lane's k 8i .. 8i + 7
          if constexpr (kFp8) {
            const int shift = 8 * (2 * (u % 2) + (t >> 1));  // block 2 chunk + t / 2 in its word
            const uint4 wa = a[u][mt][0], wb = a[u][mt][1];
            ra = dequant_e4m3x8(i ? make_uint2(wa.z, wa.w) : make_uint2(wa.x, wa.y),
                                (sc[u / 2][mt][0] >> shift) & 0xffu);
            rb = dequant_e4m3x8(i ? make_uint2(wb.z, wb.w) : make_uint2(wb.x, wb.y),
                                (sc[u / 2][mt][1] >> shift) & 0xffu);
          } else {
            ra = a[u][mt][0];
            rb = a[u][mt][1];
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if (nt * 8 >= cnt) break;  // warp-uniform: empty n-tiles cost nothing
            mma_bf16_16816(acc[mt][nt], ra.x, rb.x, ra.y, rb.y, b[u][nt][i].x, b[u][nt][i].y);
            mma_bf16_16816(acc[mt][nt], ra.z, rb.z, ra.w, rb.w, b[u][nt][i].z, b[u][nt][i].w);
          }
        }
      }
    }
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) red[warp][(mt * NT + nt) * 4 + q][lane] = acc[mt][nt][q];
  __syncthreads();
  // after this barrier: red holds every warp's partial sums over its k chunks; summed in warp order.

  // C element q of lane l is row (l >> 2) + 8 * (q >= 2) of the m-tile, column 2 * (l & 3) + (q & 1)
  // of the n-tile.
  if constexpr (kGateUp) {
    // Items (mt, nt, q < 2, lane): gate in element q, up in element q + 2 of the same lane.
    constexpr int kItems = MT * NT * 2 * 32;
    for (int item = threadIdx.x; item < kItems; item += kGemmThreads) {
      const int l = item & 31, rest = item >> 5;
      const int q = rest & 1, nt = (rest >> 1) % NT, mt = (rest >> 1) / NT;
      const int col = nt * 8 + 2 * (l & 3) + q;
      const int j = row0 + mt * 8 + (l >> 2);
      if (col >= cnt || j >= p.rows) continue;
      const int f = (mt * NT + nt) * 4 + q;
      float gate = 0.f, up = 0.f;
#pragma unroll
      for (int wi = 0; wi < kGemmWarps; ++wi) {
        gate += red[wi][f][l];
        up += red[wi][f + 2][l];
      }
      p.act[size_t(start + col) * p.rows + j] = f32_to_bf16_bits(swiglu_oai(gate, up, p.alpha, p.limit));
    }
  } else {
    constexpr int kItems = MT * NT * 4 * 32;
    // Where an item's sum goes (its token column and output row); false past the block's tokens or rows.
    auto place = [&](int item, int& col, int& n) {
      const int l = item & 31, rest = item >> 5;
      const int q = rest & 3, nt = (rest >> 2) % NT, mt = (rest >> 2) / NT;
      col = nt * 8 + 2 * (l & 3) + (q & 1);
      n = row0 + mt * 16 + (l >> 2) + 8 * (q >> 1);
      return col < cnt && n < p.rows;
    };
    auto store_linear = [&](int col, int n, float s) {
      const size_t at = size_t(start + col) * p.rows + n;
      if (p.out_bf16)
        p.out_bf16[at] = f32_to_bf16_bits(s);
      else
        p.y[at] = s;
    };
    auto warps_sum = [&](int item) {
      const int l = item & 31, f = item >> 5;
      float s = 0.f;
#pragma unroll
      for (int wi = 0; wi < kGemmWarps; ++wi) s += red[wi][f][l];
      return s;
    };
    if constexpr (kSplitK) {
      // The CTA's sums of every item into its shared memory; the cluster's CTAs then each finish a
      // share of the items, adding the CTAs' sums in rank (= k split) order: the bits do not depend
      // on which CTA adds them.
      __shared__ float split_sum[kItems];
      for (int item = threadIdx.x; item < kItems; item += kGemmThreads) split_sum[item] = warps_sum(item);
      namespace cg = cooperative_groups;
      cg::cluster_group cluster = cg::this_cluster();
      cluster.sync();  // every CTA's sums are in its shared memory
      const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
      const int share = (kItems + splits - 1) / splits;
      for (int item = rank * share + threadIdx.x; item < min(kItems, (rank + 1) * share); item += kGemmThreads) {
        int col, n;
        if (!place(item, col, n)) continue;
        float s = 0.f;
        for (int z = 0; z < splits; ++z) s += cluster.map_shared_rank(split_sum, z)[item];
        store_linear(col, n, s);
      }
      cluster.sync();  // no CTA leaves while another still reads its shared memory
    } else {
      for (int item = threadIdx.x; item < kItems; item += kGemmThreads) {
        int col, n;
        if (!place(item, col, n)) continue;
        const float s = warps_sum(item);
        if (p.num_blocks == nullptr) {  // plain linear
          store_linear(col, n, s);
        } else {
          const int pair = p.perm[start + col];
          p.y[size_t(pair) * p.rows + n] = p.slot_weights[pair] * s;
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// 4. Combine
// ----------------------------------------------------------------------------------------------

constexpr int kCombineThreads = 256;
constexpr int kCombineVec = 4;  // hidden values per thread

struct CombineParams {
  const float* y = nullptr;  // [P, H], weighted
  const int32_t* slot_ids = nullptr;
  uint16_t* out = nullptr;  // [T, H] bf16 bits
  int slots = 0;
  int hidden = 0;
  int num_rows = 0;
  bool vec = false;  // hidden % 4 == 0 and out 8-byte aligned
  float scale = 1.f;
};

// Grid (T, hidden chunks of 1024): every thread sums 4 hidden values over the slots, in slot order.
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const CombineParams p) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  bool bad = false;
  for (int s = 0; s < p.slots; ++s) {
    const int e = p.slot_ids[size_t(t) * p.slots + s];
    bad |= e < 0 || e >= p.num_rows;
  }
  const float* y = p.y + size_t(t) * p.slots * p.hidden;
  const int h0 = (blockIdx.y * kCombineThreads + threadIdx.x) * kCombineVec;
  if (h0 >= p.hidden) return;
  float acc[kCombineVec] = {0.f, 0.f, 0.f, 0.f};
  if (p.vec) {
    for (int s = 0; s < p.slots; ++s) {
      const float4 v = *reinterpret_cast<const float4*>(y + size_t(s) * p.hidden + h0);
      acc[0] += v.x;
      acc[1] += v.y;
      acc[2] += v.z;
      acc[3] += v.w;
    }
    uint32_t lo = 0, hi = 0;
    uint16_t o[kCombineVec];
#pragma unroll
    for (int i = 0; i < kCombineVec; ++i) o[i] = f32_to_bf16_bits(bad ? __int_as_float(0x7fc00000) : acc[i] * p.scale);
    lo = uint32_t(o[0]) | (uint32_t(o[1]) << 16);
    hi = uint32_t(o[2]) | (uint32_t(o[3]) << 16);
    *reinterpret_cast<uint2*>(p.out + size_t(t) * p.hidden + h0) = make_uint2(lo, hi);
  } else {
    for (int i = 0; i < kCombineVec && h0 + i < p.hidden; ++i) {
      float a = 0.f;
      for (int s = 0; s < p.slots; ++s) a += y[size_t(s) * p.hidden + h0 + i];
      p.out[size_t(t) * p.hidden + h0 + i] = f32_to_bf16_bits(bad ? __int_as_float(0x7fc00000) : a * p.scale);
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Baseline helpers (bench only)
// ----------------------------------------------------------------------------------------------

__global__ void scatter_add_weighted_kernel(const float* y, const int32_t* token, const float* w, int hidden,
                                            float* acc) {
  const int r = blockIdx.y;
  const float wr = w[r];
  float* dst = acc + size_t(token[r]) * hidden;
  const float* src = y + size_t(r) * hidden;
  for (int h = blockIdx.x * blockDim.x + threadIdx.x; h < hidden; h += gridDim.x * blockDim.x)
    atomicAdd(dst + h, wr * src[h]);
}

__global__ void f32_to_bf16_kernel(const float* in, uint16_t* out, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = f32_to_bf16_bits(in[i] * scale);
}

template <bool kGateUp>
void launch_gemm(int nt, const GemmParams& gp, unsigned blocks, int rows_total, KernelStream on) {
  auto go = [&](auto kernel, int rows_per) {
    const dim3 grid(blocks, unsigned((rows_total + rows_per - 1) / rows_per));
    check_arg(grid.y <= 65535, "launch_moe: inter or hidden too large for the grid");
    launch_pdl(kernel, grid, dim3(kGemmThreads), 0, on, gp);
  };
  const bool fp8 = gp.w_scale != nullptr;
  if (nt == 1)
    go(fp8 ? moe_gemm_kernel<true, kGateUp, 1> : moe_gemm_kernel<false, kGateUp, 1>, rows_per_cta<kGateUp, 1>());
  else if (nt == 2)
    go(fp8 ? moe_gemm_kernel<true, kGateUp, 2> : moe_gemm_kernel<false, kGateUp, 2>, rows_per_cta<kGateUp, 2>());
  else
    go(fp8 ? moe_gemm_kernel<true, kGateUp, 4> : moe_gemm_kernel<false, kGateUp, 4>, rows_per_cta<kGateUp, 4>());
}

// A plain linear's grouped GEMM (GemmParams::linear_tokens), its k split over clusters of
// gp.k_splits CTAs along z when gp.k_splits > 1 (the CTAs of a cluster add their sums through
// distributed shared memory, moe_gemm_kernel).
template <bool kFp8>
void launch_linear_gemm(int nt, const GemmParams& gp, unsigned token_blocks, KernelStream on) {
  auto go = [&](auto kernel, int rows_per) {
    const dim3 grid(token_blocks, unsigned((gp.rows + rows_per - 1) / rows_per), unsigned(gp.k_splits));
    check_arg(grid.y <= 65535, "a linear on the grouped GEMM: N too large for the grid");
    launch_pdl_clusters(kernel, grid, dim3(kGemmThreads), 0, on, unsigned(gp.k_splits), gp);
  };
  const bool split = gp.k_splits > 1;
  if (nt == 1)
    go(split ? moe_gemm_kernel<kFp8, false, 1, true> : moe_gemm_kernel<kFp8, false, 1>, rows_per_cta<false, 1>());
  else if (nt == 2)
    go(split ? moe_gemm_kernel<kFp8, false, 2, true> : moe_gemm_kernel<kFp8, false, 2>, rows_per_cta<false, 2>());
  else
    go(split ? moe_gemm_kernel<kFp8, false, 4, true> : moe_gemm_kernel<kFp8, false, 4>, rows_per_cta<false, 4>());
}

// The k split of a plain linear: where its token blocks x row tiles leave most of the GPU idle
// (decode-sized M against a narrow N: a tp-8 rank's k_proj is 128 rows, 4 tiles of 32), the k range
// is cut over up to kMaxLinearSplits CTAs a tile, as long as each keeps a whole step (4 warps x U
// chunks) of work. Returns the split count; *split_chunks the chunks each takes (even).
constexpr int kMaxLinearSplits = int(kPortableClusterSize);
int choose_linear_splits(int64_t tiles, int num_chunks, int chunks_per_step, int* split_chunks) {
  const int target = 2 * sm_count();  // two resident CTAs an SM: enough loads in flight for a weight stream
  int splits = 1;
  while (splits < kMaxLinearSplits && tiles * splits < target && num_chunks / (2 * splits) >= chunks_per_step)
    splits *= 2;
  *split_chunks = ((num_chunks + splits - 1) / splits + 1) / 2 * 2;
  return splits;
}

// MXFP8 operands the kernels can read: K a multiple of 32 (whole scale blocks, whole 8-byte loads),
// 8-byte aligned weights.
void check_fp8_operands(const void* w, const uint8_t* scale, int K, const char* what) {
  check_arg(scale != nullptr, std::string(what) + ": MXFP8 weights need their scales");
  check_arg(K % 32 == 0, std::string(what) + ": MXFP8 weights need K % 32 == 0");
  check_arg((reinterpret_cast<uintptr_t>(w) & 7u) == 0, std::string(what) + ": MXFP8 weights must be 8-byte aligned");
}
bool scale_words_ok(const uint8_t* scale, int K) {
  return (K / 32) % 4 == 0 && (reinterpret_cast<uintptr_t>(scale) & 3u) == 0;
}

void check_route(const RouteKernelParams& p, const std::string& who) {
  check_arg(p.num_tokens >= 0, who + ": num_tokens < 0");
  check_arg(p.num_tokens == 0 || (p.logits && p.bias && p.slot_ids && p.slot_weights),
            who + ": routing needs logits, bias, slot ids and slot weights");
  check_arg(p.num_experts >= 1 && p.num_experts <= 32 * kRouteMaxPerLane, who + ": num_experts must be in [1, 256]");
  check_arg(p.top_k >= 1 && p.top_k <= 32 && p.top_k <= p.num_experts,
            who + ": top_k must be in [1, min(32, num_experts)]");
  check_arg(p.num_shared >= 0, who + ": num_shared < 0");
  check_arg(!p.routed_flags || p.num_real_tokens, who + ": routed_flags need num_real_tokens");
}

// A plain linear on the grouped GEMM: x [M, K] times w [N, K] (bf16, or MXFP8 with w_scale), into
// out (fp32 or bf16), in token blocks of block_m, its k split where the tiles are few
// (choose_linear_splits). PDL as launch_moe uses it: up to 64 tokens.
struct GemmLinear {
  const __nv_bfloat16* x;
  const void* w;
  const uint8_t* w_scale;  // MXFP8 only
  void* out;
  bool out_f32;
  int M, N, K;
};
template <bool kFp8>
void launch_gemm_linear(const GemmLinear& l, int block_m, KernelStream on) {
  const int nt = block_m / 8;
  GemmParams gp;
  gp.w = l.w;
  gp.w_scale = l.w_scale;
  if constexpr (kFp8) {
    gp.scale_vec = scale_words_ok(l.w_scale, l.K);
    gp.w_vec16 = aligned16(l.w);
  }
  gp.b = reinterpret_cast<const uint16_t*>(l.x);
  gp.K = l.K;
  gp.rows = l.N;
  gp.block_m = block_m;
  // bf16 weights take 16-byte loads only when every row starts 16-byte aligned (MXFP8's own checks
  // are w_vec16 and scale_vec).
  gp.vec = l.K % 8 == 0 && aligned16(l.x) && (kFp8 || aligned16(l.w));
  gp.linear_tokens = l.M;
  if (l.out_f32)
    gp.y = static_cast<float*>(l.out);
  else
    gp.out_bf16 = static_cast<uint16_t*>(l.out);
  const unsigned blocks = unsigned((l.M + block_m - 1) / block_m);
  static_assert(rows_per_cta<false, 1>() == rows_per_cta<false, 2>() &&
                rows_per_cta<false, 2>() == rows_per_cta<false, 4>());
  constexpr int kLinearRows = rows_per_cta<false, 1>();  // output rows a CTA, whatever the token block
  const int step_u = nt == 1   ? GemmShape<kFp8, false, 1>::U
                     : nt == 2 ? GemmShape<kFp8, false, 2>::U
                               : GemmShape<kFp8, false, 4>::U;
  constexpr int kChunk = kFp8 ? 64 : 32;  // k a chunk (moe_gemm_kernel)
  const int64_t tiles = int64_t(blocks) * ((l.N + kLinearRows - 1) / kLinearRows);
  gp.k_splits = choose_linear_splits(tiles, (l.K + kChunk - 1) / kChunk, kGemmWarps * step_u, &gp.split_chunks);
  launch_linear_gemm<kFp8>(nt, gp, blocks, on.with_pdl(l.M <= 64));
}

}  // namespace

void launch_route(const RouteKernelParams& p, KernelStream on) {
  check_route(p, "launch_route");
  if (p.num_tokens == 0) return;
  const int blocks = (p.num_tokens + kRouteWarps - 1) / kRouteWarps;
  launch_pdl(route_kernel, dim3(unsigned(blocks)), dim3(kRouteWarps * 32), 0, on, p);
}

size_t moe_workspace_bytes(int max_tokens, int slots, int hidden, int inter, int num_rows) {
  return workspace_layout(max_tokens, slots, hidden, inter, num_rows).total;
}

void launch_moe(const MoeKernelParams& p, KernelStream on) {
  check_arg(p.num_tokens >= 0 && p.slots >= 1 && p.hidden >= 1 && p.inter >= 1,
            "launch_moe: need num_tokens >= 0, slots >= 1, hidden >= 1, inter >= 1");
  check_arg(p.num_rows >= 1 && p.num_rows <= kMaxAlignRows, "launch_moe: num_rows must be in [1, 4096]");
  check_arg(int64_t(p.num_tokens) * p.slots <= (int64_t(1) << 30), "launch_moe: too many (token, slot) pairs");
  if (p.num_tokens == 0) return;
  const WorkspaceLayout l = workspace_layout(p.num_tokens, p.slots, p.hidden, p.inter, p.num_rows);
  check_arg(p.workspace != nullptr && p.workspace_bytes >= l.total && aligned16(p.workspace),
            "launch_moe: workspace missing, misaligned or smaller than moe_workspace_bytes(num_tokens, ...)");
  check_arg(p.out != static_cast<const void*>(p.x), "launch_moe: out must not alias x");
  const bool fp8 = p.gate_up_scale != nullptr || p.down_scale != nullptr;
  if (fp8) {
    check_fp8_operands(p.gate_up, p.gate_up_scale, p.hidden, "launch_moe gate_up");
    check_fp8_operands(p.down, p.down_scale, p.inter, "launch_moe down");
  }
  check_arg(l.max_blocks <= 0x7fffffff, "launch_moe: too many token blocks");

  std::byte* ws = static_cast<std::byte*>(p.workspace);
  auto* offsets = reinterpret_cast<int32_t*>(ws + l.offsets);
  auto* num_blocks = reinterpret_cast<int32_t*>(ws + l.num_blocks);
  auto* block_expert = reinterpret_cast<int32_t*>(ws + l.block_expert);
  auto* block_start = reinterpret_cast<int32_t*>(ws + l.block_start);
  auto* perm = reinterpret_cast<int32_t*>(ws + l.perm);
  auto* act = reinterpret_cast<uint16_t*>(ws + l.act);
  auto* y = reinterpret_cast<float*>(ws + l.y);
  const int pairs = p.num_tokens * p.slots;

  const bool route_here = p.route.logits != nullptr;
  if (route_here) {
    check_route(p.route, "launch_moe's routing");
    check_arg(p.route.num_tokens == p.num_tokens && p.route.top_k + p.route.num_shared == p.slots &&
                  p.route.slot_ids == p.slot_ids && p.route.slot_weights == p.slot_weights,
              "launch_moe: its routing must write this layer's slot ids and weights, for its tokens and slots");
  }
  if (p.tuning.single_token_gemv && moe_gemv_fits(p)) {
    launch_moe_gemv(p, act, on.with_pdl(p.tuning.pdl));  // routes inside its kernels when route_here
    return;
  }
  if (route_here) launch_route(p.route, on);

  // Measured on an H200 (docs/PERF.md): 8-pair blocks are fastest up to 64 tokens, 16 at 128, 32
  // beyond; PDL gains ~3 us at small batches and loses up to 6% at 128+ tokens (I = 3072); the down
  // prefetch pays only at a single token.
  MoeTuning tune = p.tuning;
  // The few-token GEMVs beat the grouped GEMMs only where the GEMM's tiles are slowest: widening
  // MXFP8 at 2-4 tokens (bf16 and 5-8 tokens measured slower on them: docs/PERF.md).
  const bool batch_gemv =
      tune.batch_gemv && moe_gemv_batch_fits(p) && (!tune.auto_select || (fp8 && p.num_tokens <= 4));
  int block_m = tune.block_m;
  if (block_m != 8 && block_m != 16 && block_m != 32) block_m = p.num_tokens <= 64 ? 8 : p.num_tokens <= 128 ? 16 : 32;
  if (batch_gemv) block_m = kMoeGemvBlockPairs;  // one block per chosen row: what the few-token GEMVs read
  if (tune.auto_select) {
    tune.pdl = tune.pdl && p.num_tokens <= 64;
    if (p.num_tokens > 1) tune.down_prefetch_bytes = 0;
  }
  const int nt = block_m / 8;
  const int64_t blocks = max_token_blocks(pairs, p.num_rows, block_m);  // <= l.max_blocks

  AlignParams ap;
  ap.slot_ids = p.slot_ids;
  ap.offsets = offsets;
  ap.num_blocks = num_blocks;
  ap.block_expert = block_expert;
  ap.block_start = block_start;
  ap.perm = perm;
  ap.pairs = pairs;
  ap.num_rows = p.num_rows;
  ap.block_m = block_m;
  launch_pdl(moe_align_kernel, dim3(1), dim3(kAlignThreads), size_t(2) * p.num_rows * sizeof(int32_t),
             on.with_pdl(tune.pdl), ap);
  if (batch_gemv) {
    launch_moe_gemv_batch(p, {offsets, num_blocks, block_expert, block_start, perm}, block_m, act,
                          on.with_pdl(tune.pdl));
    return;
  }

  GemmParams gp;
  gp.perm = perm;
  gp.offsets = offsets;
  gp.num_blocks = num_blocks;
  gp.block_expert = block_expert;
  gp.block_start = block_start;
  gp.slots = p.slots;
  gp.block_m = block_m;
  gp.alpha = p.alpha;
  gp.limit = p.limit;

  // gate_up + SwiGLU: K = hidden, rows = inter per half.
  gp.w = p.gate_up;
  gp.w_scale = p.gate_up_scale;
  gp.scale_vec = fp8 && scale_words_ok(p.gate_up_scale, p.hidden);
  gp.w_vec16 = aligned16(p.gate_up);
  gp.b = reinterpret_cast<const uint16_t*>(p.x);
  gp.act = act;
  gp.K = p.hidden;
  gp.rows = p.inter;
  gp.vec = p.hidden % 8 == 0 && aligned16(p.gate_up) && aligned16(p.x);
  launch_gemm<true>(nt, gp, unsigned(blocks), p.inter, on.with_pdl(tune.pdl));

  // down, times the slot weight: K = inter, rows = hidden.
  gp.w = p.down;
  gp.w_scale = p.down_scale;
  gp.scale_vec = fp8 && scale_words_ok(p.down_scale, p.inter);
  gp.w_vec16 = aligned16(p.down);
  gp.b = act;
  gp.act = nullptr;
  gp.y = y;
  gp.slot_weights = p.slot_weights;
  gp.K = p.inter;
  gp.rows = p.hidden;
  gp.vec = p.inter % 8 == 0 && aligned16(p.down);  // act rows: 256-aligned region, stride inter*2
  if (gp.vec && tune.pdl && tune.down_prefetch_bytes > 0) {
    const int64_t per_row = std::min<int64_t>(int64_t(p.inter) * (fp8 ? 1 : 2), tune.down_prefetch_bytes / 32);
    gp.prefetch_row_bytes = int(per_row / 16 * 16);
  }
  launch_gemm<false>(nt, gp, unsigned(blocks), p.hidden, on.with_pdl(tune.pdl));

  CombineParams cp;
  cp.y = y;
  cp.slot_ids = p.slot_ids;
  cp.out = reinterpret_cast<uint16_t*>(p.out);
  cp.slots = p.slots;
  cp.hidden = p.hidden;
  cp.num_rows = p.num_rows;
  cp.vec = p.hidden % 4 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 7u) == 0;
  cp.scale = p.scale;
  const unsigned chunks = unsigned((p.hidden + kCombineThreads * kCombineVec - 1) / (kCombineThreads * kCombineVec));
  check_arg(chunks <= 65535, "launch_moe: hidden too large for the combine grid");
  launch_pdl(moe_combine_kernel, dim3(unsigned(p.num_tokens), chunks), dim3(kCombineThreads), 0, on.with_pdl(tune.pdl),
             cp);
}

void launch_fp8_linear(const Fp8LinearParams& p, KernelStream on) {
  check_arg(p.M >= 0 && p.N >= 1 && p.K >= 1, "launch_fp8_linear: need M >= 0, N >= 1, K >= 1");
  check_fp8_operands(p.w, p.w_scale, p.K, "launch_fp8_linear");
  check_arg(p.out != static_cast<const void*>(p.x), "launch_fp8_linear: out must not alias x");
  if (p.M == 0) return;
  GemvParams gemv;  // decode-sized M: the weight-streaming GEMV
  gemv.x = p.x;
  gemv.M = p.M;
  gemv.K = p.K;
  gemv.outputs[0] = {p.w, p.w_scale, p.out, p.out_f32, p.N};
  gemv.count = 1;
  if (gemv_fits(gemv)) {
    launch_gemv(gemv, on);
    return;
  }
  // The skinny linear up to 64 tokens: at the dense shapes of a tp-8 and a tp-4 rank up to 2x faster
  // than the grouped GEMM there (one shape 4% slower: the tp-8 o_proj at 16 tokens); at 128 it wins at
  // some shapes and loses at others (docs/PERF.md).
  if (const SkinnyLinearParams skinny{p.x, p.w, p.w_scale, p.out, p.out_f32, p.M, p.N, p.K};
      p.M <= kFp8SkinnyLinearMaxM && skinny_linear_fits(skinny)) {
    launch_skinny_linear(skinny, on);
    return;
  }
  launch_grouped_linear(p, on);
}

void launch_grouped_linear(const Fp8LinearParams& p, KernelStream on) {
  check_arg(p.M >= 0 && p.N >= 1 && p.K >= 1, "launch_grouped_linear: need M >= 0, N >= 1, K >= 1");
  check_fp8_operands(p.w, p.w_scale, p.K, "launch_grouped_linear");
  check_arg(p.out != static_cast<const void*>(p.x), "launch_grouped_linear: out must not alias x");
  if (p.M == 0) return;
  // The token block as launch_moe picks it for the same number of (token, expert) pairs (larger
  // blocks measured no faster here: docs/PERF.md).
  const int block_m = p.M <= 64 ? 8 : p.M <= 128 ? 16 : 32;
  launch_gemm_linear<true>({p.x, p.w, p.w_scale, p.out, p.out_f32, p.M, p.N, p.K}, block_m, on);
}

void launch_bf16_linear(const Bf16LinearParams& p, KernelStream on) {
  check_arg(p.M >= 0 && p.N >= 1 && p.K >= 1, "launch_bf16_linear: need M >= 0, N >= 1, K >= 1");
  check_arg(p.x != nullptr && p.w != nullptr && p.out != nullptr, "launch_bf16_linear: x, w and out must be set");
  check_arg(p.out != static_cast<const void*>(p.x), "launch_bf16_linear: out must not alias x");
  if (p.M == 0) return;
  const int block_m = p.M <= 8 ? 8 : p.M <= 16 ? 16 : 32;
  launch_gemm_linear<false>({p.x, p.w, nullptr, p.out, p.out_f32, p.M, p.N, p.K}, block_m, on);
}

void launch_scatter_add_weighted(const float* y, const int32_t* token, const float* w, int n, int hidden, float* acc,
                                 cudaStream_t stream) {
  if (n == 0) return;
  const dim3 grid(unsigned(std::min((hidden + 255) / 256, 64)), unsigned(n));
  scatter_add_weighted_kernel<<<grid, 256, 0, stream>>>(y, token, w, hidden, acc);
  CUDA_CHECK_LAUNCH();
}

void launch_f32_to_bf16(const float* in, __nv_bfloat16* out, int64_t n, float scale, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 4096);
  f32_to_bf16_kernel<<<unsigned(blocks), 256, 0, stream>>>(in, reinterpret_cast<uint16_t*>(out), n, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace tpmoe::cuda
