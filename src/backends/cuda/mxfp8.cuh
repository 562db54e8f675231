// MXFP8 weights on the device: quantizing bf16 values into e4m3 bytes + E8M0 block scales (for
// presets generated on the GPU). The GEMMs that read MXFP8 weights are in moe.cuh (launch_moe with
// scales, launch_fp8_linear).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tpmoe::cuda {

// n values (n % 32 == 0) in runs of 32: scale[i] = the biased exponent S of the smallest power of two
// 2^(S-127) keeping run i's largest magnitude within 448, q = e4m3(value / 2^(S-127)) rounded to
// nearest even: bit for bit what quantize_mxfp8 (src/model/presets.h) computes on the host.
void launch_quantize_mxfp8(const __nv_bfloat16* in, uint8_t* q, uint8_t* scale, int64_t n, cudaStream_t stream);

}  // namespace tpmoe::cuda
