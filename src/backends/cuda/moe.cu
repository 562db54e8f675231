// The routed MoE layer on the GPU (SPEC §1.6, §1.8, §4 shared-expert fusion).
//
// Router: logits[T, E] (fp32) -> slot_ids/slot_weights[T, k + n]. One warp per token: sigmoid in
//   fp32, k rounds of a warp argmax of score + bias (ties to the lower id, as the CPU oracle),
//   weights = score / sum of the k chosen scores (summed in choice order, as the oracle), then the
//   n shared slots E..E+n-1 with weight shared_weight. E <= 256 (8 values per lane in registers).
//   Bytes: T*E*4 + E*4 read, T*(k+n)*8 written.
//
// Experts: four launches, all with grids computed from the arguments only (CUDA-graph safe; no host
// sync, no allocation):
//   1. align (one CTA): counts the (token, slot) pairs per physical expert row (num_rows bins, i.e.
//      routed + fused shared rows: binning by E would drop the shared slots), prefix-sums them into
//      offsets[num_rows + 1], cuts every row's pairs into token blocks of kBlockM = 32 pairs and
//      writes the block table (expert, first sorted position) and perm[P] (sorted position -> pair
//      index t*slots + s). Counts and scatter cursors live in shared memory only.
//   2. gate_up GEMM with SwiGLU-OAI fused into the epilogue: act[pos, I] (bf16, sorted order) =
//      swiglu(x[token(pos)] Wgu[e]^T).
//   3. down GEMM: y[pair, H] (fp32) = w[pair] * act[pos] Wdown[e]^T, stored by pair index.
//   4. combine: out[t, h] = bf16(scale * sum_s y[t*slots + s, h]), slots summed in slot order (as the
//      oracle: the result does not depend on how experts were scheduled).
//
// GEMM work decomposition: grid = (token block b, row tile). The number of token blocks is data
// dependent, so the grid is sized for the worst case, max_blocks = ceil(P/32) + min(P, num_rows)
// (sum over rows of ceil(c_e/32) <= P/32 + active rows), and a CTA whose b >= num_blocks (read on
// the device) exits at once. For decode (P = T*slots small) the row tiles carry the parallelism:
// gate_up tiles 16 intermediate rows (16 gate + the matching 16 up rows, so the SwiGLU epilogue has
// both halves), down tiles 32 hidden rows; at M3 shapes (I = 3072, H = 6144) that is 192 CTAs per
// active expert and launch, so even a single expert fills the 132 SMs. Inside a CTA the 4 warps split
// K in interleaved 32-wide chunks and reduce through shared memory in a fixed order (deterministic).
// Each CTA reads its weight rows once per token block: for decode (<= 32 pairs per expert) every
// weight element is read exactly once per expert; prefill re-reads a row tile once per 32 pairs, and
// those re-reads are adjacent in the grid (blockIdx.x runs over token blocks) so they hit L2.
//
// Tensor cores: mma.sync m16n8k16 bf16 -> fp32 through inline PTX, with weights as the A operand
// (16 output rows x 16 k) and tokens as the B operand (16 k x 8 tokens), i.e. the swapped-AB form
// that suits a handful of tokens. Both operands are loaded straight from global memory with 16-byte
// loads: lane (g = lane/4, t = lane%4) loads 8 consecutive k (k0 + 8t .. k0 + 8t + 7) of weight rows
// g and g + 8 and of token column g. The mma's k order is a permutation of that (logical k 2t+j ->
// physical 8t+j, 2t+8+j -> 8t+2+j for the first mma, +4 for the second); A and B use the same
// permutation, so the dot product is unchanged. Every weight sector fetched is used entirely.
// When K % 8 != 0 or a pointer is not 16-byte aligned, and for the tail of K, loads fall back to
// masked 2-byte loads; rows past I or H are clamped for loading and never stored; tokens past a
// block's count read as zero and are never stored.
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
// Measured on an H200 at M3 shapes (H 6144, I 3072, 129 rows, top-4 + 1 shared, whole launch_moe,
// weight bytes only): T=1 (5 rows) 0.215 ms = 2.6 TB/s; T=8 3.45 TB/s; T=64 3.6 TB/s; T=256 3.3 TB/s.
// The GEMM kernels use 141 registers, no spills (3 CTAs per SM).
//
// This is the first, correct version; tuning to the bandwidth limit (deeper load pipelines,
// L2 evict-first hints for weights, split-K for decode, fewer launches) is left for later.
#include "backends/cuda/moe.cuh"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "backends/cuda/cuda_check.h"

namespace tpmoe::cuda {

namespace {

// Host-side argument checks: the kernels' own files pull in no fmt, so a bad argument is reported as
// a CUDA invalid-value error that names the problem.
#define MOE_ARG_CHECK(cond, what)                                                                 \
  do {                                                                                            \
    if (!(cond)) ::tpmoe::cuda::throw_cuda_error(cudaErrorInvalidValue, what, __FILE__, __LINE__); \
  } while (0)

constexpr float kNegInf = -INFINITY;

// ----------------------------------------------------------------------------------------------
// Router
// ----------------------------------------------------------------------------------------------

constexpr int kRouteWarps = 4;
constexpr int kRouteMaxPerLane = 8;  // E <= 256

__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(const RouteKernelParams p) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kRouteWarps + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;
  const int E = p.num_experts;
  const float* logits = p.logits + size_t(t) * E;

  float score[kRouteMaxPerLane], choice[kRouteMaxPerLane];
#pragma unroll
  for (int i = 0; i < kRouteMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    score[i] = 0.f;
    choice[i] = kNegInf;
    if (e < E) {
      score[i] = 1.f / (1.f + expf(-logits[e]));  // as the oracle: fp32 sigmoid, precise expf
      choice[i] = score[i] + p.bias[e];           // the bias only chooses
    }
  }

  uint32_t taken = 0;  // bit i: expert lane + 32*i already chosen
  int my_id = 0;       // lane r < k holds the r-th choice
  float my_score = 0.f;
  float sum = 0.f;
  for (int r = 0; r < p.top_k; ++r) {
    float best_v = kNegInf, best_s = 0.f;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kRouteMaxPerLane; ++i) {
      const int e = lane + 32 * i;
      // Ids rise with i, so among equal values the first one seen (the lower id) is kept.
      if (e < E && !((taken >> i) & 1u) && (choice[i] > best_v || (choice[i] == best_v && e < best_e))) {
        best_v = choice[i];
        best_s = score[i];
        best_e = e;
      }
    }
    // Butterfly: every lane ends with the same (value, id); ties to the lower id.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, off);
      const float os = __shfl_xor_sync(0xffffffffu, best_s, off);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
      if (ov > best_v || (ov == best_v && oe < best_e)) {
        best_v = ov;
        best_s = os;
        best_e = oe;
      }
    }
    if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
    if (lane == r) {
      my_id = best_e;
      my_score = best_s;
    }
    sum += best_s;  // in choice order, as the oracle
  }

  const int slots = p.top_k + p.num_shared;
  int32_t* ids = p.slot_ids + size_t(t) * slots;
  float* w = p.slot_weights + size_t(t) * slots;
  if (lane < p.top_k) {
    ids[lane] = my_id;
    w[lane] = my_score / sum;
  }
  for (int i = lane; i < p.num_shared; i += 32) {
    ids[p.top_k + i] = E + i;
    w[p.top_k + i] = p.shared_weight;
  }
}

// ----------------------------------------------------------------------------------------------
// Workspace layout
// ----------------------------------------------------------------------------------------------

constexpr int kBlockM = 32;  // pairs per token block (4 mma n-tiles of 8)
constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int64_t max_token_blocks(int64_t pairs, int num_rows) {
  return (pairs + kBlockM - 1) / kBlockM + std::min<int64_t>(pairs, num_rows);
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
  int64_t max_blocks = 0;
};

WorkspaceLayout workspace_layout(int64_t tokens, int slots, int hidden, int inter, int num_rows) {
  const int64_t pairs = tokens * slots;
  WorkspaceLayout l;
  l.max_blocks = max_token_blocks(pairs, num_rows);
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
};

__global__ void __launch_bounds__(kAlignThreads) moe_align_kernel(const AlignParams p) {
  extern __shared__ int32_t align_smem[];
  int32_t* count = align_smem;                // [num_rows]
  int32_t* cursor = align_smem + p.num_rows;  // [num_rows]
  const int R = p.num_rows;
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
      const int nb = (c + kBlockM - 1) / kBlockM;
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
          p.block_start[boff + j] = off + j * kBlockM;
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
constexpr int kMT = 2;               // m16 tiles per warp: gate + up rows, or 2 x 16 hidden rows
constexpr int kNT = kBlockM / 8;     // n8 tiles: the token block
constexpr int kUnroll = 2;           // 32-wide k chunks in flight per warp
constexpr int kGateUpRowsPerCta = 16;
constexpr int kDownRowsPerCta = 32;

struct GemmParams {
  const uint16_t* w = nullptr;  // gate_up [R, 2I, H] or down [R, H, I] (bf16 bits)
  const uint16_t* b = nullptr;  // x [T, H] (gate_up) or act [P, I] (down)
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
  bool vec = false;  // K % 8 == 0 and 16-byte aligned bases: 16-byte loads
  float alpha = 1.702f;
  float limit = 7.0f;
};

__device__ __forceinline__ uint4 load8(const uint16_t* row, int k, int K, bool vec) {
  if (vec && k + 8 <= K) return __ldg(reinterpret_cast<const uint4*>(row + k));
  uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (k + j < K) v[j / 2] |= uint32_t(__ldg(row + k + j)) << (16 * (j & 1));
  return make_uint4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float swiglu_oai(float gate, float up, float alpha, float limit) {
  gate = fminf(gate, limit);
  up = fminf(fmaxf(up, -limit), limit);
  return (up + 1.f) * gate * (1.f / (1.f + expf(-alpha * gate)));
}

__device__ __forceinline__ uint16_t f32_to_bf16_bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

// kGateUp: act[pos, j] = swiglu(<x[tok], Wgu[e, j]>, <x[tok], Wgu[e, I + j]>) for the CTA's 16 j.
// else:    y[pair, n] = w[pair] * <act[pos], Wd[e, n]> for the CTA's 32 n.
template <bool kGateUp>
__global__ void __launch_bounds__(kGemmThreads) moe_gemm_kernel(const GemmParams p) {
  __shared__ float red[kGemmWarps][kMT * kNT * 4][32];

  const int blk = blockIdx.x;
  if (blk >= *p.num_blocks) return;  // idle work item: fewer blocks than the worst case
  const int e = p.block_expert[blk];
  const int start = p.block_start[blk];
  const int cnt = min(kBlockM, p.offsets[e + 1] - start);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int K = p.K;
  const int row0 = blockIdx.y * (kGateUp ? kGateUpRowsPerCta : kDownRowsPerCta);

  // Weight rows this lane loads: [m-tile][0: row g, 1: row g + 8], clamped into range.
  const size_t expert_rows = kGateUp ? size_t(2) * p.rows : size_t(p.rows);
  const uint16_t* w_e = p.w + size_t(e) * expert_rows * K;
  const uint16_t* a_row[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int local = g + 8 * h;
      int r = kGateUp ? min(row0 + local, p.rows - 1) + mt * p.rows : min(row0 + mt * 16 + local, p.rows - 1);
      a_row[mt][h] = w_e + size_t(r) * K;
    }
  // Token columns: n-tile nt, column g; nullptr past the block's count (reads as zero).
  const uint16_t* b_row[kNT];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    const int c = nt * 8 + g;
    b_row[nt] = nullptr;
    if (c < cnt) {
      const size_t src_row = kGateUp ? size_t(p.perm[start + c] / p.slots) : size_t(start + c);
      b_row[nt] = p.b + src_row * K;
    }
  }

  float acc[kMT][kNT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.f;

  const int num_chunks = (K + 31) / 32;
  for (int c0 = warp; c0 < num_chunks; c0 += kGemmWarps * kUnroll) {
    uint4 a[kUnroll][kMT][2], b[kUnroll][kNT];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = c0 + u * kGemmWarps;
      const int k = chunk * 32 + 8 * t;  // >= K past the last chunk: masked loads give zeros
      const bool live = chunk < num_chunks;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) a[u][mt][h] = live ? load8(a_row[mt][h], k, K, p.vec) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
        b[u][nt] = (live && b_row[nt]) ? load8(b_row[nt], k, K, p.vec) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (c0 + u * kGemmWarps >= num_chunks) break;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        if (nt * 8 >= cnt) break;  // warp-uniform: empty n-tiles cost nothing
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const uint4& ra = a[u][mt][0];  // row g
          const uint4& rb = a[u][mt][1];  // row g + 8
          mma_bf16_16816(acc[mt][nt], ra.x, rb.x, ra.y, rb.y, b[u][nt].x, b[u][nt].y);
          mma_bf16_16816(acc[mt][nt], ra.z, rb.z, ra.w, rb.w, b[u][nt].z, b[u][nt].w);
        }
      }
    }
  }

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) red[warp][(mt * kNT + nt) * 4 + q][lane] = acc[mt][nt][q];
  __syncthreads();
  // after this barrier: red holds every warp's partial sums over its k chunks.

  // Items (nt, q, lane of the C fragment); C element q of lane is row g + 8*(q >= 2), column
  // 2t + (q & 1) of the n-tile.
  constexpr int kItems = kNT * 4 * 32;
  for (int item = threadIdx.x; item < kItems; item += kGemmThreads) {
    const int l = item & 31, nq = item >> 5;
    const int nt = nq >> 2, q = nq & 3;
    const int col = nt * 8 + 2 * (l & 3) + (q & 1);
    if (col >= cnt) continue;
    const int local = (l >> 2) + 8 * (q >> 1);
    float v[kMT];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      float s = 0.f;
#pragma unroll
      for (int wi = 0; wi < kGemmWarps; ++wi) s += red[wi][(mt * kNT + nt) * 4 + q][l];
      v[mt] = s;
    }
    const int pos = start + col;
    if constexpr (kGateUp) {
      const int j = row0 + local;
      if (j < p.rows) p.act[size_t(pos) * p.rows + j] = f32_to_bf16_bits(swiglu_oai(v[0], v[1], p.alpha, p.limit));
    } else {
      const int pair = p.perm[pos];
      const float w = p.slot_weights[pair];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const int n = row0 + mt * 16 + local;
        if (n < p.rows) p.y[size_t(pair) * p.rows + n] = w * v[mt];
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// 4. Combine
// ----------------------------------------------------------------------------------------------

constexpr int kCombineThreads = 256;

struct CombineParams {
  const float* y = nullptr;  // [P, H], weighted
  const int32_t* slot_ids = nullptr;
  uint16_t* out = nullptr;  // [T, H] bf16 bits
  int slots = 0;
  int hidden = 0;
  int num_rows = 0;
  float scale = 1.f;
};

__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const CombineParams p) {
  const int t = blockIdx.x;
  bool bad = false;
  for (int s = 0; s < p.slots; ++s) {
    const int e = p.slot_ids[size_t(t) * p.slots + s];
    bad |= e < 0 || e >= p.num_rows;
  }
  const float* y = p.y + size_t(t) * p.slots * p.hidden;
  for (int h = threadIdx.x; h < p.hidden; h += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < p.slots; ++s) acc += y[size_t(s) * p.hidden + h];
    acc *= p.scale;
    p.out[size_t(t) * p.hidden + h] = f32_to_bf16_bits(bad ? __int_as_float(0x7fc00000) : acc);
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

void launch_route(const RouteKernelParams& p, cudaStream_t stream) {
  MOE_ARG_CHECK(p.num_tokens >= 0, "launch_route: num_tokens < 0");
  MOE_ARG_CHECK(p.num_experts >= 1 && p.num_experts <= 32 * kRouteMaxPerLane,
                "launch_route: num_experts must be in [1, 256]");
  MOE_ARG_CHECK(p.top_k >= 1 && p.top_k <= 32 && p.top_k <= p.num_experts,
                "launch_route: top_k must be in [1, min(32, num_experts)]");
  MOE_ARG_CHECK(p.num_shared >= 0, "launch_route: num_shared < 0");
  if (p.num_tokens == 0) return;
  const int blocks = (p.num_tokens + kRouteWarps - 1) / kRouteWarps;
  route_kernel<<<blocks, kRouteWarps * 32, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

size_t moe_workspace_bytes(int max_tokens, int slots, int hidden, int inter, int num_rows) {
  return workspace_layout(max_tokens, slots, hidden, inter, num_rows).total;
}

void launch_moe(const MoeKernelParams& p, cudaStream_t stream) {
  MOE_ARG_CHECK(p.num_tokens >= 0 && p.slots >= 1 && p.hidden >= 1 && p.inter >= 1,
                "launch_moe: need num_tokens >= 0, slots >= 1, hidden >= 1, inter >= 1");
  MOE_ARG_CHECK(p.num_rows >= 1 && p.num_rows <= kMaxAlignRows, "launch_moe: num_rows must be in [1, 4096]");
  MOE_ARG_CHECK(int64_t(p.num_tokens) * p.slots <= (int64_t(1) << 30), "launch_moe: too many (token, slot) pairs");
  if (p.num_tokens == 0) return;
  const WorkspaceLayout l = workspace_layout(p.num_tokens, p.slots, p.hidden, p.inter, p.num_rows);
  MOE_ARG_CHECK(p.workspace != nullptr && p.workspace_bytes >= l.total && aligned16(p.workspace),
                "launch_moe: workspace missing, misaligned or smaller than moe_workspace_bytes(num_tokens, ...)");
  MOE_ARG_CHECK(p.out != static_cast<const void*>(p.x), "launch_moe: out must not alias x");
  MOE_ARG_CHECK(l.max_blocks <= 0x7fffffff, "launch_moe: too many token blocks");

  std::byte* ws = static_cast<std::byte*>(p.workspace);
  auto* offsets = reinterpret_cast<int32_t*>(ws + l.offsets);
  auto* num_blocks = reinterpret_cast<int32_t*>(ws + l.num_blocks);
  auto* block_expert = reinterpret_cast<int32_t*>(ws + l.block_expert);
  auto* block_start = reinterpret_cast<int32_t*>(ws + l.block_start);
  auto* perm = reinterpret_cast<int32_t*>(ws + l.perm);
  auto* act = reinterpret_cast<uint16_t*>(ws + l.act);
  auto* y = reinterpret_cast<float*>(ws + l.y);
  const int pairs = p.num_tokens * p.slots;

  AlignParams ap;
  ap.slot_ids = p.slot_ids;
  ap.offsets = offsets;
  ap.num_blocks = num_blocks;
  ap.block_expert = block_expert;
  ap.block_start = block_start;
  ap.perm = perm;
  ap.pairs = pairs;
  ap.num_rows = p.num_rows;
  moe_align_kernel<<<1, kAlignThreads, size_t(2) * p.num_rows * sizeof(int32_t), stream>>>(ap);
  CUDA_CHECK_LAUNCH();

  GemmParams gp;
  gp.perm = perm;
  gp.offsets = offsets;
  gp.num_blocks = num_blocks;
  gp.block_expert = block_expert;
  gp.block_start = block_start;
  gp.slots = p.slots;
  gp.alpha = p.alpha;
  gp.limit = p.limit;

  // gate_up + SwiGLU: K = hidden, rows = inter per half.
  gp.w = reinterpret_cast<const uint16_t*>(p.gate_up);
  gp.b = reinterpret_cast<const uint16_t*>(p.x);
  gp.act = act;
  gp.K = p.hidden;
  gp.rows = p.inter;
  gp.vec = p.hidden % 8 == 0 && aligned16(p.gate_up) && aligned16(p.x);
  const dim3 grid_gu(unsigned(l.max_blocks), unsigned((p.inter + kGateUpRowsPerCta - 1) / kGateUpRowsPerCta));
  MOE_ARG_CHECK(grid_gu.y <= 65535, "launch_moe: inter too large for the grid");
  moe_gemm_kernel<true><<<grid_gu, kGemmThreads, 0, stream>>>(gp);
  CUDA_CHECK_LAUNCH();

  // down, times the slot weight: K = inter, rows = hidden.
  gp.w = reinterpret_cast<const uint16_t*>(p.down);
  gp.b = act;
  gp.act = nullptr;
  gp.y = y;
  gp.slot_weights = p.slot_weights;
  gp.K = p.inter;
  gp.rows = p.hidden;
  gp.vec = p.inter % 8 == 0 && aligned16(p.down);  // act rows: 256-aligned region, stride inter*2
  const dim3 grid_down(unsigned(l.max_blocks), unsigned((p.hidden + kDownRowsPerCta - 1) / kDownRowsPerCta));
  MOE_ARG_CHECK(grid_down.y <= 65535, "launch_moe: hidden too large for the grid");
  moe_gemm_kernel<false><<<grid_down, kGemmThreads, 0, stream>>>(gp);
  CUDA_CHECK_LAUNCH();

  CombineParams cp;
  cp.y = y;
  cp.slot_ids = p.slot_ids;
  cp.out = reinterpret_cast<uint16_t*>(p.out);
  cp.slots = p.slots;
  cp.hidden = p.hidden;
  cp.num_rows = p.num_rows;
  cp.scale = p.scale;
  moe_combine_kernel<<<p.num_tokens, kCombineThreads, 0, stream>>>(cp);
  CUDA_CHECK_LAUNCH();
}

}  // namespace tpmoe::cuda
