// Continuous batching on the GPU (paged KV cache, chunked prefill beside decode rows, recorded
// decode steps padded to buckets, preemption): each request's reply against what it gets alone
// from Engine::generate on the same GPU.
//
// A request served alone runs the very steps generate runs (its whole prompt in one prefill step,
// then decode steps padded to bucket 1), so its tokens must be identical. Requests served together
// share steps with others, and the GPU kernels are not batch-invariant (a GEMM of 9 rows may sum in
// another order than one of 1), so a near-tie may break differently: the replies must agree in
// full for all but one request; the count is printed.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "serving_test_util.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe::test {
namespace {

constexpr uint64_t kSeed = 7;

std::unique_ptr<Engine> gpu_engine() {
  EngineOptions o;
  o.device = "cuda";
  return Engine::from_preset("tiny", 4, kSeed, o);
}

TEST(CudaServing, ARequestServedAloneGetsExactlyWhatGenerateGives) {
  TPMOE_REQUIRE_GPU();
  auto engine = gpu_engine();
  ServeOptions o;
  o.max_batch = 8;
  o.max_context = 2048;  // the attention grid follows the step's context (256), not the cache's 2048
  for (const Case& c : greedy_cases(3, engine->vocab_size(), 12)) {
    const auto want = alone(*engine, c.prompt, c.sampling);
    const auto replies = serve_all(*engine, o, {c});
    EXPECT_EQ(replies.at(0).tokens, want) << "prompt of " << c.prompt.size();
  }
}

TEST(CudaServing, ConcurrentRequestsAgreeWithGenerateAlone) {
  TPMOE_REQUIRE_GPU();
  auto engine = gpu_engine();
  ServeOptions o;
  o.max_batch = 8;
  o.max_step_tokens = 16;  // chunked prefill beside decode rows
  o.max_context = 96;
  o.page_size = 8;
  o.kv_pages = 20;  // 8 running requests need up to 6 pages each: preemption
  std::vector<Case> cases = greedy_cases(12, engine->vocab_size(), 16);
  for (size_t i = 0; i < cases.size(); i += 3) {
    cases[i].sampling.temperature = 0.8f;
    cases[i].sampling.seed = 99 + i;
  }
  ServeStats stats;
  const auto replies = serve_all(*engine, o, cases, &stats);
  int identical = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto want = alone(*engine, cases[i].prompt, cases[i].sampling);
    const auto& got = replies.at(int(i)).tokens;
    ASSERT_EQ(got.size(), want.size()) << "request " << i;
    identical += got == want;
  }
  std::printf("served together: %d of %zu replies identical to generate alone (%llu preemptions)\n", identical,
              cases.size(), static_cast<unsigned long long>(stats.preemptions));
  EXPECT_GE(identical, int(cases.size()) - 1);
  EXPECT_GT(stats.preemptions, 0u) << "the pool never ran dry: preemption untested";
  EXPECT_EQ(stats.kv_pages_used, 0);
}

}  // namespace
}  // namespace tpmoe::test
