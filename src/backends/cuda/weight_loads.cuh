// How the weight-streaming kernels (the MoE grouped GEMM, the decode GEMVs) read weights: 16- and
// 8-byte loads that skip L1 (weights are read once) with 256-byte L2 fetches, the exact widening of
// MXFP8 (e4m3 x E8M0 block scale) in registers (to bf16 for the grouped GEMM's mma; to fp32 for the
// GEMVs, the block scale applied once per 32-block sum), and the GEMVs' fp32 dot of 8 bf16 pairs.
// Device code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tpmoe::cuda {

// Weights are read once: no L1 allocation, and a 256-byte L2 fetch (the next chunks of the row).
__device__ __forceinline__ uint4 ld_weight16(const uint16_t* ptr) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
}

// 8 e4m3 weights (K % 32 == 0 is required for MXFP8, so a live chunk is always whole).
__device__ __forceinline__ uint2 ld_weight8(const uint8_t* ptr) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
  return v;
}

// 8 e4m3 values (byte j = element j) times 2^(s - 127) as 8 bf16 (element pairs packed low, high),
// exactly (an e4m3 value times a power of two fits a bf16 unless it underflows bf16's range).
// Each byte's sign, exponent and mantissa bits go to the matching bf16 bits with no exponent
// re-bias: that bf16 is the e4m3 value times 2^-120, subnormals included (bf16 arithmetic keeps
// subnormals), and one bf16 multiply by 2^(s - 7) = 2^120 * 2^(s - 127) both re-biases and scales.
// 2^(s - 7) is a bf16 for s <= 134; larger scales take two multiplies.
__device__ __forceinline__ uint4 dequant_e4m3x8(uint2 raw, uint32_t s) {
  const bool one_step = s <= 134;
  const uint32_t m1_bits = one_step ? (s + 120) << 7 : 247u << 7;  // 2^(s-7), or 2^120
  const uint32_t m2_bits = s << 7;                                 // 2^(s-127) (s >= 135 here)
  const __nv_bfloat162 m1 =
      __halves2bfloat162(__ushort_as_bfloat16(uint16_t(m1_bits)), __ushort_as_bfloat16(uint16_t(m1_bits)));
  const __nv_bfloat162 m2 =
      __halves2bfloat162(__ushort_as_bfloat16(uint16_t(m2_bits)), __ushort_as_bfloat16(uint16_t(m2_bits)));
  uint32_t out[4];
  const uint32_t words[2] = {raw.x, raw.y};
#pragma unroll
  for (int w = 0; w < 2; ++w) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // Bytes 2*half and 2*half+1 of the word into the high byte of each 16-bit lane.
      const uint32_t t = __byte_perm(words[w], 0u, half ? 0x3424u : 0x1404u);
      const uint32_t bits = (t & 0x80008000u) | ((t >> 4) & 0x07f007f0u);
      __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&bits);
      v = __hmul2(v, m1);
      if (!one_step) v = __hmul2(v, m2);
      out[2 * w + half] = *reinterpret_cast<const uint32_t*>(&v);
    }
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// 16 e4m3 values (byte j = element j) as fp32, exactly: every e4m3 value is an f16, and the hardware
// widens two e4m3 to two f16 in one instruction (cvt.rn.f16x2.e4m3x2). The GEMVs' MXFP8 path: about
// half the instructions a weight of dequant_e4m3x8 + dot8, which matters where a GEMV streams 16
// weights a lane and load at the memory's rate.
__device__ __forceinline__ void widen_e4m3x16(uint4 raw, float (&out)[16]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(words[w] >> (16 * half)), __NV_E4M3);
      const float2 f = __half22float2(__half2(h));
      out[4 * w + 2 * half] = f.x;
      out[4 * w + 2 * half + 1] = f.y;
    }
  }
}

// 2^(s - 127) for an E8M0 exponent s < 255 (the loader rejects 255, NaN), as fp32: s = 0 is the
// subnormal 2^-127.
__device__ __forceinline__ float e8m0_to_float(uint32_t s) { return __uint_as_float(s == 0 ? 0x00400000u : s << 23); }

// acc + scale * (w . x) over 16 widened weights (widen_e4m3x16) and their 16 bf16 activations: the
// products summed in k order in fp32, then multiplied once by the block's scale (a power of two, so
// exactly the sum of the scaled products, short of underflow) and added.
__device__ __forceinline__ float dot16_scaled(const float (&w)[16], const uint4& x_lo, const uint4& x_hi, float scale,
                                              float acc) {
  const uint32_t xv[8] = {x_lo.x, x_lo.y, x_lo.z, x_lo.w, x_hi.x, x_hi.y, x_hi.z, x_hi.w};
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 xf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xv[j]));
    sum = fmaf(w[2 * j], xf.x, sum);
    sum = fmaf(w[2 * j + 1], xf.y, sum);
  }
  return fmaf(sum, scale, acc);
}

// acc + w . x over 8 bf16 values each, in k order, fp32.
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 wf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wv[j]));
    const float2 xf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xv[j]));
    acc = fmaf(wf.x, xf.x, acc);
    acc = fmaf(wf.y, xf.y, acc);
  }
  return acc;
}

}  // namespace tpmoe::cuda
