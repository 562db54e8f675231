#include "backends/cuda/cuda_check.h"

#include "core/error.h"

namespace tpmoe::cuda {

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw_error(file, line,
              fmt::format("CUDA error {} ({}) in {}", cudaGetErrorName(err), cudaGetErrorString(err), expr));
}

void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line) {
  throw_error(
      file, line,
      fmt::format("cuBLAS error {} ({}) in {}", cublasLtGetStatusName(status), cublasLtGetStatusString(status), expr));
}

}  // namespace tpmoe::cuda
