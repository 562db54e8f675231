// Does the order in which a GEMV's warps read their weight rows decide the bandwidth they get?
//
// Under Nsight Compute on an H200 the single-token MoE GEMVs read their weights at 48-77% of DRAM
// peak, where a plain 16-byte read of the same bytes gets ~78% (docs/PERF.md), and neither more bytes
// in flight nor fewer instructions closed the gap. One difference not yet measured is the order of the reads: the
// down GEMV's warps each own kRows consecutive rows and read, at every step, the next 1 KiB of each of
// them, so at any moment the GPU's reads are a few KiB every row-length apart across the whole
// matrix; the stream reads one moving front of consecutive bytes. This runs the same loads under
// four orders, same grid, same bytes in flight per warp, same consumption (an XOR), cold L2:
//   stream   bandwidth.cu's read stream over the same bytes (the floor's ceiling);
//   rows     the down GEMV's order: warp-owned groups of R rows; step t reads, of every row of the
//            group, the 16-byte chunks t*L*32 + i*32 + lane (i < L);
//   group    the same groups and steps, but step t reads the group's R rows as one span, the next
//            R*L*512 bytes of it (so a step's bytes are consecutive);
//   front    the whole matrix as chunks of R*L*512 bytes, warp w's step t reading chunk t*W + w
//            (the warps together read one moving front, as the stream does).
// Each warp walks `slots` matrices of `rows` rows one after another (the down kernel's slots), two
// steps of loads in flight (the MoE GEMVs' pipeline). Prints microseconds (median of --reps replays,
// each after an untimed L2 flush) and GB/s. On an H100 the orders read alike, at the stream's rate,
// from 3 blocks an SM on (docs/PERF.md): the GEMVs' gap is not their order of reads.
//
//   bench_cuda_read [--rows N] [--row-bytes B] [--slots S] [--blocks-per-sm 3,7,16] [--reps R]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "backends/cuda/bandwidth.cuh"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_utils.cuh"
#include "bench_args.h"
#include "cold_l2_timer.h"

namespace tpmoe::cuda {
namespace {

using bench::parse_count;
using bench::require;

constexpr int kWarpsPerBlock = 4, kRows = 4, kLoads = 2;  // the down GEMV's shape (moe_gemv.cu)
constexpr int kStepBytes = kRows * kLoads * 512;          // a warp's bytes a step

enum class Order { kRows, kGroup, kFront };

struct ReadArgs {
  const uint8_t* data = nullptr;  // slots * rows * row_bytes
  size_t rows = 0, row_bytes = 0;
  int slots = 0;
  size_t front_warps = 0, front_steps = 0;  // Order::kFront: warps that read, and steps each
  uint32_t* sink = nullptr;                 // one word per warp
};

// As the MoE GEMVs load a weight: no L1 allocation, a 256-byte L2 fetch (weight_loads.cuh).
__device__ __forceinline__ uint4 load16(const uint8_t* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// Address of load j (j < kRows * kLoads) of a warp's step t, for lane `lane`.
template <Order kOrder>
__device__ __forceinline__ const uint8_t* address(const ReadArgs& a, size_t warp, size_t group, size_t t, int j,
                                                  int lane) {
  const size_t chunks = a.row_bytes / (kLoads * 512);  // steps per slot of a group
  const size_t slot = t / chunks, c = t % chunks;
  if constexpr (kOrder == Order::kRows) {
    const int r = j / kLoads, i = j % kLoads;
    const size_t row = slot * a.rows + group * kRows + r;
    return a.data + row * a.row_bytes + (c * kLoads + i) * 512 + lane * 16;
  } else if constexpr (kOrder == Order::kGroup) {
    const size_t span = (slot * a.rows + group * kRows) * a.row_bytes;
    return a.data + span + c * kStepBytes + size_t(j) * 512 + lane * 16;
  } else {
    const size_t chunk = t * a.front_warps + warp;
    return a.data + chunk * kStepBytes + size_t(j) * 512 + lane * 16;
  }
}

template <Order kOrder>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) read_kernel(const ReadArgs a) {
  const int lane = threadIdx.x % 32;
  const size_t warps = size_t(gridDim.x) * kWarpsPerBlock, warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  // kFront: one walk a warp (of the first front_warps), front_steps steps over its chunks.
  const size_t groups = kOrder == Order::kFront ? a.front_warps : a.rows / kRows;
  const size_t steps = kOrder == Order::kFront ? a.front_steps : a.slots * (a.row_bytes / (kLoads * 512));
  uint32_t acc = 0;
  for (size_t g = warp; g < groups; g += warps) {
    uint4 w[kRows * kLoads];
#pragma unroll
    for (int j = 0; j < kRows * kLoads; ++j) w[j] = load16(address<kOrder>(a, warp, g, 0, j, lane));
    for (size_t t = 0; t < steps; ++t) {
      uint4 cur[kRows * kLoads];
#pragma unroll
      for (int j = 0; j < kRows * kLoads; ++j) cur[j] = w[j];
      if (t + 1 < steps) {
#pragma unroll
        for (int j = 0; j < kRows * kLoads; ++j) w[j] = load16(address<kOrder>(a, warp, g, t + 1, j, lane));
      }
#pragma unroll
      for (int j = 0; j < kRows * kLoads; ++j) acc ^= cur[j].x ^ cur[j].y ^ cur[j].z ^ cur[j].w;
    }
  }
  if (acc == 0x9E3779B9u) a.sink[warp] = acc;  // keeps the loads; never true for the 0x5A fill
}

const char* order_name(Order o) { return o == Order::kRows ? "rows" : o == Order::kGroup ? "group" : "front"; }

int run(int argc, char** argv) {
  size_t rows = 6144, row_bytes = 6144;
  int slots = 5, reps = 20;
  std::vector<int> per_sm = {3, 7, 16};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    require(i + 1 < argc, arg + " needs a value");
    if (arg == "--rows")
      rows = size_t(parse_count(arg, argv[++i]));
    else if (arg == "--row-bytes")
      row_bytes = size_t(parse_count(arg, argv[++i]));
    else if (arg == "--slots")
      slots = int(std::min(parse_count(arg, argv[++i]), 64LL));
    else if (arg == "--reps")
      reps = int(std::min(parse_count(arg, argv[++i]), 1000LL));
    else if (arg == "--blocks-per-sm")
      per_sm = bench::parse_list(arg, argv[++i], 64);
    else
      require(false, "unknown argument '" + arg +
                         "' (bench_cuda_read [--rows N] [--row-bytes B] [--slots S] [--blocks-per-sm 3,7,16] "
                         "[--reps R])");
  }
  require(rows > 0 && rows % kRows == 0, "--rows must be a positive multiple of 4");
  require(row_bytes > 0 && row_bytes % (kLoads * 512) == 0, "--row-bytes must be a positive multiple of 1024");
  require(slots > 0 && reps > 0, "--slots and --reps must be positive");
  require(size_t(slots) * rows * row_bytes <= (size_t(16) << 30), "the matrix must fit 16 GiB");
  const size_t bytes = size_t(slots) * rows * row_bytes;
  ReadArgs a;
  a.rows = rows;
  a.row_bytes = row_bytes;
  a.slots = slots;
  void* data = nullptr;
  CUDA_CHECK(cudaMalloc(&data, bytes));
  CUDA_CHECK(cudaMemset(data, 0x5A, bytes));
  a.data = static_cast<const uint8_t*>(data);
  const int sms = sm_count();
  CUDA_CHECK(cudaMalloc(&a.sink, size_t(sms) * 64 * kWarpsPerBlock * sizeof(uint32_t)));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "device: %s (%d SMs); %d slots x %zu rows x %zu bytes = %.1f MB; %d-warp blocks, %d rows x %d loads a "
      "step (%d bytes a warp)\n",
      prop.name, sms, slots, rows, row_bytes, bytes / 1e6, kWarpsPerBlock, kRows, kLoads, kStepBytes);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  {
    bench::ColdL2Timer timer(stream, bench::Flush::kRead, reps);
    const double us = timer.time([&](cudaStream_t s) { launch_read_stream(data, bytes, timer.sink(), s); });
    std::printf("%-6s %14s %10.1f us %8.0f GB/s\n", "stream", "-", us, bytes / (us * 1e3));
    for (int b : per_sm) {
      const size_t warps = size_t(b) * sms * kWarpsPerBlock;
      for (Order o : {Order::kRows, Order::kGroup, Order::kFront}) {
        // kFront reads with as many warps as the other orders have groups to walk (the same bytes in
        // flight), each the same number of whole chunks: they must divide the matrix's chunks.
        const size_t chunks = bytes / kStepBytes, front_warps = std::min(warps, rows / kRows);
        if (o == Order::kFront && chunks % front_warps != 0) {
          std::printf("%-6s %3d blocks/SM  skipped: %zu chunks over %zu warps\n", order_name(o), b, chunks,
                      front_warps);
          continue;
        }
        auto kernel = o == Order::kRows    ? read_kernel<Order::kRows>
                      : o == Order::kGroup ? read_kernel<Order::kGroup>
                                           : read_kernel<Order::kFront>;
        ReadArgs args = a;
        args.front_warps = front_warps;
        args.front_steps = chunks / front_warps;
        const double us_o = timer.time([&](cudaStream_t s) {
          kernel<<<unsigned(b * sms), kWarpsPerBlock * 32, 0, s>>>(args);
          CUDA_CHECK_LAUNCH();
        });
        std::printf("%-6s %3d blocks/SM %10.1f us %8.0f GB/s\n", order_name(o), b, us_o, bytes / (us_o * 1e3));
      }
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  cudaFree(data);
  cudaFree(a.sink);
  return 0;
}

}  // namespace
}  // namespace tpmoe::cuda

int main(int argc, char** argv) { return tpmoe::bench::guarded_main("bench_cuda_read", tpmoe::cuda::run, argc, argv); }
