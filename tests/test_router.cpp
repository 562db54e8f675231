// The CPU oracle's router (SPEC §1, item 8), worked out by hand: experts chosen by sigmoid score + bias,
// weighted by the score alone renormalised over the k chosen, ties to the lower id, the shared
// slots appended; a NaN choice ranks as -inf. The GPU's routing is checked against this oracle
// (test_cuda_moe.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backends/cpu/cpu_ops.h"

namespace tpmoe {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Routes the tokens of `logits` ([T][E], E = bias.size()) to k experts and n_shared shared slots.
Routed route(std::vector<float> logits, std::vector<float> bias, int k, int n_shared, float shared_weight = 0.25f) {
  const int E = int(bias.size()), T = int(logits.size()) / E, slots = k + n_shared;
  Routed r{std::vector<int32_t>(size_t(T) * slots, -1), std::vector<float>(size_t(T) * slots, -1.f)};
  cpu::CpuOps ops;
  ops.route(Tensor::make(logits.data(), DType::kF32, T, E), Tensor::make(bias.data(), DType::kF32, E),
            RouterParams{.num_experts = E, .top_k = k, .num_shared_slots = n_shared, .shared_weight = shared_weight},
            Tensor::make(r.ids.data(), DType::kI32, T, slots), Tensor::make(r.weights.data(), DType::kF32, T, slots));
  return r;
}

float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

TEST(Router, ChoosesByScorePlusBiasAndWeighsByScore) {
  // Scores 0.5, 0.881, 0.731, 0.953; the bias takes expert 3 below experts 1 and 2 (0.453).
  const Routed r = route({0.f, 2.f, 1.f, 3.f}, {0.f, 0.f, 0.f, -0.5f}, 2, 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2, 4}));
  const float sum = sigmoid(2.f) + sigmoid(1.f);
  EXPECT_FLOAT_EQ(r.weights[0], sigmoid(2.f) / sum);
  EXPECT_FLOAT_EQ(r.weights[1], sigmoid(1.f) / sum);
  EXPECT_EQ(r.weights[2], 0.25f);  // the shared slot: its own weight, not renormalised
}

TEST(Router, TiesGoToTheLowerId) {
  // Experts 1, 3 and 4 tie for two places; then every choice equal.
  const std::vector<float> bias{0.f, 0.1f, 0.f, 0.1f, 0.1f, 0.f};
  EXPECT_EQ(route({1.f, 1.f, 1.f, 1.f, 1.f, 1.f}, bias, 2, 0).ids, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(route({1.f, 1.f, 1.f, 1.f, 1.f, 1.f}, std::vector<float>(6, 0.f), 3, 0).ids,
            (std::vector<int32_t>{0, 1, 2}));
}

// A NaN logit or bias is a NaN choice: it ranks as -inf, so every id is an expert's (the order is a
// strict one, and the GPU's scan, which never takes a NaN, chooses the same ids). A chosen NaN score
// makes the token's weights NaN, as its output will be.
TEST(Router, NaNRanksAsMinusInfinity) {
  const std::vector<float> bias{0.f, 0.f, 0.f, 0.f, kNaN, 0.f};
  // Token 0: expert 2's logit and expert 4's bias are NaN; the two best numbers are experts 1 and 3.
  // Token 1: every logit NaN: every choice -inf, the lowest ids, NaN weights.
  // Token 2: a NaN logit on expert 0, the first a sort looks at: experts 3 and 2.
  const Routed r = route({0.f, 2.f, kNaN, 1.f, 3.f, -1.f,      //
                          kNaN, kNaN, kNaN, kNaN, kNaN, kNaN,  //
                          kNaN, 0.f, 1.f, 2.f, -1.f, 0.5f},
                         bias, 2, 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 6, 0, 1, 6, 3, 2, 6}));
  const float sum = sigmoid(2.f) + sigmoid(1.f);
  EXPECT_FLOAT_EQ(r.weights[0], sigmoid(2.f) / sum);
  EXPECT_FLOAT_EQ(r.weights[1], sigmoid(1.f) / sum);
  EXPECT_TRUE(std::isnan(r.weights[3]) && std::isnan(r.weights[4]));
  EXPECT_EQ(r.weights[5], 0.25f);

  // NaN ties with -inf (to the lower id): a bias of -inf on experts 0-2 and NaN on expert 4 leaves
  // experts 3 and 5 first, then expert 0, the lowest of the -inf and NaN choices.
  const Routed tie = route({0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, {-kInf, -kInf, -kInf, 0.f, kNaN, 0.f}, 3, 0);
  EXPECT_EQ(tie.ids, (std::vector<int32_t>{3, 5, 0}));
  for (float w : tie.weights) EXPECT_FLOAT_EQ(w, 1.f / 3.f);
}

}  // namespace
}  // namespace tpmoe
