// Error checks for the CUDA runtime, cuBLASLt and NCCL: one family of macros, one exception type. Kernel files include
// this header only: it pulls in no fmt, so nvcc compiles the kernels without the host formatting library. The throwing
// functions live in cuda_check.cpp and raise tpmoe::Error like every other check.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nccl.h>

namespace tpmoe::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line);
[[noreturn]] void throw_nccl_error(ncclResult_t result, const char* expr, const char* file, int line);
// Throws unless the NCCL loaded at run time is the one whose headers this binary was compiled with.
void check_nccl_version();

}  // namespace tpmoe::cuda

#define CUDA_CHECK(expr)                                                                                   \
  do {                                                                                                     \
    const cudaError_t tpmoe_err_ = (expr);                                                                 \
    if (tpmoe_err_ != cudaSuccess) ::tpmoe::cuda::throw_cuda_error(tpmoe_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After every kernel launch: a bad configuration surfaces here, not at the next sync.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUBLAS_CHECK(expr)                                                                                           \
  do {                                                                                                               \
    const cublasStatus_t tpmoe_st_ = (expr);                                                                         \
    if (tpmoe_st_ != CUBLAS_STATUS_SUCCESS) ::tpmoe::cuda::throw_cublas_error(tpmoe_st_, #expr, __FILE__, __LINE__); \
  } while (0)

#define NCCL_CHECK(expr)                                                                                     \
  do {                                                                                                       \
    const ncclResult_t tpmoe_nccl_ = (expr);                                                                 \
    if (tpmoe_nccl_ != ncclSuccess) ::tpmoe::cuda::throw_nccl_error(tpmoe_nccl_, #expr, __FILE__, __LINE__); \
  } while (0)
