// Helpers every kernel family shares: launch-argument checks, alignment, PDL launches, cp.async
// copies, pushes into another CTA of a cluster, the bf16 tensor-core mma, warp reductions and the
// packing of eight bf16 values into one 16-byte access. Device code plus a few host helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <source_location>
#include <string>
#include <tuple>
#include <utility>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_stream.h"

namespace tpmoe::cuda {

constexpr int kWarp = 32;

// A kernel cannot throw: its launcher rejects what the kernel does not support, as a tpmoe::Error
// that names the launcher's file and line (the caller's, not this header's).
inline void check_arg(bool ok, const std::string& what,
                      const std::source_location where = std::source_location::current()) {
  if (!ok) throw_cuda_error(cudaErrorInvalidValue, what.c_str(), where.file_name(), int(where.line()));
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Programmatic dependent launch (PDL). A decode step is a chain of small kernels, and without PDL
// each one pays its launch (grid setup, CTA dispatch) after the previous has drained. A kernel
// launched by launch_pdl may instead start while its predecessor in the stream still runs. The
// contract, for every kernel launched that way: call pdl_wait() in every thread, on every path,
// before reading anything an earlier kernel of the step wrote or writing any global memory (only
// reads of what no kernel of the step writes may go before it: weights, the step's inputs that the
// host uploaded before its first kernel, and what a caller vouches for, such as the attention's
// keys of earlier steps), then pdl_trigger(), which lets the successor launch. Since every kernel
// waits before it triggers, the kernel two back is complete whenever one starts. Both are no-ops
// for a kernel launched without the attribute.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// Lets `kernel` launch with `dynamic` bytes of dynamic shared memory (launch_pdl_clusters calls it for
// every launch that has some, so no launcher opts in by hand). Without an opt-in a block may
// have 48 KiB of shared memory in all, its static arrays included, so a launch whose dynamic bytes
// fit under 48 KiB alone but not next to the static ones fails (cudaErrorInvalidValue). The kernel's
// current limit (cudaFuncGetAttributes: 48 KiB less its static bytes until raised) decides, and the
// limit is only ever raised: a graph recorded with a larger launch stays launchable.
template <class... KArgs>
void allow_dynamic_smem(void (*kernel)(KArgs...), size_t dynamic) {
  cudaFuncAttributes attr{};
  CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (dynamic > size_t(attr.maxDynamicSharedSizeBytes))
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dynamic)));
}

// Clusters of up to 8 CTAs launch on every sm_90 part (the portable size); up to 16 need the kernel's
// opt-in (allow_nonportable_clusters), and whether a GPU holds a given number of them at once depends on
// its GPCs and the kernel's resources (max_active_clusters).
constexpr unsigned kPortableClusterSize = 8;
constexpr unsigned kMaxClusterSize = 16;

template <class... KArgs>
void allow_nonportable_clusters(void (*kernel)(KArgs...)) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
}

namespace detail {
// Memo of max_active_clusters per launch shape: the answer depends only on the key, so the driver
// is asked once per shape, not on every launch.
struct ClusterQuery {
  int device;
  const void* kernel;
  unsigned threads;
  size_t smem;
  unsigned cluster;
  bool operator<(const ClusterQuery& o) const {
    return std::tie(device, kernel, threads, smem, cluster) <
           std::tie(o.device, o.kernel, o.threads, o.smem, o.cluster);
  }
};
inline std::mutex& cluster_memo_mutex() {
  static std::mutex m;
  return m;
}
inline std::map<ClusterQuery, int>& cluster_memo() {
  static std::map<ClusterQuery, int> memo;
  return memo;
}
}  // namespace detail

// How many clusters of `cluster` CTAs (along z) of `kernel`, at `threads` a CTA and `smem` bytes of
// dynamic shared memory, the current device holds resident at once (cudaOccupancyMaxActiveClusters;
// 0: none). A grid of more clusters than that runs them in waves: the last ones start only as
// earlier ones finish. Opts the kernel in to the shared memory and, above kPortableClusterSize, to
// the cluster size first, as its launch does.
template <class... KArgs>
int max_active_clusters(void (*kernel)(KArgs...), unsigned threads, size_t smem, unsigned cluster) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const detail::ClusterQuery key{device, reinterpret_cast<const void*>(kernel), threads, smem, cluster};
  const std::lock_guard<std::mutex> lock(detail::cluster_memo_mutex());
  auto& memo = detail::cluster_memo();
  if (const auto it = memo.find(key); it != memo.end()) return it->second;
  if (smem > 0) allow_dynamic_smem(kernel, smem);
  if (cluster > kPortableClusterSize) allow_nonportable_clusters(kernel);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1, 1, cluster);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim = {1, 1, cluster};
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
  memo.emplace(key, clusters);
  return clusters;
}

// Launches `kernel` on on.stream, with the programmatic-stream-serialization attribute when on.pdl
// (kernel_stream.h), a plain launch otherwise; the kernel must keep the pdl_wait contract above
// either way. cluster_z > 1 launches clusters of that many CTAs along z (grid.z a multiple of it; at
// most kMaxClusterSize), whose CTAs are resident together and may read each other's shared memory.
template <class... KArgs, class... Args>
void launch_pdl_clusters(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, KernelStream on,
                         unsigned cluster_z, Args&&... args) {
  if (smem > 0) allow_dynamic_smem(kernel, smem);
  if (cluster_z > kPortableClusterSize) allow_nonportable_clusters(kernel);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = on.stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (on.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {1, 1, cluster_z};
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// The current device's SM count (a host query, no sync; fine inside a graph capture): launchers size
// their grids and splits from it per launch, so a process driving GPUs of different kinds gets each
// one's own.
inline int sm_count() {
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

template <class... KArgs, class... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, KernelStream on, Args&&... args) {
  launch_pdl_clusters(kernel, grid, block, smem, on, 1u, std::forward<Args>(args)...);
}

// The shared-state-space address of a pointer into this CTA's shared memory (what PTX shared::cta takes).
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared without the registers (cp.async.cg: L2 only); zeros where !valid. A
// thread's copies since its last commit form a group; wait_group<N> returns when at most N of its
// groups are still in flight (then a barrier makes every thread's copies visible to the block).
__device__ __forceinline__ void cp_async16(void* smem, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(global),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait_group<0>(); }

// One CTA of a thread-block cluster collecting what the others push into its shared memory (sm_90).
// The collector's thread sets up an mbarrier that completes once `bytes` have landed (its one
// arrival is this call; each push counts its bytes off), and fences the initialisation for the
// cluster. Every thread of every CTA then arrives on the cluster barrier (cluster_arrive_relaxed)
// and waits on it (cluster_wait) before its first push or before it exits: the barrier is then set
// up and every CTA has started. A push (st.async) needs no fence: the mbarrier's completion
// releases the pushed bytes to the collector's threads that wait on it (mbarrier_wait_phase0).
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait;\n" ::: "memory"); }
// Every thread of every CTA of the cluster arrives and waits: the cluster's __syncthreads. The
// arrival releases and the wait acquires, so what a thread wrote (to its own or another CTA's shared
// memory) before it is seen by every thread of the cluster after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// atomicMax on a uint32 at cluster shared address `at` (another CTA's, or this one's), its result unused.
__device__ __forceinline__ void cluster_max_u32(uint32_t at, uint32_t v) {
  asm volatile("red.relaxed.cluster.shared::cluster.max.u32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
}
// The address, in the cluster's shared window, of this CTA's shared address `local` in the CTA of rank `rank`.
__device__ __forceinline__ uint32_t cluster_map(uint32_t local, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
// Stores N floats (1, 2, 4 or 8; 4N-byte aligned, 16 for 8) at cluster address `at`, counted off the
// mbarrier at cluster address `bar`.
template <int N>
__device__ __forceinline__ void push_floats(uint32_t at, const float* v, uint32_t bar) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "push_floats: 1, 2, 4 or 8 floats");
  if constexpr (N == 1) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(at),
                 "r"(__float_as_uint(v[0])), "r"(bar)
                 : "memory");
  } else if constexpr (N == 2) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n" ::"r"(at),
                 "r"(__float_as_uint(v[0])), "r"(__float_as_uint(v[1])), "r"(bar)
                 : "memory");
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4)
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                       at + 4 * i),
                   "r"(__float_as_uint(v[i])), "r"(__float_as_uint(v[i + 1])), "r"(__float_as_uint(v[i + 2])),
                   "r"(__float_as_uint(v[i + 3])), "r"(bar)
                   : "memory");
  }
}
// Returns once the mbarrier's first phase has completed (every expected byte landed).
__device__ __forceinline__ void mbarrier_wait_phase0(uint64_t* bar) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, "
        "p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar))
        : "memory");
  } while (!done);
}

// c += a b for one m16n8k16 tile: bf16 inputs, fp32 accumulators, in the fragment layout of the PTX
// ISA's mma.m16n8k16 (a0..a3: rows g / g + 8, k 2t.. / 2t + 8..; b0, b1: column g, k 2t.. / 2t + 8..).
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
// For packed (key, index) values: the warp's argmax in one reduction.
__device__ __forceinline__ unsigned long long warp_max(unsigned long long v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most kMaxBlockThreads); every thread gets the
// total. One shape for every normalising kernel, so the fused all-reduce norms and the plain norm
// give the same bits for the same row.
constexpr int kMaxBlockThreads = 1024;
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_totals[kMaxBlockThreads / kWarp];
  __shared__ float total;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x / kWarp) ? warp_totals[lane] : 0.f;
    v = warp_sum(v);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 t = __bfloat1622float2(h[j]);
    f[2 * j] = t.x;
    f[2 * j + 1] = t.y;
  }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return raw;
}

// SwiGLU-OAI (SPEC §1.6) of one (gate, up) pair, fp32; expf, not __expf, to track the CPU oracle.
__device__ __forceinline__ float swiglu_oai(float gate, float up, float alpha, float limit) {
  gate = fminf(gate, limit);
  up = fminf(fmaxf(up, -limit), limit);
  return (up + 1.f) * gate * (1.f / (1.f + expf(-(alpha * gate))));
}

}  // namespace tpmoe::cuda
