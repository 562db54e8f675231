// The single-token MoE path (moe_gemv.cuh). Both kernels stream weight rows with 16-byte loads (8 bf16
// or 16 e4m3 per lane and load), two steps of loads in flight per warp (pipeline()), fp32 sums in k
// order per lane, one warp reduction per row. x and act are small (L1-cached plain loads: act is the
// previous launch's output).
#include "backends/cuda/moe_gemv.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "backends/cuda/kernel_utils.cuh"
#include "backends/cuda/route_top_k.cuh"
#include "backends/cuda/weight_loads.cuh"

namespace tpmoe::cuda {

namespace {

constexpr int kWarps = 4;  // per block
// The slot-split down kernel: at most this many warps a block (one a slot), and slots a token.
constexpr int kMaxSlotWarps = 8, kMaxGemvSlots = 32;

struct MoeGemvParams {
  const uint16_t* x = nullptr;  // [hidden] bf16 bits
  const int32_t* slot_ids = nullptr;
  const float* slot_weights = nullptr;
  const uint8_t* gate_up = nullptr;  // [num_rows, 2 * inter, hidden], bf16 or e4m3
  const uint8_t* gate_up_scale = nullptr;
  const uint8_t* down = nullptr;  // [num_rows, hidden, inter]
  const uint8_t* down_scale = nullptr;
  uint16_t* act = nullptr;       // [slots, inter] bf16 bits
  __nv_bfloat16* out = nullptr;  // [hidden]
  int slots = 0, hidden = 0, inter = 0, num_rows = 0;
  float alpha = 0, limit = 0, scale = 1;
  RouteKernelParams route;  // route.logits set: the kernels route the token themselves
};

// Loads of one weight row: element k of row `row` (K elements) as 16 bytes, and the E8M0 scale of its
// 32-element block (MXFP8; 127 = 1.0 otherwise and past the row's end).
template <bool kFp8>
struct RowReader {
  const uint8_t* w;
  const uint8_t* scale;
  int K;
  __device__ RowReader(const uint8_t* base, const uint8_t* scale_base, size_t row, int K_)
      : w(base + row * size_t(K_) * (kFp8 ? 1 : 2)),
        scale(kFp8 ? scale_base + row * size_t(K_ / 32) : nullptr),
        K(K_) {}
  __device__ uint4 load(int k) const {
    return k < K ? ld_weight16(reinterpret_cast<const uint16_t*>(w + size_t(k) * (kFp8 ? 1 : 2)))
                 : make_uint4(0, 0, 0, 0);
  }
  __device__ uint32_t load_scale(int k) const { return kFp8 && k < K ? __ldg(scale + k / 32) : 127u; }
};

// acc + w . v over one 16-byte weight load at k: 8 bf16, or 16 e4m3 widened with their block scale.
// v holds the matching bf16 activations.
template <bool kFp8>
__device__ __forceinline__ float dot_load(uint4 w, uint32_t scale, const uint16_t* v, int k, float acc) {
  if constexpr (kFp8) {
    float wf[16];
    widen_e4m3x16(w, wf);
    return dot16_scaled(wf, *reinterpret_cast<const uint4*>(v + k), *reinterpret_cast<const uint4*>(v + k + 8),
                        e8m0_to_float(scale), acc);
  } else {
    return dot8(w, *reinterpret_cast<const uint4*>(v + k), acc);
  }
}

// The weight stream of a warp as a pipeline of `steps` steps of kLoads 16-byte loads per lane:
// load(t, w, sc) issues step t's loads (and MXFP8 scales), use(t, w, sc) multiplies them. Step t + 1
// is issued before step t is used, so two steps of loads are in flight. wait() runs once, after the
// first step is issued and before the first use (the PDL wait of a kernel whose activations are the
// previous launch's output).
template <int kLoads, class Load, class Use, class Wait>
__device__ __forceinline__ void pipeline(int steps, Load&& load, Use&& use, Wait&& wait) {
  uint4 w[kLoads];
  uint32_t sc[kLoads];
  if (steps > 0) load(0, w, sc);
  wait();
  for (int t = 0; t < steps; ++t) {
    uint4 cur[kLoads];
    uint32_t cur_sc[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      cur[i] = w[i];
      cur_sc[i] = sc[i];
    }
    if (t + 1 < steps) load(t + 1, w, sc);
    use(t, cur, cur_sc);
  }
}

// The PDL wait of a kernel that reaches it from more than one place (in its pipeline before the first
// use of the previous launch's output, and at its end for a warp that had no work): the first call
// waits and lets the next launch start, later ones do nothing.
struct PdlWaitOnce {
  bool waited = false;
  __device__ void operator()() {
    if (!waited) {
      pdl_wait();
      pdl_trigger();
      waited = true;
    }
  }
};

// The slots of the token, as the kernels see them: routed by the calling warp from the router's
// logits when the layer routes inside (all 32 lanes call), or read from slot_ids.
struct TokenSlots {
  RouteChoice choice;  // lane r < top_k: the r-th choice (routing inside)
  __device__ int row(const MoeGemvParams& p, int s) const {
    return p.route.logits != nullptr ? route_slot_row(p.route, choice, s) : p.slot_ids[s];
  }
  __device__ float weight(const MoeGemvParams& p, int s) const {
    if (p.route.logits == nullptr) return p.slot_weights[s];
    const float w = __shfl_sync(0xffffffffu, choice.weight, s < p.route.top_k ? s : 0);
    return s < p.route.top_k ? w : p.route.shared_weight;
  }
};
__device__ inline TokenSlots token_slots(const MoeGemvParams& p, int lane) {
  TokenSlots t;
  if (p.route.logits != nullptr) t.choice = route_top_k(p.route, 0, lane);
  return t;
}

// The gate and up rows of intermediate j of expert row e, as a pipeline's load step (pipeline()): step t
// of a lane whose first chunk is k_first, chunks `stride` apart, kLoads of each row a step.
template <bool kFp8, int kLoads>
struct GateUpRows {
  RowReader<kFp8> gate, up;
  int k_first, stride;
  __device__ GateUpRows(const MoeGemvParams& p, int e, int j, int k_first_, int stride_)
      : gate(p.gate_up, p.gate_up_scale, size_t(e) * 2 * p.inter + j, p.hidden),
        up(p.gate_up, p.gate_up_scale, size_t(e) * 2 * p.inter + p.inter + j, p.hidden),
        k_first(k_first_),
        stride(stride_) {}
  __device__ int k(int t, int i) const { return k_first + (t * kLoads + i) * stride; }
  __device__ void load(int t, uint4 (&w)[2 * kLoads], uint32_t (&sc)[2 * kLoads]) const {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      w[2 * i] = gate.load(k(t, i));
      w[2 * i + 1] = up.load(k(t, i));
      sc[2 * i] = gate.load_scale(k(t, i));
      sc[2 * i + 1] = up.load_scale(k(t, i));
    }
  }
};

// Both kernels run a grid no larger than what is resident at once (resident_grid) and loop over
// their work, so the routing inside is done once per warp, never once per row, and never in a
// second wave of blocks.
//
// gate_up: items (slot, j), j fastest (a slot's rows in order); kSplit warps of a block share an item,
// warp slice i taking the 16-byte chunks i, i + kSplit, ... of both rows (more warps in flight where
// there are few items: 1920 at the tp-8 width), their sums added in slice order.
// With routing inside, the items take the shared slots first: their rows are known without the
// router (the rows after the routed experts), so a warp whose item is a shared row issues its first
// loads before the PDL wait, under the router GEMV's tail, and routes the token itself (from the
// router's logits, the previous launch's output) only at its first routed item; block 0's first warp
// stores the slots at the end. The sums and the act row of an item do not depend on the order.
// Without routing inside, the slot ids come from the previous launch: read after the wait.
// bf16 is held to 7 blocks an SM (at most 72 registers; it compiles to 68 without spills, as before
// this order): unbounded, an experimental form of this loop kept its routing state in 84 registers,
// 6 blocks an SM, and measured 3.5% slower (docs/PERF.md).
template <bool kFp8, int kLoads, int kSplit>
__global__ void __launch_bounds__(kWarps* kWarp, kFp8 ? 1 : 7) moe_gate_up_gemv_kernel(const MoeGemvParams p) {
  constexpr int kPerLoad = kFp8 ? 16 : 8, kPass = kWarp * kPerLoad;
  constexpr int kItemsPerBlock = kWarps / kSplit;
  __shared__ float partial[kWarps][2];
  PdlWaitOnce wait_once;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, slice = warp % kSplit;
  const bool inside = p.route.logits != nullptr;
  const int first_shared = inside ? p.route.top_k : p.slots;  // slots [first_shared, slots): shared rows
  TokenSlots slots;
  bool routed = false;
  auto route_once = [&] {
    if (routed) return;
    wait_once();
    slots = token_slots(p, lane);
    routed = true;
  };
  const int items = p.slots * p.inter;
  const int stride = kSplit * kPass;                                       // k between a lane's chunks
  const int steps = (p.hidden + kLoads * stride - 1) / (kLoads * stride);  // of kLoads chunks per row
  for (int base = blockIdx.x * kItemsPerBlock; base < items; base += gridDim.x * kItemsPerBlock) {
    const int item = base + warp / kSplit;
    const int s = (item / p.inter + (inside ? first_shared : 0)) % p.slots, j = item % p.inter;
    const bool shared_row = s >= first_shared;
    if (item < items && !shared_row) route_once();
    const int e = item >= items ? -1 : shared_row ? p.route.num_experts + (s - first_shared) : slots.row(p, s);
    const bool live = e >= 0 && e < p.num_rows;  // else a routing bug: the down kernel writes NaN
    float g = 0.f, u = 0.f;
    if (live) {
      const GateUpRows<kFp8, kLoads> rows(p, e, j, slice * kPass + lane * kPerLoad, stride);
      pipeline<2 * kLoads>(
          steps, [&](int t, uint4(&w)[2 * kLoads], uint32_t(&sc)[2 * kLoads]) { rows.load(t, w, sc); },
          [&](int t, const uint4(&w)[2 * kLoads], const uint32_t(&sc)[2 * kLoads]) {
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {
              const int k = rows.k(t, i);
              if (k >= p.hidden) break;
              g = dot_load<kFp8>(w[2 * i], sc[2 * i], p.x, k, g);
              u = dot_load<kFp8>(w[2 * i + 1], sc[2 * i + 1], p.x, k, u);
            }
          },
          wait_once);
      g = warp_sum(g);
      u = warp_sum(u);
    }
    wait_once();  // before the item's stores (a no-op after the first)
    if constexpr (kSplit > 1) {
      if (lane == 0) {
        partial[warp][0] = g;
        partial[warp][1] = u;
      }
      __syncthreads();
      if (slice == 0) {
        g = u = 0.f;
        for (int i = 0; i < kSplit; ++i) {
          g += partial[warp + i][0];
          u += partial[warp + i][1];
        }
      }
      __syncthreads();  // partial is rewritten by the next item
    }
    if (live && slice == 0 && lane == 0)
      p.act[size_t(s) * p.inter + j] = __bfloat16_as_ushort(__float2bfloat16_rn(swiglu_oai(g, u, p.alpha, p.limit)));
  }
  wait_once();  // a warp without items waits too
  if (inside && blockIdx.x == 0 && threadIdx.x < kWarp) {
    route_once();
    store_route(p.route, 0, slots.choice, lane);
  }
}

// The down kernels' step on one slot's kRows rows n0.. (clamped to the last row; unused past it):
// load_down issues the 16-byte loads (and MXFP8 scales) of chunk k0 (this lane's first element),
// dot_down adds them times act[k] into acc. A slot row outside [0, num_rows) reads nothing.
template <bool kFp8, int kRows, int kLoads>
__device__ __forceinline__ void load_down(const MoeGemvParams& p, int e, int n0, int k0, uint4 (&w)[kRows * kLoads],
                                          uint32_t (&sc)[kRows * kLoads]) {
  constexpr int kPass = kWarp * (kFp8 ? 16 : 8);
  const bool live = e >= 0 && e < p.num_rows;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int n = min(n0 + r, p.hidden - 1);
    const RowReader<kFp8> row(p.down, p.down_scale, size_t(live ? e : 0) * p.hidden + n, live ? p.inter : 0);
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      w[r * kLoads + i] = row.load(k0 + i * kPass);
      sc[r * kLoads + i] = row.load_scale(k0 + i * kPass);
    }
  }
}
template <bool kFp8, int kRows, int kLoads>
__device__ __forceinline__ void dot_down(const MoeGemvParams& p, const uint16_t* act, int k0,
                                         const uint4 (&w)[kRows * kLoads], const uint32_t (&sc)[kRows * kLoads],
                                         float (&acc)[kRows]) {
  constexpr int kPass = kWarp * (kFp8 ? 16 : 8);
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int k = k0 + i * kPass;
    if (k >= p.inter) break;
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = dot_load<kFp8>(w[r * kLoads + i], sc[r * kLoads + i], act, k, acc[r]);
  }
}

// down: a warp takes kRows hidden rows at a time (row groups w, w + warps, ...) and walks every
// slot's rows of them in slot order, one pipeline over (slot, k chunk): out[n] = scale * sum_s w_s *
// (act[s] . Wdown[e_s][n]), the sums in slot order, all in registers. The slots are routed by each
// warp (from the logits) or read, either way before the PDL wait - the router's output is two
// launches back and therefore complete - and so are the first step's weights; act (the previous
// launch's output) is read after it.
template <bool kFp8, int kRows, int kLoads>
__global__ void __launch_bounds__(kWarps* kWarp) moe_down_gemv_kernel(const MoeGemvParams p) {
  constexpr int kPerLoad = kFp8 ? 16 : 8, kPass = kWarp * kPerLoad;
  const int lane = threadIdx.x % kWarp;
  const TokenSlots slots = token_slots(p, lane);
  PdlWaitOnce wait_once;
  const int chunks = (p.inter + kLoads * kPass - 1) / (kLoads * kPass);  // steps per slot
  const int groups = (p.hidden + kRows - 1) / kRows, warps = gridDim.x * kWarps;
  for (int group = blockIdx.x * kWarps + threadIdx.x / kWarp; group < groups; group += warps) {
    const int n0 = group * kRows;
    float acc[kRows] = {}, sum[kRows] = {};
    bool bad = false;  // a slot row outside [0, num_rows): the token's output is NaN
    pipeline<kRows * kLoads>(
        p.slots * chunks,
        [&](int t, uint4(&w)[kRows * kLoads], uint32_t(&sc)[kRows * kLoads]) {
          const int s = t / chunks, k0 = (t % chunks) * kLoads * kPass + lane * kPerLoad;
          load_down<kFp8, kRows, kLoads>(p, slots.row(p, s), n0, k0, w, sc);
        },
        [&](int t, const uint4(&w)[kRows * kLoads], const uint32_t(&sc)[kRows * kLoads]) {
          const int s = t / chunks, c = t % chunks, k0 = c * kLoads * kPass + lane * kPerLoad;
          dot_down<kFp8, kRows, kLoads>(p, p.act + size_t(s) * p.inter, k0, w, sc, acc);
          if (c == chunks - 1) {  // the slot's rows are done: weigh them in, in slot order
            const int e = slots.row(p, s);
            bad |= e < 0 || e >= p.num_rows;
            const float ws = slots.weight(p, s);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              sum[r] += ws * warp_sum(acc[r]);
              acc[r] = 0.f;
            }
          }
        },
        wait_once);
    float v = sum[0];
#pragma unroll
    for (int r = 1; r < kRows; ++r)
      if (lane == r) v = sum[r];
    if (lane < kRows && n0 + lane < p.hidden)
      p.out[n0 + lane] = __float2bfloat16_rn(bad ? __int_as_float(0x7fc00000) : p.scale * v);
  }
  wait_once();
}

// down where row groups are few (a narrow hidden: small models, tests): the walk above would leave
// most of the GPU idle, each warp's slots one chain. Here a block takes one row group and its warps
// split the slots (warp w: slots w, w + warps, ...; the block has at most `slots` warps, so each has
// one); each stores its rows' weighted sums to shared memory and, after the block's barrier, warp 0
// adds them in slot order: the bits of the walk above.
template <bool kFp8, int kRows, int kLoads>
__global__ void __launch_bounds__(kMaxSlotWarps* kWarp) moe_down_slots_gemv_kernel(const MoeGemvParams p) {
  constexpr int kPerLoad = kFp8 ? 16 : 8, kPass = kWarp * kPerLoad;
  __shared__ float part[kMaxGemvSlots][kRows];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int n0 = blockIdx.x * kRows;
  const TokenSlots slots = token_slots(p, lane);
  PdlWaitOnce wait_once;
  const int chunks = (p.inter + kLoads * kPass - 1) / (kLoads * kPass);  // steps per slot
  const int mine = (p.slots - warp + warps - 1) / warps;                 // this warp's slots
  float acc[kRows] = {};
  pipeline<kRows * kLoads>(
      mine * chunks,
      [&](int t, uint4(&w)[kRows * kLoads], uint32_t(&sc)[kRows * kLoads]) {
        const int s = warp + (t / chunks) * warps, k0 = (t % chunks) * kLoads * kPass + lane * kPerLoad;
        load_down<kFp8, kRows, kLoads>(p, slots.row(p, s), n0, k0, w, sc);
      },
      [&](int t, const uint4(&w)[kRows * kLoads], const uint32_t(&sc)[kRows * kLoads]) {
        const int s = warp + (t / chunks) * warps, c = t % chunks, k0 = c * kLoads * kPass + lane * kPerLoad;
        dot_down<kFp8, kRows, kLoads>(p, p.act + size_t(s) * p.inter, k0, w, sc, acc);
        if (c < chunks - 1) return;
        // The slot's rows are done: their weighted sums (NaN for a slot row outside [0, num_rows)).
        const int e = slots.row(p, s);
        const bool bad = e < 0 || e >= p.num_rows;
        const float ws = slots.weight(p, s);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float v = ws * warp_sum(acc[r]);
          if (lane == r) part[s][r] = bad ? __int_as_float(0x7fc00000) : v;
          acc[r] = 0.f;
        }
      },
      wait_once);
  wait_once();
  __syncthreads();
  if (warp == 0 && lane < kRows && n0 + lane < p.hidden) {
    float total = 0.f;
    for (int s = 0; s < p.slots; ++s) total += part[s][lane];
    p.out[n0 + lane] = __float2bfloat16_rn(p.scale * total);
  }
}

// ---------------------------------------------------------------------------------------------
// A few tokens: the GEMVs over the token blocks of the general path's alignment (8 pairs a block,
// one block per expert row the tokens chose, more for a row chosen more than 8 times).

constexpr int kBlockPairs = kMoeGemvBlockPairs;  // the alignment's token block (block_m)
constexpr int kMaxBatchTokens = kBlockPairs;     // tokens the few-token kernels take
constexpr int kMaxBatchSlots = 16;               // slots a token
constexpr int kMaxBatchPairs = kMaxBatchTokens * kMaxBatchSlots;
constexpr int kMaxBatchBlocks = kMaxBatchPairs / kBlockPairs + kMaxBatchPairs;  // max_token_blocks' bound

struct MoeBatchParams {
  MoeGemvParams g;  // x [T, hidden], act [P, inter] in the alignment's sorted order, out [T, hidden]
  MoeBins bins;
  int num_tokens = 0;
};

// The alignment's block table in shared memory, with each block's pairs resolved to (token, weight).
struct BatchBins {
  int count;                                   // token blocks
  int row[kMaxBatchBlocks];                    // expert row of block b
  int first[kMaxBatchBlocks];                  // its first sorted position: the act row of pair 0
  int n[kMaxBatchBlocks];                      // its pairs (<= kBlockPairs)
  int8_t token[kMaxBatchBlocks][kBlockPairs];  // token of pair c
  float weight[kMaxBatchBlocks][kBlockPairs];  // slot weight of pair c
  bool bad[kMaxBatchTokens];                   // the token has a slot id outside [0, num_rows)
};

// Every thread calls it; returns after a barrier. The alignment (and the routing before it) must be
// complete: after the PDL wait, or two launches later (kernel_utils.cuh).
__device__ void load_bins(const MoeBatchParams& bp, BatchBins& s) {
  const MoeGemvParams& p = bp.g;
  const int count = *bp.bins.num_blocks;
  if (threadIdx.x == 0) s.count = count;
  if (threadIdx.x < kMaxBatchTokens) s.bad[threadIdx.x] = false;
  for (int i = threadIdx.x; i < count * kBlockPairs; i += blockDim.x) {
    const int b = i / kBlockPairs, c = i % kBlockPairs;
    const int e = bp.bins.block_expert[b], first = bp.bins.block_start[b];
    const int n = min(kBlockPairs, bp.bins.offsets[e + 1] - first);
    if (c == 0) {
      s.row[b] = e;
      s.first[b] = first;
      s.n[b] = n;
    }
    if (c < n) {
      const int pair = bp.bins.perm[first + c];
      s.token[b][c] = int8_t(pair / p.slots);
      s.weight[b][c] = p.slot_weights[pair];
    }
  }
  __syncthreads();  // bad[] cleared before any thread sets an entry
  for (int i = threadIdx.x; i < bp.num_tokens * p.slots; i += blockDim.x) {
    const int e = p.slot_ids[i];
    if (e < 0 || e >= p.num_rows) s.bad[i / p.slots] = true;
  }
  __syncthreads();
}

// gate_up for a few tokens: items (block b, j), j fastest; the item's two rows are streamed once and
// multiplied with the x row of each of the block's pairs; k split as in the single-token kernel.
// act[first_b + c, j] = swiglu of pair c's sums.
template <bool kFp8, int kLoads, int kSplit>
__global__ void __launch_bounds__(kWarps* kWarp) moe_gate_up_batch_kernel(const MoeBatchParams bp) {
  constexpr int kPerLoad = kFp8 ? 16 : 8, kPass = kWarp * kPerLoad;
  constexpr int kItemsPerBlock = kWarps / kSplit;
  __shared__ BatchBins bins;
  __shared__ float partial[kWarps][2][kBlockPairs];
  const MoeGemvParams& p = bp.g;
  pdl_wait();
  pdl_trigger();
  load_bins(bp, bins);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, slice = warp % kSplit;
  const int items = bins.count * p.inter;
  const int stride = kSplit * kPass;
  const int steps = (p.hidden + kLoads * stride - 1) / (kLoads * stride);
  for (int base = blockIdx.x * kItemsPerBlock; base < items; base += gridDim.x * kItemsPerBlock) {
    const int item = base + warp / kSplit;
    const bool live = item < items;
    const int b = live ? item / p.inter : 0, j = item % p.inter;
    const int n = live ? bins.n[b] : 0;
    float g[kBlockPairs] = {}, u[kBlockPairs] = {};
    if (live) {
      const int e = bins.row[b];
      const uint16_t* xr[kBlockPairs];
#pragma unroll
      for (int c = 0; c < kBlockPairs; ++c) xr[c] = p.x + size_t(c < n ? bins.token[b][c] : 0) * p.hidden;
      const GateUpRows<kFp8, kLoads> rows(p, e, j, slice * kPass + lane * kPerLoad, stride);
      pipeline<2 * kLoads>(
          steps, [&](int t, uint4(&w)[2 * kLoads], uint32_t(&sc)[2 * kLoads]) { rows.load(t, w, sc); },
          [&](int t, const uint4(&w)[2 * kLoads], const uint32_t(&sc)[2 * kLoads]) {
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {
              const int k = rows.k(t, i);
              if (k >= p.hidden) break;
#pragma unroll
              for (int c = 0; c < kBlockPairs; ++c) {
                if (c >= n) break;
                g[c] = dot_load<kFp8>(w[2 * i], sc[2 * i], xr[c], k, g[c]);
                u[c] = dot_load<kFp8>(w[2 * i + 1], sc[2 * i + 1], xr[c], k, u[c]);
              }
            }
          },
          [] {});
#pragma unroll
      for (int c = 0; c < kBlockPairs; ++c) {
        if (c >= n) break;
        g[c] = warp_sum(g[c]);
        u[c] = warp_sum(u[c]);
      }
    }
    if constexpr (kSplit > 1) {
      if (lane == 0)
#pragma unroll
        for (int c = 0; c < kBlockPairs; ++c) {
          partial[warp][0][c] = g[c];
          partial[warp][1][c] = u[c];
        }
      __syncthreads();
      if (slice == 0)
#pragma unroll
        for (int c = 0; c < kBlockPairs; ++c) {
          g[c] = u[c] = 0.f;
          for (int i = 0; i < kSplit; ++i) {
            g[c] += partial[warp + i][0][c];
            u[c] += partial[warp + i][1][c];
          }
        }
      __syncthreads();  // partial is rewritten by the next item
    }
    if (!live || slice != 0) continue;
    float gc = 0.f, uc = 0.f;  // lane c: pair c's sums
#pragma unroll
    for (int c = 0; c < kBlockPairs; ++c)
      if (lane == c) {
        gc = g[c];
        uc = u[c];
      }
    if (lane < n)
      p.act[size_t(bins.first[b] + lane) * p.inter + j] =
          __bfloat16_as_ushort(__float2bfloat16_rn(swiglu_oai(gc, uc, p.alpha, p.limit)));
  }
}

// down + combine for a few tokens: a warp per kRows hidden rows (as the single-token walk) going
// through every block's rows of them; each pair's sums go, times its slot weight, into its token's
// accumulators (lane partials, one warp reduction per token and row at the end). Blocks in row order,
// so a token's sum runs in expert-row order: fixed by the routing, not by the schedule.
template <bool kFp8, int kRows, int kLoads>
__global__ void __launch_bounds__(kWarps* kWarp) moe_down_batch_kernel(const MoeBatchParams bp) {
  constexpr int kPerLoad = kFp8 ? 16 : 8, kPass = kWarp * kPerLoad;
  __shared__ BatchBins bins;
  const MoeGemvParams& p = bp.g;
  load_bins(bp, bins);  // the alignment is two launches back: complete, so before the PDL wait
  PdlWaitOnce wait_once;
  const int lane = threadIdx.x % kWarp;
  const int chunks = (p.inter + kLoads * kPass - 1) / (kLoads * kPass);  // steps per block
  const int groups = (p.hidden + kRows - 1) / kRows, warps = gridDim.x * kWarps;
  for (int group = blockIdx.x * kWarps + threadIdx.x / kWarp; group < groups; group += warps) {
    const int n0 = group * kRows;
    float acc[kMaxBatchTokens][kRows] = {};
    pipeline<kRows * kLoads>(
        bins.count * chunks,
        [&](int t, uint4(&w)[kRows * kLoads], uint32_t(&sc)[kRows * kLoads]) {
          const int b = t / chunks, k0 = (t % chunks) * kLoads * kPass + lane * kPerLoad;
          load_down<kFp8, kRows, kLoads>(p, bins.row[b], n0, k0, w, sc);
        },
        [&](int t, const uint4(&w)[kRows * kLoads], const uint32_t(&sc)[kRows * kLoads]) {
          const int b = t / chunks, k0 = (t % chunks) * kLoads * kPass + lane * kPerLoad;
          const int n = bins.n[b];
#pragma unroll  // measured ~1% faster than a loop to n (bf16, I 3072, 8 tokens)
          for (int c = 0; c < kBlockPairs; ++c) {
            if (c >= n) break;
            float d[kRows] = {};
            dot_down<kFp8, kRows, kLoads>(p, p.act + size_t(bins.first[b] + c) * p.inter, k0, w, sc, d);
            const int tok = bins.token[b][c];
            const float wc = bins.weight[b][c];
#pragma unroll
            for (int m = 0; m < kMaxBatchTokens; ++m)
              if (tok == m)
#pragma unroll
                for (int r = 0; r < kRows; ++r) acc[m][r] = fmaf(wc, d[r], acc[m][r]);
          }
        },
        wait_once);
#pragma unroll
    for (int m = 0; m < kMaxBatchTokens; ++m) {
      if (m >= bp.num_tokens) break;
      float v = 0.f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float sum = warp_sum(acc[m][r]);
        if (lane == r) v = sum;
      }
      if (lane < kRows && n0 + lane < p.hidden)
        p.out[size_t(m) * p.hidden + n0 + lane] =
            __float2bfloat16_rn(bins.bad[m] ? __int_as_float(0x7fc00000) : p.scale * v);
    }
  }
  wait_once();
}

// Measured on an H200 at batch 1 (docs/PERF.md): two loads per gate_up step, four down rows a warp
// with two loads per row and step; more loads in flight per warp measured slower at both widths.
constexpr int kGateLoads = 2, kDownRows = 4, kDownLoads = 2;
// Below this many row groups an SM the down kernel splits the slots across warps (docs/PERF.md: the
// tiny preset's step); at the m3 widths (1536 groups) the walk is the faster form.
constexpr int kSlotSplitGroupsPerSm = 2;
constexpr int kMaxDevices = 64;

// Blocks of `kernel` (kWarps warps, no dynamic shared memory) resident at once on the current
// device, of `sms` SMs: the grid of the looping kernels above. The occupancy query runs once per
// kernel and device (a template per kernel: one per kernel type would share the answer between
// kernels of the same signature).
template <auto kernel>
int resident_grid(int sms) {
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (device < kMaxDevices && cached[device].load() > 0) return cached[device].load();
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * kWarp, 0));
  const int grid = std::max(1, per_sm) * sms;
  if (device < kMaxDevices) cached[device].store(grid);
  return grid;
}

template <bool kFp8, int kSplit>
void launch_kernels(const MoeGemvParams& g, int sms, KernelStream on) {
  constexpr auto gate_up = &moe_gate_up_gemv_kernel<kFp8, kGateLoads, kSplit>;
  constexpr auto down = &moe_down_gemv_kernel<kFp8, kDownRows, kDownLoads>;
  const int gate_up_work = int((int64_t(g.slots) * g.inter * kSplit + kWarps - 1) / kWarps);
  const int down_work = (g.hidden + kDownRows * kWarps - 1) / (kDownRows * kWarps);
  const int gate_up_grid = std::min(gate_up_work, resident_grid<gate_up>(sms));
  launch_pdl(gate_up, dim3(unsigned(gate_up_grid)), dim3(kWarps * kWarp), 0, on, g);
  const int groups = (g.hidden + kDownRows - 1) / kDownRows;
  if (groups < kSlotSplitGroupsPerSm * sms) {
    // Few row groups: a block each (all resident at once), its warps splitting the slots.
    const int warps = std::min(g.slots, kMaxSlotWarps);
    launch_pdl(moe_down_slots_gemv_kernel<kFp8, kDownRows, kDownLoads>, dim3(unsigned(groups)),
               dim3(unsigned(warps * kWarp)), 0, on, g);
    return;
  }
  const int down_grid = std::min(down_work, resident_grid<down>(sms));
  launch_pdl(down, dim3(unsigned(down_grid)), dim3(kWarps * kWarp), 0, on, g);
}

// Warps per gate_up item: split k (by powers of two, each warp keeping at least two steps) until
// the items fill about 32 warps an SM (the tp-8 width, 5 slots x 384 rows, splits 4 ways; the tp-1
// width does not split). Depends on the shape and the GPU's SM count only, so on one GPU a layer's
// bits do not change from run to run.
template <bool kFp8>
int choose_split(const MoeGemvParams& g, int sms) {
  const int64_t items = int64_t(g.slots) * g.inter, target = int64_t(sms) * 32;
  const int step = kGateLoads * kWarp * (kFp8 ? 16 : 8);
  int split = 1;
  while (split < kWarps && items * split < target && g.hidden >= 2 * split * step) split *= 2;
  return split;
}

template <bool kFp8>
void launch_format(const MoeGemvParams& g, int sms, KernelStream on) {
  switch (choose_split<kFp8>(g, sms)) {
    case 4: launch_kernels<kFp8, 4>(g, sms, on); break;
    case 2: launch_kernels<kFp8, 2>(g, sms, on); break;
    default: launch_kernels<kFp8, 1>(g, sms, on); break;
  }
}

template <auto kDown, int kRows>
void launch_batch_down(const MoeBatchParams& bp, int sms, KernelStream on) {
  const int down_work = (bp.g.hidden + kRows * kWarps - 1) / (kRows * kWarps);
  launch_pdl(kDown, dim3(unsigned(std::min(down_work, resident_grid<kDown>(sms)))), dim3(kWarps * kWarp), 0, on, bp);
}

template <bool kFp8, int kSplit>
void launch_batch_kernels(const MoeBatchParams& bp, int sms, KernelStream on) {
  constexpr auto gate_up = &moe_gate_up_batch_kernel<kFp8, kGateLoads, kSplit>;
  // The blocks are known on the device only: size gate_up for the most there can be.
  const int64_t most_blocks = std::min<int64_t>(int64_t(bp.num_tokens) * bp.g.slots, kMaxBatchBlocks);
  const int gate_up_work = int((most_blocks * bp.g.inter * kSplit + kWarps - 1) / kWarps);
  launch_pdl(gate_up, dim3(unsigned(std::min(gate_up_work, resident_grid<gate_up>(sms)))), dim3(kWarps * kWarp), 0, on,
             bp);
  // Rows and loads as the single-token walk: measured on an H200 against 2 rows x 2 or 4 loads and
  // 1 row x 4 loads a warp (docs/PERF.md, "A few tokens' MoE on the GEMVs"), the fastest for MXFP8.
  launch_batch_down<&moe_down_batch_kernel<kFp8, kDownRows, kDownLoads>, kDownRows>(bp, sms, on);
}

template <bool kFp8>
void launch_batch_format(const MoeBatchParams& bp, int sms, KernelStream on) {
  // The k split as for one token, over the distinct rows there are at most.
  MoeGemvParams g = bp.g;
  g.slots = int(std::min<int64_t>(int64_t(bp.num_tokens) * bp.g.slots, bp.g.num_rows));
  switch (choose_split<kFp8>(g, sms)) {
    case 4: launch_batch_kernels<kFp8, 4>(bp, sms, on); break;
    case 2: launch_batch_kernels<kFp8, 2>(bp, sms, on); break;
    default: launch_batch_kernels<kFp8, 1>(bp, sms, on); break;
  }
}

MoeGemvParams gemv_params(const MoeKernelParams& p, uint16_t* act) {
  MoeGemvParams g;
  g.x = reinterpret_cast<const uint16_t*>(p.x);
  g.slot_ids = p.slot_ids;
  g.slot_weights = p.slot_weights;
  g.gate_up = static_cast<const uint8_t*>(p.gate_up);
  g.gate_up_scale = p.gate_up_scale;
  g.down = static_cast<const uint8_t*>(p.down);
  g.down_scale = p.down_scale;
  g.act = act;
  g.out = p.out;
  g.slots = p.slots;
  g.hidden = p.hidden;
  g.inter = p.inter;
  g.num_rows = p.num_rows;
  g.alpha = p.alpha;
  g.limit = p.limit;
  g.scale = p.scale;
  g.route = p.route;
  return g;
}

// hidden and inter multiples of 8 (MXFP8: of 32, already required), 16-byte aligned x and weights.
bool gemv_operands_fit(const MoeKernelParams& p) {
  const int multiple = p.gate_up_scale != nullptr ? 32 : 8;
  return p.hidden % multiple == 0 && p.inter % multiple == 0 && aligned16(p.x) && aligned16(p.gate_up) &&
         aligned16(p.down);
}

}  // namespace

bool moe_gemv_fits(const MoeKernelParams& p) {
  return p.num_tokens == 1 && p.slots >= 1 && p.slots <= kMaxGemvSlots &&
         int64_t(p.slots) * p.inter * kWarps <= 0x7fffffff && gemv_operands_fit(p);
}

bool moe_gemv_batch_fits(const MoeKernelParams& p) {
  return p.num_tokens >= 2 && p.num_tokens <= kMaxBatchTokens && p.slots >= 1 && p.slots <= kMaxBatchSlots &&
         int64_t(kMaxBatchBlocks) * p.inter * kWarps <= 0x7fffffff && gemv_operands_fit(p);
}

void launch_moe_gemv(const MoeKernelParams& p, uint16_t* act, KernelStream on) {
  check_arg(moe_gemv_fits(p), "launch_moe_gemv: operands the single-token path does not take");
  check_arg(aligned16(act), "launch_moe_gemv: act must be 16-byte aligned");
  const MoeGemvParams g = gemv_params(p, act);
  const int sms = sm_count();  // the current device's, asked once a launch
  if (p.gate_up_scale != nullptr)
    launch_format<true>(g, sms, on);
  else
    launch_format<false>(g, sms, on);
}

void launch_moe_gemv_batch(const MoeKernelParams& p, const MoeBins& bins, int block_m, uint16_t* act, KernelStream on) {
  check_arg(moe_gemv_batch_fits(p), "launch_moe_gemv_batch: operands the few-token path does not take");
  check_arg(aligned16(act), "launch_moe_gemv_batch: act must be 16-byte aligned");
  check_arg(bins.offsets && bins.num_blocks && bins.block_expert && bins.block_start && bins.perm,
            "launch_moe_gemv_batch: the alignment's tables are missing");
  check_arg(block_m == kBlockPairs, "launch_moe_gemv_batch: the alignment's blocks must be of " +
                                        std::to_string(kBlockPairs) + " pairs, not " + std::to_string(block_m));
  MoeBatchParams bp;
  bp.g = gemv_params(p, act);
  bp.g.route = RouteKernelParams{};  // routed already: the slots are in slot_ids
  bp.bins = bins;
  bp.num_tokens = p.num_tokens;
  const int sms = sm_count();
  if (p.gate_up_scale != nullptr)
    launch_batch_format<true>(bp, sms, on);
  else
    launch_batch_format<false>(bp, sms, on);
}

}  // namespace tpmoe::cuda
