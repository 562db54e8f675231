// The single-token MoE path (moe_gemv.cuh). Both kernels stream weight rows with 16-byte loads (8 bf16
// or 16 e4m3 per lane and load), two steps of loads in flight per warp (pipeline()), fp32 sums in k
// order per lane, one warp reduction per row. x and act are small (L1-cached plain loads: act is the
// previous launch's output).
#include "backends/cuda/moe_gemv.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>

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

// Both kernels run a grid no larger than what is resident at once (resident_grid) and loop over
// their work, so the routing inside is done once per warp, never once per row, and never in a
// second wave of blocks.
//
// gate_up: items (slot, j), j fastest (a slot's rows in order); kSplit warps of a block share an item,
// warp slice i taking the 16-byte chunks i, i + kSplit, ... of both rows (more warps in flight where
// there are few items: 1920 at the tp-8 width), their sums added in slice order. With routing
// inside, each warp routes the token itself (the router's logits are the previous launch's output)
// and block 0's first warp stores the slots; otherwise the slot ids come from the previous launch.
template <bool kFp8, int kLoads, int kSplit>
__global__ void __launch_bounds__(kWarps* kWarp) moe_gate_up_gemv_kernel(const MoeGemvParams p) {
  constexpr int kPerLoad = kFp8 ? 16 : 8, kPass = kWarp * kPerLoad;
  constexpr int kItemsPerBlock = kWarps / kSplit;
  __shared__ float partial[kWarps][2];
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, slice = warp % kSplit;
  const TokenSlots slots = token_slots(p, lane);
  if (p.route.logits != nullptr && blockIdx.x == 0 && threadIdx.x < kWarp) store_route(p.route, 0, slots.choice, lane);
  const int items = p.slots * p.inter;
  const int stride = kSplit * kPass;                                       // k between a lane's chunks
  const int steps = (p.hidden + kLoads * stride - 1) / (kLoads * stride);  // of kLoads chunks per row
  for (int base = blockIdx.x * kItemsPerBlock; base < items; base += gridDim.x * kItemsPerBlock) {
    const int item = base + warp / kSplit;
    const int s = item / p.inter, j = item % p.inter;
    const int e = item < items ? slots.row(p, s) : -1;
    const bool live = e >= 0 && e < p.num_rows;  // else a routing bug: the down kernel writes NaN
    float g = 0.f, u = 0.f;
    if (live) {
      const RowReader<kFp8> gate(p.gate_up, p.gate_up_scale, size_t(e) * 2 * p.inter + j, p.hidden);
      const RowReader<kFp8> up(p.gate_up, p.gate_up_scale, size_t(e) * 2 * p.inter + p.inter + j, p.hidden);
      const int k_first = slice * kPass + lane * kPerLoad;
      pipeline<2 * kLoads>(
          steps,
          [&](int t, uint4(&w)[2 * kLoads], uint32_t(&sc)[2 * kLoads]) {
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {
              const int k = k_first + (t * kLoads + i) * stride;
              w[2 * i] = gate.load(k);
              w[2 * i + 1] = up.load(k);
              sc[2 * i] = gate.load_scale(k);
              sc[2 * i + 1] = up.load_scale(k);
            }
          },
          [&](int t, const uint4(&w)[2 * kLoads], const uint32_t(&sc)[2 * kLoads]) {
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {
              const int k = k_first + (t * kLoads + i) * stride;
              if (k >= p.hidden) break;
              g = dot_load<kFp8>(w[2 * i], sc[2 * i], p.x, k, g);
              u = dot_load<kFp8>(w[2 * i + 1], sc[2 * i + 1], p.x, k, u);
            }
          },
          [] {});
      g = warp_sum(g);
      u = warp_sum(u);
    }
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

// Measured on an H200 at batch 1 (docs/PERF.md): two loads per gate_up step, four down rows a warp
// with two loads per row and step; more loads in flight per warp measured slower at both widths.
constexpr int kGateLoads = 2, kDownRows = 4, kDownLoads = 2;
// Below this many row groups an SM the down kernel splits the slots across warps (docs/PERF.md: the
// tiny preset's step); at the m3 widths (1536 groups) the walk is the faster form.
constexpr int kSlotSplitGroupsPerSm = 2;
constexpr int kMaxDevices = 64;

int sm_count() {
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// Blocks of `kernel` (kWarps warps, no dynamic shared memory) resident at once on the current
// device: the grid of the looping kernels above. The occupancy query runs once per device.
template <class Kernel>
int resident_grid(Kernel kernel) {
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (device < kMaxDevices && cached[device].load() > 0) return cached[device].load();
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * kWarp, 0));
  const int grid = std::max(1, per_sm) * sm_count();
  if (device < kMaxDevices) cached[device].store(grid);
  return grid;
}

template <bool kFp8, int kSplit>
void launch_kernels(const MoeGemvParams& g, bool pdl, cudaStream_t stream) {
  const auto gate_up = moe_gate_up_gemv_kernel<kFp8, kGateLoads, kSplit>;
  const auto down = moe_down_gemv_kernel<kFp8, kDownRows, kDownLoads>;
  const int gate_up_work = int((int64_t(g.slots) * g.inter * kSplit + kWarps - 1) / kWarps);
  const int down_work = (g.hidden + kDownRows * kWarps - 1) / (kDownRows * kWarps);
  const int gate_up_grid = std::min(gate_up_work, resident_grid(gate_up));
  launch_pdl(gate_up, dim3(unsigned(gate_up_grid)), dim3(kWarps * kWarp), 0, stream, pdl, g);
  const int groups = (g.hidden + kDownRows - 1) / kDownRows;
  if (groups < kSlotSplitGroupsPerSm * sm_count()) {
    // Few row groups: a block each (all resident at once), its warps splitting the slots.
    const int warps = std::min(g.slots, kMaxSlotWarps);
    launch_pdl(moe_down_slots_gemv_kernel<kFp8, kDownRows, kDownLoads>, dim3(unsigned(groups)),
               dim3(unsigned(warps * kWarp)), 0, stream, pdl, g);
    return;
  }
  const int down_grid = std::min(down_work, resident_grid(down));
  launch_pdl(down, dim3(unsigned(down_grid)), dim3(kWarps * kWarp), 0, stream, pdl, g);
}

// Warps per gate_up item: split k (by powers of two, each warp keeping at least two steps) until
// the items fill about 32 warps an SM (the tp-8 width, 5 slots x 384 rows, splits 4 ways; the tp-1
// width does not split). Depends on the shape and the GPU's SM count only, so on one GPU a layer's
// bits do not change from run to run.
template <bool kFp8>
int choose_split(const MoeGemvParams& g) {
  const int64_t items = int64_t(g.slots) * g.inter, target = int64_t(sm_count()) * 32;
  const int step = kGateLoads * kWarp * (kFp8 ? 16 : 8);
  int split = 1;
  while (split < kWarps && items * split < target && g.hidden >= 2 * split * step) split *= 2;
  return split;
}

template <bool kFp8>
void launch_format(const MoeGemvParams& g, bool pdl, cudaStream_t stream) {
  switch (choose_split<kFp8>(g)) {
    case 4: launch_kernels<kFp8, 4>(g, pdl, stream); break;
    case 2: launch_kernels<kFp8, 2>(g, pdl, stream); break;
    default: launch_kernels<kFp8, 1>(g, pdl, stream); break;
  }
}

}  // namespace

bool moe_gemv_fits(const MoeKernelParams& p) {
  const bool fp8 = p.gate_up_scale != nullptr;
  const int multiple = fp8 ? 32 : 8;
  return p.num_tokens == 1 && p.slots >= 1 && p.slots <= kMaxGemvSlots &&
         int64_t(p.slots) * p.inter * kWarps <= 0x7fffffff && p.hidden % multiple == 0 && p.inter % multiple == 0 &&
         aligned16(p.x) && aligned16(p.gate_up) && aligned16(p.down);
}

void launch_moe_gemv(const MoeKernelParams& p, uint16_t* act, bool pdl, cudaStream_t stream) {
  check_arg(moe_gemv_fits(p), "launch_moe_gemv: operands the single-token path does not take");
  check_arg(aligned16(act), "launch_moe_gemv: act must be 16-byte aligned");
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
  if (p.gate_up_scale != nullptr)
    launch_format<true>(g, pdl, stream);
  else
    launch_format<false>(g, pdl, stream);
}

}  // namespace tpmoe::cuda
