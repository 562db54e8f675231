// The fused all-reduce + residual + RMSNorm kernels (allreduce.cuh) with N ranks emulated on one GPU
// (N windows, each rank's phases launched in turn), and the NCCL communicator at tp 1 (window
// registration, device communicator, the degenerate reduction) against launch_add_rmsnorm.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/allreduce.cuh"
#include "backends/cuda/nccl_comm.h"
#include "backends/cuda/norm.cuh"
#include "cuda_test_util.h"
#include "model/rank_checks.h"
#include "test_util.h"

namespace tpmoe {
namespace {

using cuda::AllreduceAlgo;
using test::DeviceBuffer;

// Rank r's partial: multiples of 1/64 in [-15/64, 15/64], exact in bf16, and any sum of up to 8
// of them is exact in fp32: the reduced value is known exactly, independent of summation order.
float rank_value(int rank, size_t i) { return float(int((i * 7 + size_t(rank) * 13) % 31) - 15) / 64.f; }

struct Case {
  int nranks, rows, hidden;
};

void run_emulated(const Case& c, AllreduceAlgo algo) {
  const int N = c.nranks, T = c.rows, H = c.hidden;
  const size_t n = size_t(T) * H;
  const cuda::WindowLayout layout = cuda::WindowLayout::make(512, H);
  const std::vector<float> residual0 = test::random_floats(n, 1.f, 1000 + T);
  std::vector<float> weight = test::random_floats(size_t(H), 0.1f, 7);

  std::vector<std::unique_ptr<DeviceBuffer<char>>> windows;
  std::vector<std::unique_ptr<DeviceBuffer<__nv_bfloat16>>> partials, outs;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> residuals;
  std::vector<void*> window_ptrs;
  std::vector<double> sum(n, 0.0);
  for (int r = 0; r < N; ++r) {
    std::vector<float> p(n);
    for (size_t i = 0; i < n; ++i) {
      p[i] = rank_value(r, i);
      sum[i] += p[i];
    }
    windows.push_back(std::make_unique<DeviceBuffer<char>>(layout.bytes));  // poisoned
    window_ptrs.push_back(windows.back()->get());
    if (algo == AllreduceAlgo::kPush) cuda::launch_allreduce_window_init(window_ptrs.back(), layout, nullptr);
    partials.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(test::to_bf16(p)));
    residuals.push_back(std::make_unique<DeviceBuffer<float>>(residual0));
    outs.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(n));  // poisoned
  }
  DeviceBuffer<float> w(weight);

  const std::vector<int> phases = algo == AllreduceAlgo::kTwoShot
                                      ? std::vector<int>{cuda::kPhaseCopy, cuda::kPhaseReduce, cuda::kPhaseGather}
                                      : std::vector<int>{cuda::kPhaseCopy, cuda::kPhaseReduce};
  for (int phase : phases) {
    for (int r = 0; r < N; ++r) {
      cuda::AllreduceNormParams p;
      p.partial = partials[r]->get();
      p.residual = residuals[r]->get();
      p.weight = w.get();
      p.out = outs[r]->get();
      p.rows = T;
      p.hidden = H;
      p.eps = 1e-6f;
      p.rank = r;
      p.nranks = N;
      p.window = layout;
      ASSERT_TRUE(cuda::allreduce_fused_supported(p));
      cuda::launch_allreduce_norm_emulated(p, algo, phase, window_ptrs.data(), nullptr);
    }
  }
  CUDA_CHECK(cudaDeviceSynchronize());

  // Oracle: the sum is exact, so residual + sum has one rounding on both sides.
  std::vector<float> want_res(n), want_y(n);
  for (size_t i = 0; i < n; ++i) want_res[i] = residual0[i] + float(sum[i]);
  for (int t = 0; t < T; ++t)
    cpu::gemma_rmsnorm_row(&want_res[size_t(t) * H], weight.data(), H, 1e-6f, &want_y[size_t(t) * H]);

  const std::vector<__nv_bfloat16> y0 = outs[0]->download();
  for (int r = 0; r < N; ++r) {
    const std::vector<float> res = residuals[r]->download();
    const std::vector<__nv_bfloat16> y = outs[r]->download();
    ASSERT_EQ(std::memcmp(res.data(), want_res.data(), n * sizeof(float)), 0)
        << "rank " << r << ": residual differs from residual + exact sum";
    const std::vector<float> yf = test::from_bf16(y);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(yf[i])) << "rank " << r << ": y[" << i << "] not written";
    EXPECT_LT(test::relative_l2(yf, want_y), test::kTolBf16) << "rank " << r;
    // Every rank computes bitwise the same y (the same code on the same fp32 values).
    EXPECT_EQ(std::memcmp(y.data(), y0.data(), n * sizeof(__nv_bfloat16)), 0) << "rank " << r << " differs from rank 0";
  }
}

const char* algo_name(AllreduceAlgo a) {
  return a == AllreduceAlgo::kOneShot ? "one-shot" : a == AllreduceAlgo::kTwoShot ? "two-shot" : "push";
}

TEST(CudaAllreduce, EmulatedRanksOneShotAndTwoShot) {
  TPMOE_REQUIRE_GPU();
  // Sizes across the one-shot/two-shot thresholds (16, 64, 512 tokens), rows fewer than ranks,
  // rows above the 128-CTA grid, and hidden sizes of 1, 2 and 4 chunks per thread and not a
  // multiple of the warp's 256 elements.
  const std::vector<int> rows{1, 3, 7, 16, 17, 19, 64, 65, 129, 300, 512};
  for (int N : {2, 4, 8})
    for (int T : rows)
      for (int H : {6144, 136, 12288, 20480})
        for (AllreduceAlgo algo : {AllreduceAlgo::kOneShot, AllreduceAlgo::kTwoShot}) {
          if (H != 6144 && T > 65) continue;  // the odd widths need no large batches
          SCOPED_TRACE(testing::Message() << "N=" << N << " T=" << T << " H=" << H << " " << algo_name(algo));
          run_emulated({N, T, H}, algo);
          if (HasFatalFailure()) return;
        }
}

TEST(CudaAllreduce, EmulatedRanksPush) {
  TPMOE_REQUIRE_GPU();
  for (int N : {2, 4, 8})
    for (int T : {1, 3, 16, 17, 64})
      for (int H : {6144, 136, 20480}) {
        SCOPED_TRACE(testing::Message() << "N=" << N << " T=" << T << " H=" << H << " push");
        run_emulated({N, T, H}, AllreduceAlgo::kPush);
        if (HasFatalFailure()) return;
      }
}

// The push mailbox over many calls on the same windows, with the batch growing and shrinking: the
// buffers alternate, every slot read is emptied again, and no call sees a previous call's rows
// (a stale row would be added twice and break the exact sum).
TEST(CudaAllreduce, EmulatedPushOverConsecutiveCallsOfChangingSize) {
  TPMOE_REQUIRE_GPU();
  const int N = 4, H = 256;
  const cuda::WindowLayout layout = cuda::WindowLayout::make(64, H);
  std::vector<std::unique_ptr<DeviceBuffer<char>>> windows;
  std::vector<void*> ptrs;
  for (int r = 0; r < N; ++r) {
    windows.push_back(std::make_unique<DeviceBuffer<char>>(layout.bytes));
    ptrs.push_back(windows.back()->get());
    cuda::launch_allreduce_window_init(ptrs.back(), layout, nullptr);
  }
  DeviceBuffer<float> w(std::vector<float>(size_t(H), 0.f));
  int call = 0;
  for (int T : {5, 64, 1, 17, 64, 3, 2, 40, 64, 1, 9}) {
    SCOPED_TRACE(testing::Message() << "call " << call << " T=" << T);
    const size_t n = size_t(T) * H;
    std::vector<std::unique_ptr<DeviceBuffer<__nv_bfloat16>>> partials, outs;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> residuals;
    std::vector<float> want(n, 0.f);
    for (int r = 0; r < N; ++r) {
      std::vector<float> p(n);
      for (size_t i = 0; i < n; ++i) {
        p[i] = rank_value(r, i + size_t(call) * 5);
        want[i] += p[i];  // exact: multiples of 1/64, at most 8 of them
      }
      partials.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(test::to_bf16(p)));
      residuals.push_back(std::make_unique<DeviceBuffer<float>>(std::vector<float>(n, 0.f)));
      outs.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(n));
    }
    for (int phase : {cuda::kPhaseCopy, cuda::kPhaseReduce})
      for (int r = 0; r < N; ++r) {
        cuda::AllreduceNormParams p;
        p.partial = partials[r]->get();
        p.residual = residuals[r]->get();
        p.weight = w.get();
        p.out = outs[r]->get();
        p.rows = T;
        p.hidden = H;
        p.rank = r;
        p.nranks = N;
        p.window = layout;
        cuda::launch_allreduce_norm_emulated(p, AllreduceAlgo::kPush, phase, ptrs.data(), nullptr);
      }
    CUDA_CHECK(cudaDeviceSynchronize());
    for (int r = 0; r < N; ++r)
      ASSERT_EQ(std::memcmp(residuals[r]->download().data(), want.data(), n * sizeof(float)), 0) << "rank " << r;
    ++call;
  }
}

TEST(CudaAllreduce, RejectsWhatTheKernelsDoNotTake) {
  cuda::AllreduceNormParams p;
  alignas(16) static float buf[64];
  p.partial = reinterpret_cast<const __nv_bfloat16*>(buf);
  p.residual = buf;
  p.weight = buf;
  p.out = reinterpret_cast<__nv_bfloat16*>(buf);
  p.rows = 4;
  p.hidden = 128;
  p.window = cuda::WindowLayout::make(8, 128);
  EXPECT_TRUE(cuda::allreduce_fused_supported(p));
  p.hidden = 100;  // not a multiple of 8
  EXPECT_FALSE(cuda::allreduce_fused_supported(p));
  p.hidden = 128;
  p.rows = 9;  // more rows than the window
  EXPECT_FALSE(cuda::allreduce_fused_supported(p));
  p.rows = 4;
  p.nranks = cuda::kMaxRanks + 1;
  EXPECT_FALSE(cuda::allreduce_fused_supported(p));
}

// The NCCL communicator of one rank: every path equals launch_add_rmsnorm bitwise (the degenerate
// sum of one partial), eagerly and replayed from a CUDA graph.
TEST(CudaAllreduce, NcclCommunicatorAtTp1MatchesAddRmsnorm) {
  TPMOE_REQUIRE_GPU();
  constexpr int kWindow = 64;
  for (int H : {6144, 128}) {
    ncclUniqueId id;  // one per communicator
    NCCL_CHECK(ncclGetUniqueId(&id));
    cuda::NcclCommunicator comm(id, 1, 0, H, {.window_tokens = kWindow});
    ASSERT_TRUE(comm.fused_available()) << "symmetric window / device communicator not available at tp 1";
    EXPECT_EQ(comm.rank(), 0);
    EXPECT_EQ(comm.size(), 1);
    // The fingerprint round trip.
    RankFingerprint mine;
    mine.magic = 1;
    mine.rank = 0;
    mine.tp = 1;
    mine.config_hash = 42;
    const auto all = comm.all_gather(mine);
    ASSERT_EQ(all.size(), 1u);
    EXPECT_EQ(std::memcmp(&all[0], &mine, sizeof mine), 0);

    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));
    comm.set_stream(stream);
    for (int T : {1, 5, 64, 100}) {
      const size_t n = size_t(T) * H;
      const auto partial = test::to_bf16(test::random_floats(n, 0.5f, 3 + T));
      const auto residual0 = test::random_floats(n, 1.f, 5 + T);
      DeviceBuffer<float> w(test::random_floats(size_t(H), 0.1f, 11));
      // The reference: launch_add_rmsnorm on its own copy.
      DeviceBuffer<__nv_bfloat16> ref_partial(partial), ref_y(n);
      DeviceBuffer<float> ref_res(residual0);
      cuda::launch_add_rmsnorm({ref_partial.get(), ref_res.get(), w.get(), ref_y.get(), T, H, 1e-6f}, stream);
      const auto want_res = ref_res.download();
      const auto want_y = ref_y.download();
      for (auto path : {cuda::AllreducePath::kAuto, cuda::AllreducePath::kPush, cuda::AllreducePath::kOneShot,
                        cuda::AllreducePath::kTwoShot, cuda::AllreducePath::kNccl}) {
        for (bool graph : {false, true}) {
          SCOPED_TRACE(testing::Message() << "H=" << H << " T=" << T << " " << cuda::allreduce_path_name(path)
                                          << (graph ? " (graph)" : ""));
          DeviceBuffer<__nv_bfloat16> part(partial), y(n);
          DeviceBuffer<float> res(residual0);
          const cuda::AddRmsNormParams p{part.get(), res.get(), w.get(), y.get(), T, H, 1e-6f};
          if (graph) {
            cudaGraph_t g;
            cudaGraphExec_t exec;
            CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            comm.allreduce_add_rmsnorm(p, path);
            CUDA_CHECK(cudaStreamEndCapture(stream, &g));
            CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
            CUDA_CHECK(cudaGraphLaunch(exec, stream));
            CUDA_CHECK(cudaStreamSynchronize(stream));
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(g);
          } else {
            comm.allreduce_add_rmsnorm(p, path);
            CUDA_CHECK(cudaStreamSynchronize(stream));
          }
          const auto got_res = res.download();
          const auto got_y = y.download();
          EXPECT_EQ(std::memcmp(got_res.data(), want_res.data(), n * sizeof(float)), 0) << "residual";
          EXPECT_EQ(std::memcmp(got_y.data(), want_y.data(), n * sizeof(__nv_bfloat16)), 0) << "y";
        }
      }
      // all_reduce of one rank leaves the data as it is.
      DeviceBuffer<__nv_bfloat16> data(partial);
      comm.all_reduce_bf16(data.get(), n);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto after = data.download();
      EXPECT_EQ(std::memcmp(after.data(), partial.data(), n * 2), 0);
    }
    comm.set_stream(nullptr);
    CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

TEST(CudaAllreduce, PathChoiceBySize) {
  TPMOE_REQUIRE_GPU();
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  cuda::NcclCommunicator comm(id, 1, 0, 6144, {.window_tokens = 512});
  ASSERT_TRUE(comm.fused_available());
  const auto& t = comm.thresholds();
  {  // A threshold for the push path selects it for that many rows, and the one-shot above.
    ncclUniqueId id2;
    NCCL_CHECK(ncclGetUniqueId(&id2));
    cuda::NcclCommunicator pushing(id2, 1, 0, 6144, {.window_tokens = 512, .push_max_tokens = 16});
    EXPECT_EQ(pushing.choose(16, 6144), cuda::AllreducePath::kPush);
    EXPECT_EQ(pushing.choose(17, 6144), cuda::AllreducePath::kOneShot);
  }
  EXPECT_EQ(comm.choose(1, 6144), cuda::AllreducePath::kOneShot);  // push: off until measured at tp > 1
  EXPECT_EQ(comm.choose(t.twoshot_max_tokens + 1, 6144), cuda::AllreducePath::kNccl);  // beyond the window
  EXPECT_EQ(comm.choose(4, 6100), cuda::AllreducePath::kNccl);                         // another width
  // Modelled defaults for N ranks (replaced by measured ones once multi-GPU hosts run the bench).
  const auto t8 = cuda::AllreduceThresholds::defaults(8, 512);
  EXPECT_LT(t8.oneshot_max_tokens, t8.twoshot_max_tokens);
}

}  // namespace
}  // namespace tpmoe
