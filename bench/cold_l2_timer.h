// How the GPU benchmarks time their work (bench_moe, bench_cuda_gemm): what `body` enqueues is recorded
// once as a CUDA graph and replayed `reps` times, each replay after an L2 flush that is not timed; the
// median replay is the time. A decode step finds the L2 full of the previous layer's weights, clean
// lines of other addresses: the default flush (a read of a 256 MiB buffer) leaves it that way. A
// memset flush, the usual one, leaves dirty lines instead, whose write-back then runs inside the timed
// replay and competes with its reads (docs/PERF.md measures how much). Host code.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "backends/cuda/bandwidth.cuh"
#include "backends/cuda/cuda_check.h"

namespace tpmoe::bench {

enum class Flush { kRead, kMemset };

class ColdL2Timer {
 public:
  static constexpr size_t kFlushBytes = size_t(256) << 20;

  ColdL2Timer(cudaStream_t stream, Flush how, int reps) : stream_(stream), how_(how), reps_(reps) {
    CUDA_CHECK(cudaMalloc(&flush_, kFlushBytes));
    CUDA_CHECK(cudaMemset(flush_, 0x5A, kFlushBytes));
    CUDA_CHECK(cudaMalloc(&sink_, cuda::read_stream_sink_words() * sizeof(uint32_t)));
  }
  ~ColdL2Timer() {
    cudaFree(flush_);
    cudaFree(sink_);
  }
  ColdL2Timer(const ColdL2Timer&) = delete;
  ColdL2Timer& operator=(const ColdL2Timer&) = delete;

  // cuda::launch_read_stream's sink, for a benchmark that also times the read stream itself.
  uint32_t* sink() const { return sink_; }

  // Median microseconds of the replays. `body` also runs once before the recording, so cuBLASLt
  // plans and other lazy setup happen outside the capture.
  double time(const std::function<void(cudaStream_t)>& body) {
    body(stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    body(stream_);
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<cudaEvent_t> ev(2 * size_t(reps_));
    for (auto& e : ev) CUDA_CHECK(cudaEventCreate(&e));
    CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    for (int r = 0; r < reps_; ++r) {
      flush_l2(r);
      CUDA_CHECK(cudaEventRecord(ev[2 * r], stream_));
      CUDA_CHECK(cudaGraphLaunch(exec, stream_));
      CUDA_CHECK(cudaEventRecord(ev[2 * r + 1], stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<double> us;
    for (int r = 0; r < reps_; ++r) {
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * r], ev[2 * r + 1]));
      us.push_back(ms * 1e3);
    }
    for (auto& e : ev) cudaEventDestroy(e);
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }

 private:
  void flush_l2(int r) {
    if (how_ == Flush::kRead)
      cuda::launch_read_stream(flush_, kFlushBytes, sink_, stream_);
    else
      CUDA_CHECK(cudaMemsetAsync(flush_, r & 0xff, kFlushBytes, stream_));
  }

  cudaStream_t stream_;
  Flush how_;
  int reps_;
  void* flush_ = nullptr;
  uint32_t* sink_ = nullptr;
};

}  // namespace tpmoe::bench
