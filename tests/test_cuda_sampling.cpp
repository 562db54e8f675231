// The CUDA sampling op (CudaOps::sample -> src/backends/cuda/sampling.cu) against the CPU op, token
// for token. Both run model/sampling_math.h's exact arithmetic (Philox, exp/log from basic IEEE
// operations, fixed-point top-p sums, order-key thresholds), so the GPU must return exactly the
// CPU's ids: any difference is a bug, and the failure prints both tokens' scores, noise and the
// CPU's thresholds to show where. Rows: V in {8, 1000, 200064}, batch 1/3/19, every parameter
// combination below, flat rows (every token a candidate) and peaked rows (an LM's shape), random
// penalty histories; the ids start poisoned. Also: greedy rows equal the CUDA argmax op, and a
// timing table at V = 200064 (kernel time by CUDA events, and the op's host-synchronised time).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cpu/cpu_sampling.h"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/elementwise.cuh"
#include "backends/cuda/sampling.cuh"
#include "core/error.h"
#include "cuda_test_util.h"
#include "engine/sampling.h"
#include "sampling_test_util.h"

namespace tpmoe {
namespace {

using test::DeviceBuffer;

struct Combo {
  const char* name;
  SamplingParams sp;
};

// Short name for the many parameter sets below.
SamplingParams make(float t, int k = 0, float p = 1, float min_p = 0, float rep = 1, float pres = 0, float freq = 0) {
  return test::sampling_params(t, k, p, min_p, rep, pres, freq);
}

const std::vector<Combo>& combos() {
  static const std::vector<Combo> c = {
      {"greedy", make(0.f)},
      {"greedy + penalties", make(0.f, 0, 1, 0, 1.3f, 0.5f, 0.2f)},
      {"temperature 1", make(1.0f)},
      {"temperature 0.5", make(0.5f)},
      {"top_k 1", make(1.0f, 1)},
      {"top_k 50", make(1.0f, 50)},
      {"top_p 0.9", make(1.0f, 0, 0.9f)},
      {"top_p 0.001", make(1.0f, 0, 0.001f)},
      {"min_p 0.05", make(1.0f, 0, 1, 0.05f)},
      {"penalties", make(1.0f, 0, 1, 0, 1.3f, 0.5f, 0.2f)},
      {"top_k 40 + top_p 0.8", make(0.8f, 40, 0.8f)},
      {"all", make(0.7f, 100, 0.95f, 0.02f, 1.2f, -0.3f, 0.4f)},
  };
  return c;
}

// A row's sequence history: a prompt and generated tokens drawn from the vocabulary.
struct History {
  std::vector<int32_t> prompt, generated;
};

struct Batch {
  std::vector<float> logits;  // [R, V]
  std::vector<History> hist;
  SampleBatch batch;
};

Batch make_batch(int V, int R, const SamplingParams& sp, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  SampleBatchBuilder builder;
  for (int r = 0; r < R; ++r) {
    // Alternate flat rows (stddev 1: all tokens within the candidate cut) and peaked ones (stddev 6).
    const std::vector<float> row = test::random_floats(size_t(V), r % 2 ? 6.f : 1.f, rng());
    b.logits.insert(b.logits.end(), row.begin(), row.end());
    History h;
    std::uniform_int_distribution<int32_t> token(0, V - 1);
    const int prompt_len = int(rng() % 40), gen_len = int(rng() % 30);
    for (int i = 0; i < prompt_len; ++i) h.prompt.push_back(token(rng));
    // Generated tokens favour a few ids so counts > 1 occur.
    for (int i = 0; i < gen_len; ++i)
      h.generated.push_back(i % 3 ? token(rng) : h.generated.empty() ? 0 : h.generated[0]);
    SequencePenalties pen(sp, h.prompt);
    for (int32_t t : h.generated) pen.add_generated(t);
    builder.add_row(sp, rng(), uint32_t(rng() % 1000), pen);
    b.hist.push_back(std::move(h));
  }
  b.batch = builder.batch();
  return b;
}

// Why a row differs: the CPU's trace and both tokens' scores and noise.
std::string explain(const Batch& b, int V, int r, int32_t cpu_id, int32_t gpu_id) {
  const auto args = check_sample_batch(b.batch, int64_t(b.batch.rows.size()), V);
  const auto& a = args[size_t(r)];
  std::vector<float> scores(static_cast<size_t>(V));
  cpu::SampleTrace t;
  cpu::sample_row(b.logits.data() + size_t(r) * V, V, a, b.batch.penalty_token_ids.data() + a.penalty_begin,
                  b.batch.penalty_counts.data() + a.penalty_begin, scores.data(), &t);
  auto describe = [&](int32_t id) {
    if (id < 0 || id >= V) return fmt::format("id {} (not a token: unwritten or garbage)", id);
    const float g = sampling::gumbel_noise(a, uint32_t(id));
    return fmt::format("id {} score {:.9g} (key {:#x}) noise {:.9g} perturbed {:.9g}", id, scores[id],
                       sampling::order_key(scores[id]), g, sampling::add_rn(scores[id], g));
  };
  return fmt::format(
      "row {}: CPU {} | GPU {} | CPU trace: max {:.9g}, {} candidates, top-k key {:#x}, top-p key {:#x} "
      "(total {}, target {}), winner {:.9g}",
      r, describe(cpu_id), describe(gpu_id), t.max_score, t.num_candidates, t.top_k_key, t.top_p_key, t.top_p_total,
      t.top_p_target, t.winner_score);
}

cuda::CudaReserve small_reserve() {
  cuda::CudaReserve r;
  r.max_tokens = 64;
  r.arena_bytes = 1 << 20;
  return r;
}

TEST(CudaSampling, MatchesTheCpuOpTokenForToken) {
  TPMOE_REQUIRE_GPU();
  cuda::CudaOps gpu(small_reserve());
  cpu::CpuOps cpu;
  int compared = 0, mismatched = 0;
  uint64_t seed = 1;
  for (int V : {8, 1000, 200064}) {
    for (int R : {1, 3, 19}) {
      for (const Combo& c : combos()) {
        SCOPED_TRACE(testing::Message() << "V=" << V << " batch=" << R << " " << c.name);
        const Batch b = make_batch(V, R, c.sp, seed++);
        DeviceBuffer<float> d_logits(b.logits);
        DeviceBuffer<int32_t> d_ids(static_cast<size_t>(R));  // poisoned: -1 everywhere
        gpu.sample(Tensor::make(d_logits.get(), DType::kF32, R, V), b.batch, Tensor::make(d_ids.get(), DType::kI32, R));
        // The op runs on the ops' non-blocking stream, which a plain cudaMemcpy does not wait for.
        CUDA_CHECK(cudaStreamSynchronize(gpu.stream()));
        const std::vector<int32_t> got = d_ids.download();
        std::vector<float> host = b.logits;
        std::vector<int32_t> want(static_cast<size_t>(R), -2);
        cpu.sample(Tensor::make(host.data(), DType::kF32, R, V), b.batch, Tensor::make(want.data(), DType::kI32, R));
        for (int r = 0; r < R; ++r) {
          ++compared;
          if (got[r] != want[r]) {
            ++mismatched;
            ADD_FAILURE() << explain(b, V, r, want[r], got[r]);
          }
        }
      }
    }
  }
  std::printf(
      "CUDA sampling vs CPU: %d rows compared over V {8, 1000, 200064} x batch {1, 3, 19} x %zu parameter "
      "combinations, %d differ (must be 0: the arithmetic is exact on both)\n",
      compared, combos().size(), mismatched);
}

TEST(CudaSampling, GreedyRowsEqualTheArgmaxOp) {
  TPMOE_REQUIRE_GPU();
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int V = 200064, R = 5;
  std::vector<float> logits = test::random_floats(size_t(R) * V, 2.f, 5);
  logits[size_t(1) * V + 7] = logits[size_t(1) * V + 150000] = 40.f;                 // tie: the first
  logits[size_t(2) * V + 99] = std::nanf("");                                        // NaN wins (torch.argmax)
  std::fill(logits.begin() + size_t(3) * V, logits.begin() + size_t(4) * V, -kInf);  // all -inf: 0
  SampleBatchBuilder builder;
  for (int r = 0; r < R; ++r) builder.add_greedy_row();
  cuda::CudaOps gpu(small_reserve());
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<int32_t> d_sampled(static_cast<size_t>(R)), d_argmax(static_cast<size_t>(R));
  gpu.sample(Tensor::make(d_logits.get(), DType::kF32, R, V), builder.batch(),
             Tensor::make(d_sampled.get(), DType::kI32, R));
  gpu.argmax(Tensor::make(d_logits.get(), DType::kF32, R, V), Tensor::make(d_argmax.get(), DType::kI32, R), Tensor());
  CUDA_CHECK(cudaStreamSynchronize(gpu.stream()));
  const std::vector<int32_t> sampled = d_sampled.download(), argmax = d_argmax.download();
  EXPECT_EQ(sampled, argmax);
  EXPECT_EQ(sampled[1], 7);
  EXPECT_EQ(sampled[2], 99);
  EXPECT_EQ(sampled[3], 0);
}

// A vocab-parallel step's winners combined on the device (as the CPU combines them: the argmax of
// the whole row), kept, and fed back to the next step's embed for the rows that ask for them, as
// the CPU embeds the same ids; the kept ids reach the host oldest first.
TEST(CudaSampling, CombinedWinnersAreKeptAndFedBackToTheNextStep) {
  TPMOE_REQUIRE_GPU();
  const int R = 6, ranks = 4, slice = 50, V = ranks * slice, H = 64;
  const test::GatheredWinners w = test::gathered_winners(test::random_floats(size_t(R) * V, 2.f, 9), R, ranks, slice);
  cuda::CudaOps gpu(small_reserve());
  cpu::CpuOps cpu;
  DeviceBuffer<int32_t> d_gathered(w.gathered), d_ids(static_cast<size_t>(R));
  gpu.combine_vocab_argmax(Tensor::make(d_gathered.get(), DType::kI32, int64_t(w.gathered.size()), 1), slice,
                           Tensor::make(d_ids.get(), DType::kI32, R, 1));
  gpu.keep_ids(Tensor::make(d_ids.get(), DType::kI32, R, 1));
  std::vector<int32_t> want = w.want;
  cpu.keep_ids(Tensor::make(want.data(), DType::kI32, R, 1));

  CacheShape shape;
  shape.max_seqs = R;
  shape.max_len = 1;
  shape.num_pages = R;
  gpu.init_cache(shape);
  cpu.init_cache(shape);
  StepTokens step;
  step.token_ids = {StepTokens::kFedBackId, 3, StepTokens::kFedBackId, V - 1, StepTokens::kFedBackId, 0};
  step.positions.assign(size_t(R), 0);
  for (int r = 0; r < R; ++r) step.seq_slots.push_back(r);
  gpu.begin_step(step);
  cpu.begin_step(step);
  std::vector<float> table = test::round_bf16(test::random_floats(size_t(V) * H, 1.f, 10)), ref(size_t(R) * H);
  DeviceBuffer<__nv_bfloat16> d_table(test::to_bf16(table));
  DeviceBuffer<float> d_out(size_t(R) * H);
  gpu.embed(Tensor::make(d_table.get(), DType::kBF16, V, H), Tensor::make(d_out.get(), DType::kF32, R, H));
  cpu.embed(Tensor::make(table.data(), DType::kF32, V, H), Tensor::make(ref.data(), DType::kF32, R, H));

  std::vector<int32_t> next = {7, 8, 9};
  DeviceBuffer<int32_t> d_next(next);
  gpu.keep_ids(Tensor::make(d_next.get(), DType::kI32, 3, 1));
  EXPECT_EQ(gpu.take_kept_ids(), w.want);
  EXPECT_EQ(gpu.take_kept_ids(), next);
  EXPECT_THROW(gpu.take_kept_ids(), Error);
  EXPECT_EQ(d_out.download(), ref);  // widening bf16 is exact: the rows of the same ids are equal
}

TEST(CudaSampling, SeedsReproduceAcrossBatches) {
  TPMOE_REQUIRE_GPU();
  // Row 0 of a batch of 1 and the same row inside a batch of 19 (other params around it) agree.
  const int V = 200064;
  const SamplingParams sp = make(1.0f, 50, 0.9f);
  const Batch big = make_batch(V, 19, sp, 77);
  SampleBatch alone;
  alone.rows = {big.batch.rows[5]};
  const auto& o = big.batch.penalty_offsets;
  alone.penalty_offsets = {0, o[6] - o[5]};
  alone.penalty_token_ids.assign(big.batch.penalty_token_ids.begin() + o[5],
                                 big.batch.penalty_token_ids.begin() + o[6]);
  alone.penalty_counts.assign(big.batch.penalty_counts.begin() + o[5], big.batch.penalty_counts.begin() + o[6]);
  cuda::CudaOps gpu(small_reserve());
  DeviceBuffer<float> d_big(big.logits);
  DeviceBuffer<int32_t> d_big_ids(19), d_alone_id(1);
  gpu.sample(Tensor::make(d_big.get(), DType::kF32, 19, V), big.batch, Tensor::make(d_big_ids.get(), DType::kI32, 19));
  gpu.sample(Tensor::make(d_big.get() + size_t(5) * V, DType::kF32, 1, V), alone,
             Tensor::make(d_alone_id.get(), DType::kI32, 1));
  CUDA_CHECK(cudaStreamSynchronize(gpu.stream()));
  EXPECT_EQ(d_alone_id.download()[0], d_big_ids.download()[5]);
}

TEST(CudaSampling, BadBatchIsAnError) {
  TPMOE_REQUIRE_GPU();
  cuda::CudaOps gpu(small_reserve());
  DeviceBuffer<float> d_logits(std::vector<float>(20, 0.f));
  DeviceBuffer<int32_t> d_ids(2);
  SampleBatch b;
  b.rows.resize(1);
  EXPECT_THROW(
      gpu.sample(Tensor::make(d_logits.get(), DType::kF32, 2, 10), b, Tensor::make(d_ids.get(), DType::kI32, 2)),
      Error);
}

// Kernel time (CUDA events around back-to-back launches of the production launcher) and the op's
// time as the generation loop sees it (upload + launches + the ids read back), at V = 200064.
TEST(CudaSampling, TimingAtFullVocabulary) {
  TPMOE_REQUIRE_GPU();
  const int V = 200064;
  struct Row {
    const char* name;
    SamplingParams sp;
  };
  const Row cases[] = {{"greedy", make(0.f)},
                       {"temperature 1", make(1.0f)},
                       {"top_k 50 + top_p 0.9", make(1.0f, 50, 0.9f)},
                       {"all filters + penalties", make(0.7f, 100, 0.95f, 0.02f, 1.2f, 0.3f, 0.4f)}};
  std::printf("\nsample at V=%d (flat rows: every logit ~N(0,1), all 200064 tokens candidates; peaked: N(0,6))\n", V);
  std::printf("%-26s %6s %8s %14s %14s\n", "params", "batch", "rows", "kernels us", "op+sync us");
  cuda::CudaOps gpu(small_reserve());
  for (const Row& c : cases) {
    for (int R : {1, 19}) {
      for (float stddev : {1.f, 6.f}) {
        Batch b = make_batch(V, R, c.sp, 1000 + R);
        b.logits = test::random_floats(size_t(R) * V, stddev, 3);
        DeviceBuffer<float> d_logits(b.logits);
        DeviceBuffer<int32_t> d_ids(static_cast<size_t>(R));
        const Tensor logits = Tensor::make(d_logits.get(), DType::kF32, R, V),
                     ids = Tensor::make(d_ids.get(), DType::kI32, R);
        // The op, host-synchronised, as a decode step uses it.
        gpu.sample(logits, b.batch, ids);  // warm-up (and buffer growth)
        gpu.ids_to_host(ids);
        std::vector<double> op_us;
        for (int i = 0; i < 20; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          gpu.sample(logits, b.batch, ids);
          gpu.ids_to_host(ids);
          op_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(op_us.begin(), op_us.end());
        // The kernels alone: the same launcher on uploaded args, 50 launches between two events.
        const auto args = check_sample_batch(b.batch, R, V);
        DeviceBuffer<sampling::SampleRowArgs> d_args(args);
        std::vector<int32_t> pen_ids = b.batch.penalty_token_ids, pen_counts = b.batch.penalty_counts;
        pen_ids.push_back(0);
        pen_counts.push_back(0);
        DeviceBuffer<int32_t> d_pen_ids(pen_ids), d_pen_counts(pen_counts);
        DeviceBuffer<uint8_t> workspace(cuda::sample_workspace_bytes(R, V));
        cuda::SampleKernelParams p;
        p.logits = d_logits.get();
        p.rows = R;
        p.vocab = V;
        p.row_args = d_args.get();
        p.penalty_ids = d_pen_ids.get();
        p.penalty_counts = d_pen_counts.get();
        p.ids = d_ids.get();
        p.workspace = workspace.get();
        p.workspace_bytes = workspace.size();
        cudaEvent_t start, stop;
        CUDA_CHECK(cudaEventCreate(&start));
        CUDA_CHECK(cudaEventCreate(&stop));
        cuda::launch_sample(p, nullptr);
        CUDA_CHECK(cudaEventRecord(start, nullptr));
        constexpr int kIters = 50;
        for (int i = 0; i < kIters; ++i) cuda::launch_sample(p, nullptr);
        CUDA_CHECK(cudaEventRecord(stop, nullptr));
        CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        std::printf("%-26s %6d %8s %14.1f %14.1f\n", c.name, R, stddev == 1.f ? "flat" : "peaked", 1000.0 * ms / kIters,
                    op_us[op_us.size() / 2]);
      }
    }
  }
}

}  // namespace
}  // namespace tpmoe
