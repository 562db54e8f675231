// The single-token MoE path (moe_gemv.cuh). Both kernels stream weight rows with 16-byte loads (8 bf16
// or 16 e4m3 per lane and load), kUnroll loads per row in flight, fp32 sums in k order per lane, one
// warp reduction per row. x and act are small (L1-cached plain loads: act is the previous launch's output).
#include "backends/cuda/moe_gemv.cuh"

#include <cuda_bf16.h>

#include "backends/cuda/kernel_utils.cuh"
#include "backends/cuda/weight_loads.cuh"

namespace tpmoe::cuda {

namespace {

constexpr int kWarps = 4;        // per block
constexpr int kDownRows = 2;     // hidden rows per block in the down kernel
constexpr int kUnroll = 4;       // loads per row in flight
constexpr int kMaxSlots = 1024;  // the down kernel keeps a sum per slot and row in shared memory

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
    const uint4 lo = dequant_e4m3x8(make_uint2(w.x, w.y), scale);
    const uint4 hi = dequant_e4m3x8(make_uint2(w.z, w.w), scale);
    acc = dot8(lo, *reinterpret_cast<const uint4*>(v + k), acc);
    return dot8(hi, *reinterpret_cast<const uint4*>(v + k + 8), acc);
  } else {
    return dot8(w, *reinterpret_cast<const uint4*>(v + k), acc);
  }
}

// Grid (ceil(inter / kWarps), slots): warp -> (slot, j).
template <bool kFp8>
__global__ void __launch_bounds__(kWarps* kWarp) moe_gate_up_gemv_kernel(const MoeGemvParams p) {
  constexpr int kPass = kWarp * (kFp8 ? 16 : 8);  // k per warp and load
  pdl_wait();                                     // the slot ids come from the previous launch (the router)
  pdl_trigger();
  const int lane = threadIdx.x % kWarp, s = blockIdx.y;
  const int j = blockIdx.x * kWarps + threadIdx.x / kWarp;
  if (j >= p.inter) return;
  const int e = p.slot_ids[s];
  if (e < 0 || e >= p.num_rows) return;  // a routing bug: the down kernel writes NaN for the token
  const RowReader<kFp8> gate(p.gate_up, p.gate_up_scale, size_t(e) * 2 * p.inter + j, p.hidden);
  const RowReader<kFp8> up(p.gate_up, p.gate_up_scale, size_t(e) * 2 * p.inter + p.inter + j, p.hidden);
  float g = 0.f, u = 0.f;
  for (int k0 = lane * (kPass / kWarp); k0 < p.hidden; k0 += kUnroll * kPass) {
    uint4 wg[kUnroll], wu[kUnroll];
    uint32_t sg[kUnroll], su[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      wg[i] = gate.load(k0 + i * kPass);
      wu[i] = up.load(k0 + i * kPass);
      sg[i] = gate.load_scale(k0 + i * kPass);
      su[i] = up.load_scale(k0 + i * kPass);
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int k = k0 + i * kPass;
      if (k >= p.hidden) break;
      g = dot_load<kFp8>(wg[i], sg[i], p.x, k, g);
      u = dot_load<kFp8>(wu[i], su[i], p.x, k, u);
    }
  }
  g = warp_sum(g);
  u = warp_sum(u);
  if (lane == 0)
    p.act[size_t(s) * p.inter + j] = __bfloat16_as_ushort(__float2bfloat16_rn(swiglu_oai(g, u, p.alpha, p.limit)));
}

// Grid ceil(hidden / kDownRows): a block -> kDownRows hidden rows; its warps split the slots (warp w
// takes slots w, w + kWarps, ...), so each warp's chain of dependent loads is a slot or two long.
// Each (slot, row) sum goes to shared memory; the rows' outputs add them up in slot order.
template <bool kFp8>
__global__ void __launch_bounds__(kWarps* kWarp) moe_down_gemv_kernel(const MoeGemvParams p) {
  constexpr int kPass = kWarp * (kFp8 ? 16 : 8);
  extern __shared__ float slot_sums[];  // [slots][kDownRows], times the slot weight
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int n0 = blockIdx.x * kDownRows;
  // Slot ids and weights were written by the router, two launches back: complete when this kernel
  // starts, so they and the weights they select are read before the wait; act (the previous launch's
  // output) after it.
  bool waited = false;
  for (int s = warp; s < p.slots; s += kWarps) {
    const int e = p.slot_ids[s];
    if (e < 0 || e >= p.num_rows) continue;  // NaN below
    const uint16_t* act = p.act + size_t(s) * p.inter;
    float d[kDownRows] = {};
    for (int k0 = lane * (kPass / kWarp); k0 < p.inter; k0 += kUnroll * kPass) {
      uint4 w[kDownRows][kUnroll];
      uint32_t sc[kDownRows][kUnroll];
#pragma unroll
      for (int r = 0; r < kDownRows; ++r) {
        const int n = min(n0 + r, p.hidden - 1);  // a row past the end repeats the last one, unused
        const RowReader<kFp8> row(p.down, p.down_scale, size_t(e) * p.hidden + n, p.inter);
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {
          w[r][i] = row.load(k0 + i * kPass);
          sc[r][i] = row.load_scale(k0 + i * kPass);
        }
      }
      if (!waited) {
        pdl_wait();
        pdl_trigger();
        waited = true;
      }
#pragma unroll
      for (int r = 0; r < kDownRows; ++r)
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {
          const int k = k0 + i * kPass;
          if (k >= p.inter) break;
          d[r] = dot_load<kFp8>(w[r][i], sc[r][i], act, k, d[r]);
        }
    }
    const float ws = p.slot_weights[s];
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) {
      const float v = warp_sum(d[r]);
      if (lane == 0) slot_sums[s * kDownRows + r] = ws * v;
    }
  }
  if (!waited) {
    pdl_wait();
    pdl_trigger();
  }
  __syncthreads();
  const int r = threadIdx.x, n = n0 + r;
  if (r >= kDownRows || n >= p.hidden) return;
  float v = 0.f;
  bool bad = false;
  for (int s = 0; s < p.slots; ++s) {
    const int e = p.slot_ids[s];
    bad |= e < 0 || e >= p.num_rows;
    v += slot_sums[s * kDownRows + r];  // a bad slot's entry is never written; the NaN replaces v
  }
  p.out[n] = __float2bfloat16_rn(bad ? __int_as_float(0x7fc00000) : p.scale * v);
}

}  // namespace

bool moe_gemv_fits(const MoeKernelParams& p) {
  const bool fp8 = p.gate_up_scale != nullptr;
  const int multiple = fp8 ? 32 : 8;
  return p.num_tokens == 1 && p.slots <= kMaxSlots && p.hidden % multiple == 0 && p.inter % multiple == 0 &&
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
  const dim3 block(kWarps * kWarp);
  const dim3 gate_up_grid(unsigned((p.inter + kWarps - 1) / kWarps), unsigned(p.slots));
  const dim3 down_grid(unsigned((p.hidden + kDownRows - 1) / kDownRows));
  const size_t down_smem = size_t(p.slots) * kDownRows * sizeof(float);
  if (p.gate_up_scale != nullptr) {
    launch_pdl(moe_gate_up_gemv_kernel<true>, gate_up_grid, block, 0, stream, pdl, g);
    launch_pdl(moe_down_gemv_kernel<true>, down_grid, block, down_smem, stream, pdl, g);
  } else {
    launch_pdl(moe_gate_up_gemv_kernel<false>, gate_up_grid, block, 0, stream, pdl, g);
    launch_pdl(moe_down_gemv_kernel<false>, down_grid, block, down_smem, stream, pdl, g);
  }
}

}  // namespace tpmoe::cuda
