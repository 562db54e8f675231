// The measured memory ceilings every GPU benchmark divides by, over buffers far larger than the
// 60 MB L2, timed with events, median of ten after a warm-up:
//   read_bandwidth   a read-only stream (16-byte loads, every byte once, one word written per
//                    block): what a decode step does to its weights, the floor's denominator;
//   copy_bandwidth   a device-to-device copy, counting bytes read plus bytes written (for
//                    reference: it reads ~6% slower than the read-only stream on an H200).
#include <algorithm>
#include <vector>

#include "backends/cuda/bandwidth.cuh"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_utils.cuh"

namespace tpmoe::cuda {

namespace {

constexpr int kReadThreads = 512;

// Each thread XORs the 16-byte words it strides over; the block's fold is written so the loads
// cannot be dropped. Bytes moved: `words` * 16 read, gridDim.x * 4 written.
__global__ void __launch_bounds__(kReadThreads)
    read_stream_kernel(const uint4* __restrict__ data, size_t words, uint32_t* __restrict__ sink) {
  uint32_t acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // Four independent loads in flight per thread.
  for (; i + 3 * stride < words; i += 4 * stride) {
    const uint4 a = __ldcs(data + i), b = __ldcs(data + i + stride), c = __ldcs(data + i + 2 * stride),
                d = __ldcs(data + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < words; i += stride) {
    const uint4 a = __ldcs(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  for (int off = 16; off > 0; off >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, off);
  if (threadIdx.x % 32 == 0) atomicXor(sink + blockIdx.x, acc);
}

template <class Op>
double median_rate(double bytes, Op op) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> rates;
  for (int rep = 0; rep < 11; ++rep) {
    CUDA_CHECK(cudaEventRecord(start));
    op();
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (rep > 0) rates.push_back(bytes / (double(ms) * 1e-3));  // the first one warms up
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

}  // namespace

size_t read_stream_sink_words() {
  return size_t(sm_count()) * 4;  // the stream's blocks: four of 512 threads an SM
}

void launch_read_stream(const void* data, size_t bytes, uint32_t* sink, cudaStream_t stream) {
  read_stream_kernel<<<unsigned(read_stream_sink_words()), kReadThreads, 0, stream>>>(static_cast<const uint4*>(data),
                                                                                      bytes / 16, sink);
  CUDA_CHECK_LAUNCH();
}

double read_bandwidth() {
  const size_t bytes = size_t(8) << 30;
  void* data = nullptr;
  uint32_t* sink = nullptr;
  CUDA_CHECK(cudaMalloc(&data, bytes));
  CUDA_CHECK(cudaMalloc(&sink, read_stream_sink_words() * sizeof(uint32_t)));
  CUDA_CHECK(cudaMemset(data, 0x5A, bytes));
  const double rate = median_rate(double(bytes), [&] { launch_read_stream(data, bytes, sink, nullptr); });
  cudaFree(data);
  cudaFree(sink);
  return rate;
}

double copy_bandwidth() {
  const size_t bytes = size_t(2) << 30;
  void *src = nullptr, *dst = nullptr;
  CUDA_CHECK(cudaMalloc(&src, bytes));
  CUDA_CHECK(cudaMalloc(&dst, bytes));
  CUDA_CHECK(cudaMemset(src, 0x5A, bytes));
  const double rate =
      median_rate(2.0 * double(bytes), [&] { CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
  cudaFree(src);
  cudaFree(dst);
  return rate;
}

}  // namespace tpmoe::cuda
