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

void throw_nccl_error(ncclResult_t result, const char* expr, const char* file, int line) {
  const char* last = ncclGetLastError(nullptr);
  throw Error(fmt::format("{} failed: {} ({}){}{}", expr, ncclGetErrorString(result), int(result),
                          last && *last ? ": " : "", last ? last : ""),
              file, line);
}

void check_nccl_version() {
  // NCCL's device API (nccl_device.h) is compiled into our kernels: its structures must match the
  // library that runs them, to the patch level. A mismatch crashed or hung when it was not caught.
  int loaded = 0;
  NCCL_CHECK(ncclGetVersion(&loaded));
  TPMOE_CHECK(loaded == NCCL_VERSION_CODE,
              "NCCL mismatch: this binary was built with NCCL {}.{}.{} (headers) but loaded NCCL {}.{}.{}; run it with "
              "the library it was built with (its RPATH names that folder) or rebuild with -DTPMOE_NCCL_ROOT "
              "pointing at the NCCL you run with",
              NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, loaded / 10000, loaded / 100 % 100, loaded % 100);
}

}  // namespace tpmoe::cuda
