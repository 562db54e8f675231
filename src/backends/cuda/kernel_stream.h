// Where a launcher enqueues its kernels: the stream, and whether they launch with programmatic
// dependent launch (kernel_utils.cuh's launch_pdl). PDL is on unless the owner of the stream says
// otherwise (CudaOpsOptions::pdl, `--pdl off`: a step measured without it); a launcher may turn it
// off for some of its kernels (with_pdl), never on. A bare stream converts to one with PDL on, so a
// test or tool that owns a stream passes just that. Host code.
#pragma once

#include <cuda_runtime.h>

namespace tpmoe::cuda {

struct KernelStream {
  cudaStream_t stream = nullptr;
  bool pdl = true;
  KernelStream(cudaStream_t s = nullptr, bool pdl_on = true) : stream(s), pdl(pdl_on) {}  // implicit: see above
  KernelStream with_pdl(bool on) const { return {stream, pdl && on}; }
};

}  // namespace tpmoe::cuda
