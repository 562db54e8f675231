// MXFP8 quantization on the device (mxfp8.cuh). One thread per run of 32 values: reads 64 bytes of
// bf16, writes 32 bytes of e4m3 and one scale byte; memory bound, used once when a preset is made.
#include "backends/cuda/mxfp8.cuh"

#include <cuda_fp8.h>

#include <algorithm>

#include "backends/cuda/kernel_utils.cuh"

namespace tpmoe::cuda {

namespace {

constexpr int kBlock = 32;

__global__ void quantize_mxfp8_kernel(const __nv_bfloat16* in, uint8_t* q, uint8_t* scale, int64_t runs) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < runs; r += int64_t(gridDim.x) * blockDim.x) {
    float v[kBlock];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      v[i] = __bfloat162float(in[r * kBlock + i]);
      amax = fmaxf(amax, fabsf(v[i]));
    }
    // As quantize_mxfp8: amax in [2^E, 2^(E+1)) needs 2^(E-8) or 2^(E-7); all zeros take 2^0.
    int e = 0;
    if (amax > 0.f) {
      const int E = ilogbf(amax);
      e = E - 8 + (ldexpf(amax, 8 - E) > 448.f ? 1 : 0);
    }
    e = max(-127, min(127, e));
    scale[r] = uint8_t(e + 127);
#pragma unroll
    for (int i = 0; i < kBlock; ++i)
      q[r * kBlock + i] = uint8_t(__nv_cvt_float_to_fp8(ldexpf(v[i], -e), __NV_SATFINITE, __NV_E4M3));
  }
}

}  // namespace

void launch_quantize_mxfp8(const __nv_bfloat16* in, uint8_t* q, uint8_t* scale, int64_t n, cudaStream_t stream) {
  check_arg(n % kBlock == 0, "launch_quantize_mxfp8: n must be a multiple of 32");
  const int64_t runs = n / kBlock;
  if (runs == 0) return;
  const int64_t blocks = std::min<int64_t>((runs + 255) / 256, 8192);
  quantize_mxfp8_kernel<<<unsigned(blocks), 256, 0, stream>>>(in, q, scale, runs);
  CUDA_CHECK_LAUNCH();
}

}  // namespace tpmoe::cuda
