// The whole model on the GPU against the CPU oracle and the reference: the fixture's teacher-forced
// logits, the fused and unfused paths against each other, and a preset generated on the device
// against the same preset generated on the host.
#include <gtest/gtest.h>

#include <algorithm>
#include <span>

#include "core/error.h"
#include "cuda_test_util.h"
#include "io/safetensors.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {
namespace {

// A whole forward in bf16 storage against fp32: the bound for the fixture (the measured
// figure is printed; docs/PERF.md records it).
constexpr double kModelTolerance = 3e-2;

struct ModelRun {
  std::vector<float> prefill, steps;
  std::vector<std::vector<int32_t>> generated;
};

std::vector<std::vector<int32_t>> rows_i64(const io::TensorView& v) {
  const auto values = io::to_i64(v);
  std::vector<std::vector<int32_t>> out;
  for (int64_t b = 0; b < v.shape[0]; ++b)
    out.emplace_back(values.begin() + b * v.shape[1], values.begin() + (b + 1) * v.shape[1]);
  return out;
}

ModelRun run_model(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                   const std::vector<std::vector<int32_t>>& forced, int new_tokens) {
  GenerateRequest req;
  req.prompts = prompts;
  req.forced_tokens = forced;
  req.max_new_tokens = new_tokens;
  req.return_prefill_logits = true;
  const GenerateResult r = engine.generate(req);
  ModelRun out;
  for (const auto& p : r.prefill_logits) out.prefill.insert(out.prefill.end(), p.begin(), p.end());
  for (const auto& s : r.step_logits) out.steps.insert(out.steps.end(), s.begin(), s.end());
  out.generated = r.generated;
  return out;
}

EngineOptions cuda_options(bool shared_fusion = true) {
  EngineOptions o;
  o.device = "cuda";
  o.shared_expert_fusion = shared_fusion;
  return o;
}

// Prompt positions whose logits a bf16 engine cannot be held to: there the fp32 reference makes a
// discrete choice by less than bf16 can resolve. The lightning indexer of layer 2 keeps one key block
// over another by 0.00929 at position 37 (5.5017 vs 5.4924) and by 0.01435 at position 16 (7.8114 vs
// 7.7970): 0.17% and 0.18% of the score, under bf16's 0.39% spacing (2^-8) for the hidden state the
// scores come from. Measured with the CPU oracle (select_blocks) on this fixture; every other block
// choice and every router top-k boundary of the prompt has a margin of 1% or more. A bf16 engine may
// keep the other block there, and the whole position's logits move (seen: 0.2 at those positions
// with shared-expert fusion on, under 0.01 everywhere else).
const std::vector<int> kUnresolvablePositions = {16, 37};

// Relative L2 over the [P, V] prefill logits, leaving out the positions above.
double prefill_error_resolvable(const std::vector<float>& got, const std::vector<float>& want, int V) {
  std::vector<float> a, b;
  for (size_t p = 0; p * V < want.size(); ++p) {
    if (std::find(kUnresolvablePositions.begin(), kUnresolvablePositions.end(), int(p)) != kUnresolvablePositions.end())
      continue;
    a.insert(a.end(), got.begin() + p * V, got.begin() + (p + 1) * V);
    b.insert(b.end(), want.begin() + p * V, want.begin() + (p + 1) * V);
  }
  return test::relative_l2(a, b);
}

// Per-position relative L2 of [P, V] logits, worst first: a flipped discrete choice shows up as one
// or two positions far above the rest.
void print_worst_positions(const char* what, const std::vector<float>& got, const std::vector<float>& want, int V) {
  std::vector<std::pair<double, int>> errs;
  for (size_t p = 0; p * V < want.size(); ++p)
    errs.push_back({test::relative_l2(std::span(got).subspan(p * V, V), std::span(want).subspan(p * V, V)), int(p)});
  std::sort(errs.rbegin(), errs.rend());
  std::printf("  %s worst positions:", what);
  for (size_t i = 0; i < std::min<size_t>(4, errs.size()); ++i) std::printf(" %d:%.3g", errs[i].second, errs[i].first);
  std::printf(" (median %.3g)\n", errs[errs.size() / 2].first);
}

TEST(CudaModel, FixtureMatchesReference) {
  TPMOE_REQUIRE_GPU();
  const auto dir = test::fixtures_dir() / "m3-tiny";
  const auto ref = io::SafetensorsSet::open_file(dir / "reference.safetensors");
  const auto prompts = rows_i64(*ref.find("input_ids"));
  const auto generated = rows_i64(*ref.find("generated_ids"));
  const int G = int(generated[0].size());
  const std::vector<float> ref_prefill = io::to_f32(*ref.find("prefill_logits"));
  const int V = int(ref.find("prefill_logits")->shape[2]);
  std::vector<ModelRun> runs;
  for (bool fused : {true, false}) {
    auto engine = Engine::from_checkpoint(dir, cuda_options(fused));
    const ModelRun r = run_model(*engine, prompts, generated, G);
    const double prefill_all = test::relative_l2(r.prefill, ref_prefill);
    const double prefill_err = prefill_error_resolvable(r.prefill, ref_prefill, V);
    const double step_err = test::relative_l2(r.steps, io::to_f32(*ref.find("step_logits")));
    std::printf("GPU fixture, shared-expert fusion %s: relative L2 prefill %.3g (all positions %.3g), steps %.3g\n",
                fused ? "on" : "off", prefill_err, prefill_all, step_err);
    print_worst_positions("prefill vs reference", r.prefill, ref_prefill, V);
    EXPECT_LT(prefill_err, kModelTolerance);
    EXPECT_LT(step_err, kModelTolerance);
    runs.push_back(r);
  }
  // The two GPU paths against each other, within the same bound.
  print_worst_positions("fused vs unfused prefill", runs[0].prefill, runs[1].prefill, V);
  EXPECT_LT(prefill_error_resolvable(runs[0].prefill, runs[1].prefill, V), kModelTolerance);
  EXPECT_LT(test::relative_l2(runs[0].steps, runs[1].steps), kModelTolerance);
}

TEST(CudaModel, FusedEqualsUnfused) {
  TPMOE_REQUIRE_GPU();
  const std::vector<std::vector<int32_t>> prompts{{3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4},
                                                  {2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4}};
  const std::vector<std::vector<int32_t>> forced{{10, 20, 30, 40, 50}, {60, 70, 80, 90, 100}};
  auto fused = Engine::from_preset("tiny", std::nullopt, 7, cuda_options(true));
  auto unfused = Engine::from_preset("tiny", std::nullopt, 7, cuda_options(false));
  const ModelRun a = run_model(*fused, prompts, forced, 6), b = run_model(*unfused, prompts, forced, 6);
  EXPECT_LT(test::relative_l2(a.prefill, b.prefill), kModelTolerance);
  EXPECT_LT(test::relative_l2(a.steps, b.steps), kModelTolerance);
}

TEST(CudaModel, DevicePresetMatchesCpuPreset) {
  TPMOE_REQUIRE_GPU();
  // The same seed gives bitwise the same weights on both; only the arithmetic differs. Three
  // sequences decode in a padded bucket of 4, through a recorded graph.
  const std::vector<std::vector<int32_t>> prompts{{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19},
                                                  {42, 17},
                                                  {5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                                   21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35}};
  const std::vector<std::vector<int32_t>> forced{{7, 7, 7, 7, 7, 7, 7}, {8, 8, 8, 8, 8, 8, 8}, {9, 9, 9, 9, 9, 9, 9}};
  auto gpu = Engine::from_preset("tiny", std::nullopt, 3, cuda_options());
  auto cpu = Engine::from_preset("tiny", std::nullopt, 3, EngineOptions{});
  const ModelRun a = run_model(*gpu, prompts, forced, 8), b = run_model(*cpu, prompts, forced, 8);
  const double prefill_err = test::relative_l2(a.prefill, b.prefill), step_err = test::relative_l2(a.steps, b.steps);
  std::printf("GPU vs CPU, tiny preset: relative L2 prefill %.3g, steps %.3g\n", prefill_err, step_err);
  EXPECT_LT(prefill_err, kModelTolerance);
  EXPECT_LT(step_err, kModelTolerance);
}

// tp 1 through the NCCL communicator (EngineOptions::nccl_at_tp1: communicator, symmetric window, device
// communicator, rank check, graphs recorded with the communicator present) reproduces the
// single-GPU engine: the same weights and kernels, so the logits agree to the last bit.
// A request whose KV cache cannot fit is refused before anything runs, with the sizes named; the
// engine stays usable afterwards.
TEST(CudaModel, RequestTooLargeForTheKvCacheIsAClearError) {
  TPMOE_REQUIRE_GPU();
  auto engine = Engine::from_preset("tiny", std::nullopt, 1, cuda_options());
  GenerateRequest huge;
  huge.prompts.assign(256, std::vector<int32_t>{1, 2, 3});
  huge.max_new_tokens = 1 << 24;  // 256 x 16M positions: far past the GPU's memory
  try {
    engine->generate(huge);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KV cache"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("GiB"), std::string::npos) << e.what();
  }
  GenerateRequest small;
  small.prompts = {{1, 2, 3}};
  small.max_new_tokens = 4;
  EXPECT_EQ(engine->generate(small).generated[0].size(), 4u);
}

TEST(CudaModel, NcclEngineAtTp1MatchesSingleGpu) {
  TPMOE_REQUIRE_GPU();
  const auto dir = test::fixtures_dir() / "m3-tiny";
  const auto ref = io::SafetensorsSet::open_file(dir / "reference.safetensors");
  const auto prompts = rows_i64(*ref.find("input_ids"));
  const auto generated = rows_i64(*ref.find("generated_ids"));
  const int G = int(generated[0].size());
  auto single = Engine::from_checkpoint(dir, cuda_options());
  const ModelRun a = run_model(*single, prompts, generated, G);
  EngineOptions through_nccl = cuda_options();
  through_nccl.nccl_at_tp1 = true;
  auto nccl = Engine::from_checkpoint(dir, through_nccl);
  const ModelRun b = run_model(*nccl, prompts, generated, G);
  const double prefill_err = test::relative_l2(a.prefill, b.prefill), step_err = test::relative_l2(a.steps, b.steps);
  std::printf("NCCL engine at tp 1 vs single GPU: relative L2 prefill %.3g, steps %.3g\n", prefill_err, step_err);
  EXPECT_LT(prefill_err, 1e-6);
  EXPECT_LT(step_err, 1e-6);
  EXPECT_EQ(a.generated, b.generated);
}

}  // namespace
}  // namespace tpmoe
