// The measured memory ceiling every GPU benchmark divides by: a device-to-device copy of 2 GiB (far
// larger than the 60 MB L2), timed with events, median of ten after a warm-up, counting bytes read
// plus bytes written.
#include <algorithm>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "engine/backends.h"

namespace tpmoe {

bool cuda_device_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

double cuda_copy_bandwidth() {
  const size_t bytes = size_t(2) << 30;
  void *src = nullptr, *dst = nullptr;
  CUDA_CHECK(cudaMalloc(&src, bytes));
  CUDA_CHECK(cudaMalloc(&dst, bytes));
  CUDA_CHECK(cudaMemset(src, 0x5A, bytes));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> rates;
  for (int rep = 0; rep < 11; ++rep) {
    CUDA_CHECK(cudaEventRecord(start));
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (rep > 0) rates.push_back(2.0 * double(bytes) / (double(ms) * 1e-3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(src);
  cudaFree(dst);
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

}  // namespace tpmoe
