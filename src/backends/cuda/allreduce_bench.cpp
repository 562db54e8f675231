// `tpmoe bench-op allreduce [--tp N]`: the all-reduce + residual + RMSNorm of one decode step at
// MiniMax-M3's hidden size, per step size T = 1, 2, 4, ..., 512 tokens (bf16 partials [T, 6144]):
//   one-shot, two-shot   the fused kernels on the symmetric window (the production launch)
//   nccl+norm            ncclAllReduce in place + launch_add_rmsnorm (the unfused path)
//   nccl                 ncclAllReduce alone
// Protocol: every rank (a thread per GPU, or a process per GPU under mpirun) records kIters calls
// of one path into a CUDA graph, replays it kWarmup times, then times kReps replays with CUDA
// events; the median per call is printed (rank 0's). Inputs stay L2-resident, as in a decode step
// whose partial was just written. Bytes per rank and call: T*H*(2 partial + 4+4 residual + 2 y)
// locally, plus the peer reads of allreduce.cuh. Rows are identical on every rank, so the ranks
// run the same sizes in the same order and the collectives pair up.
#include <cuda_bf16.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/nccl_comm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "model/rank_checks.h"

namespace tpmoe::cuda {

namespace {

constexpr int kHidden = 6144;
constexpr int kMaxTokens = 512;
constexpr int kIters = 20, kWarmup = 3, kReps = 15;

struct Row {
  int tokens = 0;
  AllreducePath chosen = AllreducePath::kNccl;
  double push_us = 0, oneshot_us = 0, twoshot_us = 0, nccl_norm_us = 0, nccl_us = 0;
};

// Median microseconds of one call of `op`, recorded kIters times into a graph.
template <class Op>
double time_graph(cudaStream_t stream, Op op) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kIters; ++i) op();
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < kWarmup; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> us;
  for (int i = 0; i < kReps; ++i) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(double(ms) * 1e3 / kIters);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

std::vector<Row> bench_rank(const ncclUniqueId& id, int tp, int rank) {
  NcclCommunicator comm(id, tp, rank, kHidden, {.window_tokens = kMaxTokens});
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  comm.set_stream(stream);
  const size_t n = size_t(kMaxTokens) * kHidden;
  __nv_bfloat16 *partial = nullptr, *y = nullptr;
  float *residual = nullptr, *weight = nullptr;
  CUDA_CHECK(cudaMalloc(&partial, n * 2));
  CUDA_CHECK(cudaMalloc(&y, n * 2));
  CUDA_CHECK(cudaMalloc(&residual, n * 4));
  CUDA_CHECK(cudaMalloc(&weight, kHidden * 4));
  {
    std::vector<uint16_t> p(n);
    std::vector<float> r(n), w(kHidden);
    for (size_t i = 0; i < n; ++i) {
      p[i] = f32_to_bf16(float(int(i % 13) - 6) / 1024.f);
      r[i] = float(int(i % 7) - 3) / 8.f;
    }
    for (int i = 0; i < kHidden; ++i) w[i] = float(i % 5) / 10.f;
    CUDA_CHECK(cudaMemcpy(partial, p.data(), n * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(residual, r.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(weight, w.data(), kHidden * 4, cudaMemcpyHostToDevice));
  }
  std::vector<Row> rows;
  for (int T = 1; T <= kMaxTokens; T *= 2) {
    AddRmsNormParams p{partial, residual, weight, y, T, kHidden, 1e-6f};
    Row row;
    row.tokens = T;
    row.chosen = comm.choose(T, kHidden);
    if (comm.fused_available()) {
      if (T <= comm.window_push_rows())
        row.push_us = time_graph(stream, [&] { comm.allreduce_add_rmsnorm(p, AllreducePath::kPush); });
      row.oneshot_us = time_graph(stream, [&] { comm.allreduce_add_rmsnorm(p, AllreducePath::kOneShot); });
      row.twoshot_us = time_graph(stream, [&] { comm.allreduce_add_rmsnorm(p, AllreducePath::kTwoShot); });
    }
    row.nccl_norm_us = time_graph(stream, [&] { comm.allreduce_add_rmsnorm(p, AllreducePath::kNccl); });
    row.nccl_us = time_graph(stream, [&] { comm.all_reduce_bf16(partial, size_t(T) * kHidden); });
    rows.push_back(row);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  comm.set_stream(nullptr);
  cudaFree(partial);
  cudaFree(y);
  cudaFree(residual);
  cudaFree(weight);
  cudaStreamDestroy(stream);
  return rows;
}

}  // namespace

void run_allreduce_bench(const RankLaunch& launch) {
  check_nccl_version();
  const int gpus = visible_gpus();
  if (!launch.multi_process) check_gpus_for_tp(launch.tp, gpus);
  for (int d : launch.local_devices) TPMOE_CHECK(d < gpus, "rank needs GPU {} but {} GPU(s) are visible", d, gpus);
  ncclUniqueId id{};
  if (launch.local_ranks.front() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  launch.broadcast_from_rank0(&id, sizeof id);
  std::vector<Row> rows;
  const int ranks = launch.tp;
  launch.on_local_ranks([&](size_t i) {
    CUDA_CHECK(cudaSetDevice(launch.local_devices[i]));
    auto mine = bench_rank(id, launch.tp, launch.local_ranks[i]);
    if (launch.local_ranks[i] == 0) rows = std::move(mine);
  });
  if (launch.local_ranks.front() != 0) return;  // rank 0 prints
  cudaDeviceProp prop{};
  int device = 0;
  cudaGetDevice(&device);
  cudaGetDeviceProperties(&prop, device);
  fmt::print(
      "all-reduce + residual + RMSNorm, hidden {}, bf16 partials, tp {} ({}), median of {} graph replays x {} "
      "calls, microseconds per call (rank 0)\n",
      kHidden, ranks, prop.name, kReps, kIters);
  fmt::print("{:>6} {:>9} {:>10} {:>8} {:>10} {:>10} {:>11} {:>9}\n", "tokens", "MB/rank", "auto", "push", "one-shot",
             "two-shot", "nccl+norm", "nccl");
  for (const Row& r : rows) {
    auto us = [](double v) { return v > 0 ? fmt::format("{:.2f}", v) : std::string("-"); };
    fmt::print("{:>6} {:>9.3f} {:>10} {:>8} {:>10} {:>10} {:>11} {:>9}\n", r.tokens,
               double(r.tokens) * kHidden * 2 / 1e6, allreduce_path_name(r.chosen), us(r.push_us), us(r.oneshot_us),
               us(r.twoshot_us), us(r.nccl_norm_us), us(r.nccl_us));
  }
  std::fflush(stdout);
}

}  // namespace tpmoe::cuda
