// Tensor parallelism across real GPUs (ctest label "gpu2"; each test skips cleanly with fewer than 2
// GPUs): tp 2 against tp 1 on the fixture and on a random M3-shaped model with the all-reduce fusion
// on and off, one process per GPU under mpirun against a thread per GPU, and the fused all-reduce
// + RMSNorm kernel run thousands of times with rank-dependent delays, every result checked exactly.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/nccl_comm.h"
#include "cuda_test_util.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {
namespace {

int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

#define TPMOE_REQUIRE_GPUS(n) \
  TPMOE_REQUIRE_GPU();        \
  if (gpu_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs, " << gpu_count() << " visible"

// bf16 storage on both sides: tp changes the order of the sums and where partials are rounded to
// bf16 (each rank's partial is rounded before the reduction). The bound is the bf16 tolerance of
// the other GPU tests; a wrong slice or a lost reduction is off by O(1).
constexpr double kTpBound = 2e-2;

struct Logits {
  std::vector<float> prefill, steps;
  std::vector<std::vector<int32_t>> generated;
};

Logits run(Engine& engine, const GenerateRequest& req) {
  const GenerateResult r = engine.generate(req);
  return {test::concat(r.prefill_logits), test::concat(r.step_logits), r.generated};
}

EngineOptions gpu_options(int tp, bool allreduce_fusion = true) {
  EngineOptions o;
  o.device = "cuda";
  o.tp = tp;
  o.allreduce_fusion = allreduce_fusion;
  return o;
}

TEST(CudaMultiGpu, FixtureAtTp2MatchesTp1) {
  TPMOE_REQUIRE_GPUS(2);
  const GenerateRequest req = test::teacher_forced_request(test::load_fixture_reference());
  const auto dir = test::fixtures_dir() / "m3-tiny";
  const Logits base = run(*Engine::from_checkpoint(dir, gpu_options(1)), req);
  for (bool fused : {true, false}) {
    const Logits r = run(*Engine::from_checkpoint(dir, gpu_options(2, fused)), req);
    const double prefill = test::relative_l2(r.prefill, base.prefill), steps = test::relative_l2(r.steps, base.steps);
    std::printf("fixture tp 2 (all-reduce fusion %s) vs tp 1: relative L2 prefill %.3g, steps %.3g\n",
                fused ? "on" : "off", prefill, steps);
    EXPECT_LT(prefill, kTpBound);
    EXPECT_LT(steps, kTpBound);
  }
}

TEST(CudaMultiGpu, M3ShapedModelAtTp2MatchesTp1) {
  TPMOE_REQUIRE_GPUS(2);
  // Two full-width MiniMax-M3 layers (hidden 6144, 128 experts, vocab 200064): the real slicing.
  GenerateRequest req;
  for (int b = 0; b < 3; ++b) {
    std::vector<int32_t> p, f;
    for (int i = 0; i < 70; ++i) p.push_back(int32_t(1 + (b * 131 + i * 29) % 200000));
    for (int i = 0; i < 4; ++i) f.push_back(int32_t(7 + b * 1000 + i * 77));
    req.prompts.push_back(p);
    req.forced_tokens.push_back(f);
  }
  req.max_new_tokens = 5;
  const Logits base = run(*Engine::from_preset("m3", 2, 5, gpu_options(1)), req);
  for (bool fused : {true, false}) {
    const Logits r = run(*Engine::from_preset("m3", 2, 5, gpu_options(2, fused)), req);
    const double steps = test::relative_l2(r.steps, base.steps);
    std::printf("m3 2 layers tp 2 (all-reduce fusion %s) vs tp 1: relative L2 steps %.3g\n", fused ? "on" : "off",
                steps);
    EXPECT_LT(steps, kTpBound);
  }
}

TEST(CudaMultiGpu, MpirunMatchesThreadPerGpu) {
  TPMOE_REQUIRE_GPUS(2);
  const std::string args = "generate --device cuda --preset tiny --prompt-ids 3,1,4,1,5,9,2,6 --max-new-tokens 8";
  const auto threads = test::run_cli(args + " --tp 2");
  ASSERT_EQ(threads.exit_code, 0) << threads.output;
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not installed";
  const auto mpi = test::run_cli_with_prefix("mpirun --allow-run-as-root -np 2", args);
  ASSERT_EQ(mpi.exit_code, 0) << mpi.output;
  auto ids = [](const std::string& out) {
    const size_t a = out.find("sequence 0: ");
    return a == std::string::npos ? std::string() : out.substr(a, out.find('\n', a) - a);
  };
  EXPECT_FALSE(ids(threads.output).empty()) << threads.output;
  EXPECT_EQ(ids(mpi.output), ids(threads.output)) << mpi.output;
  // Only rank 0 prints the result.
  EXPECT_EQ(mpi.output.find("sequence 0: "), mpi.output.rfind("sequence 0: ")) << mpi.output;
}

// Rank r's partial: multiples of 1/64, exact in bf16, and their sum over ranks exact in fp32.
float rank_value(int rank, size_t i, int iter) {
  return float(int((i * 7 + size_t(rank) * 13 + iter) % 31) - 15) / 64.f;
}

// The fused kernels (push, one-shot) with two real ranks, thousands of times, with rank-dependent
// delays between calls so the ranks arrive in every order (and the push mailboxes are written
// while a peer is still reading the other buffer); every output element checked exactly.
TEST(CudaMultiGpu, FusedAllreduceStressWithRankDependentDelays) {
  TPMOE_REQUIRE_GPUS(2);
  constexpr int kRanks = 2, kIters = 3000, H = 6144;
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<int> errors(kRanks, 0);
  auto body = [&](int rank) {
    CUDA_CHECK(cudaSetDevice(rank));
    cuda::NcclCommunicator comm(id, kRanks, rank, H);
    ASSERT_TRUE(comm.fused_available());
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    comm.set_stream(stream);
    for (int iter = 0; iter < kIters; ++iter) {
      const int T = 1 + iter % 16;
      const size_t n = size_t(T) * H;
      std::vector<float> p(n), residual(n, 0.f), sum(n, 0.f);
      for (size_t i = 0; i < n; ++i) {
        p[i] = rank_value(rank, i, iter);
        for (int q = 0; q < kRanks; ++q) sum[i] += rank_value(q, i, iter);
      }
      test::DeviceBuffer<__nv_bfloat16> d_partial(test::to_bf16(p));
      test::DeviceBuffer<float> d_residual(residual), d_weight(std::vector<float>(H, 0.f));
      test::DeviceBuffer<__nv_bfloat16> d_out(n);
      cuda::AddRmsNormParams prm{d_partial.get(), d_residual.get(), d_weight.get(), d_out.get(), T, H, 1e-6f};
      if ((iter + rank) % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50 * (rank + 1)));
      comm.allreduce_add_rmsnorm(prm, iter % 3 == 2 ? cuda::AllreducePath::kOneShot : cuda::AllreducePath::kPush);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<float> got = d_residual.download();
      for (size_t i = 0; i < n; ++i)
        if (got[i] != sum[i]) {
          ++errors[rank];
          break;
        }
    }
    comm.set_stream(nullptr);
    cudaStreamDestroy(stream);
  };
  std::thread peer(body, 1);
  body(0);
  peer.join();
  EXPECT_EQ(errors[0], 0);
  EXPECT_EQ(errors[1], 0);
}

}  // namespace
}  // namespace tpmoe
