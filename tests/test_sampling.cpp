// Sampling on the CPU backend (the reference): the draws follow the exact filtered distribution
// (chi-square against an independent, sort-based double-precision oracle of vLLM's semantics, with
// a check that the bound rejects a slightly wrong distribution), greedy is torch.argmax, seeds
// reproduce independently of the batch, penalties move the right logits, bad parameters are named,
// and the StopMatcher cuts streamed text exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cpu/cpu_sampling.h"
#include "core/error.h"
#include "engine/sampling.h"
#include "model/sampling_math.h"
#include "sampling_test_util.h"

namespace tpmoe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// What a sequence has seen: prompt tokens and generated counts.
struct History {
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;
};

// ---- the oracle: vLLM's filtered distribution, in double, by sorting ------------------------------

struct Reference {
  std::vector<double> probs;
  double boundary_margin = 1;  // distance of the closest token to a top-p / min-p decision
};

Reference reference_distribution(const std::vector<float>& logits, const SamplingParams& sp, const History& h) {
  const int V = int(logits.size());
  std::vector<double> x(logits.begin(), logits.end());
  std::map<int, int> counts;
  for (int32_t t : h.generated) ++counts[t];
  std::set<int> seen(h.prompt.begin(), h.prompt.end());
  for (auto& [t, c] : counts) seen.insert(t);
  for (int t : seen) {
    if (sp.repetition_penalty != 1.0f) x[t] = x[t] > 0 ? x[t] / sp.repetition_penalty : x[t] * sp.repetition_penalty;
    const int c = counts.count(t) ? counts[t] : 0;
    x[t] -= double(sp.frequency_penalty) * c;
    if (c > 0) x[t] -= sp.presence_penalty;
  }
  Reference ref;
  ref.probs.assign(size_t(V), 0.0);
  if (sp.greedy()) {
    ref.probs[size_t(std::max_element(x.begin(), x.end()) - x.begin())] = 1;
    return ref;
  }
  std::vector<double> s(static_cast<size_t>(V));
  for (int i = 0; i < V; ++i) s[i] = x[i] / sp.temperature;
  std::vector<bool> kept(size_t(V), true);
  if (sp.top_k > 0 && sp.top_k < V) {
    std::vector<double> sorted = s;
    std::sort(sorted.rbegin(), sorted.rend());
    const double kth = sorted[size_t(sp.top_k) - 1];
    for (int i = 0; i < V; ++i) kept[i] = s[i] >= kth;
  }
  auto softmax_kept = [&] {
    double mx = -1e300, z = 0;
    for (int i = 0; i < V; ++i)
      if (kept[i]) mx = std::max(mx, s[i]);
    std::vector<double> p(size_t(V), 0.0);
    for (int i = 0; i < V; ++i)
      if (kept[i]) z += p[i] = std::exp(s[i] - mx);
    for (auto& v : p) v /= z;
    return p;
  };
  if (sp.top_p < 1.0f) {
    const std::vector<double> p = softmax_kept();
    // Most likely first; a group of equal values shares the mass strictly above it.
    std::vector<int> order;
    for (int i = 0; i < V; ++i)
      if (kept[i]) order.push_back(i);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return s[a] > s[b]; });
    double above = 0;
    for (size_t a = 0; a < order.size();) {
      size_t b = a;
      double group = 0;
      for (; b < order.size() && s[order[b]] == s[order[a]]; ++b) group += p[order[b]];
      for (size_t i = a; i < b; ++i) kept[order[i]] = above < sp.top_p;
      ref.boundary_margin = std::min(ref.boundary_margin, std::abs(above - sp.top_p));
      above += group;
      a = b;
    }
  }
  if (sp.min_p > 0) {
    const std::vector<double> p = softmax_kept();
    const double pmax = *std::max_element(p.begin(), p.end());
    for (int i = 0; i < V; ++i) {
      if (!kept[i]) continue;
      kept[i] = p[i] >= sp.min_p * pmax;
      ref.boundary_margin = std::min(ref.boundary_margin, std::abs(std::log(p[i] / pmax) - std::log(sp.min_p)));
    }
  }
  ref.probs = softmax_kept();
  return ref;
}

// ---- drawing many samples through the op ------------------------------------------------------------

// One sample per row; row n is step `first_step + n` of the same request.
std::vector<int32_t> draw(const std::vector<float>& logits, const SamplingParams& sp, const History& h, uint64_t seed,
                          int n, uint32_t first_step = 0) {
  const int V = int(logits.size());
  SequencePenalties pen(sp, h.prompt);
  for (int32_t t : h.generated) pen.add_generated(t);
  SampleBatchBuilder builder;
  for (int i = 0; i < n; ++i) builder.add_row(sp, seed, first_step + uint32_t(i), pen);
  std::vector<float> rows(size_t(n) * V);
  for (int i = 0; i < n; ++i) std::copy(logits.begin(), logits.end(), rows.begin() + size_t(i) * V);
  std::vector<int32_t> ids(size_t(n), -7);
  cpu::CpuOps ops;
  ops.sample(Tensor::make(rows.data(), DType::kF32, n, V), builder.batch(), Tensor::make(ids.data(), DType::kI32, n));
  return ids;
}

// Upper alpha-quantile of chi-square with df degrees of freedom (Wilson-Hilferty; z for alpha = 1e-4).
double chi2_bound(int df) {
  const double z = 3.719, a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

struct ChiSquare {
  double stat = 0;
  int df = 0;
  int impossible = 0;  // samples of a token whose probability is 0
};

// Pearson's statistic; tokens expected fewer than 5 times share one pooled bin (the chi-square
// approximation needs expected counts of about 5 or more).
ChiSquare chi_square(const std::vector<int>& counts, const std::vector<double>& probs, int n) {
  ChiSquare c;
  double pooled_e = 0, pooled_o = 0;
  int bins = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0) {
      c.impossible += counts[i];
      continue;
    }
    const double e = n * probs[i];
    if (e < 5) {
      pooled_e += e;
      pooled_o += counts[i];
      continue;
    }
    c.stat += (counts[i] - e) * (counts[i] - e) / e;
    ++bins;
  }
  if (pooled_e > 0) {
    c.stat += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
    ++bins;
  }
  c.df = std::max(1, bins - 1);
  return c;
}

std::vector<float> random_logits(int V, float stddev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<float> v(static_cast<size_t>(V));
  for (auto& x : v) x = dist(rng);
  return v;
}

struct Case {
  const char* name;
  SamplingParams sp;
};

// Short name for the many parameter sets below.
SamplingParams make(float t, int k = 0, float p = 1, float min_p = 0, float rep = 1, float pres = 0, float freq = 0) {
  return test::sampling_params(t, k, p, min_p, rep, pres, freq);
}

// Draws 20000 samples of a V=24 row and checks them against the oracle at significance 1e-4; the
// same counts must fail the bound against two slightly wrong distributions (2% of the mass moved
// off the top token; temperature 25% off), so the bound has the power to catch a broken sampler.
void check_distribution(const Case& c, const std::vector<float>& logits, const History& h) {
  SCOPED_TRACE(c.name);
  constexpr int kSamples = 20000;
  const int V = int(logits.size());
  const Reference ref = reference_distribution(logits, c.sp, h);
  // A token whose top-p / min-p decision sits on the boundary would make the oracle's double and
  // the op's fixed point disagree legitimately: the cases are chosen away from that.
  ASSERT_GT(ref.boundary_margin, 1e-4) << "test case too close to a filter boundary";
  const std::vector<int32_t> ids = draw(logits, c.sp, h, 1234, kSamples);
  std::vector<int> counts(static_cast<size_t>(V), 0);
  for (int32_t id : ids) {
    ASSERT_TRUE(id >= 0 && id < V) << id;
    ++counts[id];
  }
  const ChiSquare good = chi_square(counts, ref.probs, kSamples);
  EXPECT_EQ(good.impossible, 0) << "drew tokens the filters remove";
  EXPECT_LT(good.stat, chi2_bound(good.df)) << "df " << good.df;

  const int kept = int(std::count_if(ref.probs.begin(), ref.probs.end(), [](double p) { return p > 0; }));
  double shifted = 0, hotter_stat = 0;
  if (kept >= 2) {
    std::vector<double> wrong = ref.probs;
    const size_t top = size_t(std::max_element(wrong.begin(), wrong.end()) - wrong.begin());
    size_t low = top;
    for (size_t i = 0; i < wrong.size(); ++i)
      if (wrong[i] > 0 && (low == top || wrong[i] < wrong[low])) low = i;
    wrong[top] -= 0.02;
    wrong[low] += 0.02;
    const ChiSquare bad = chi_square(counts, wrong, kSamples);
    shifted = bad.stat;
    EXPECT_GT(bad.stat, chi2_bound(bad.df)) << "the bound cannot tell a 2% shift";
    SamplingParams hotter = c.sp;
    hotter.temperature *= 1.25f;
    const ChiSquare bad_t = chi_square(counts, reference_distribution(logits, hotter, h).probs, kSamples);
    hotter_stat = bad_t.stat;
    if (kept >= 3) {
      EXPECT_GT(bad_t.stat, chi2_bound(bad_t.df)) << "the bound cannot tell a 25% temperature error";
    }
  }
  // An op that ignored the filters and penalties would fail too.
  const SamplingParams plain = make(c.sp.temperature);
  const Reference unfiltered = reference_distribution(logits, plain, h);
  if (unfiltered.probs != ref.probs) {
    const ChiSquare bad = chi_square(counts, unfiltered.probs, kSamples);
    EXPECT_GT(bad.stat, chi2_bound(bad.df)) << "the bound cannot tell the unfiltered distribution";
  }
  std::printf("  %-28s kept %2d/%d  chi2 %7.2f (df %2d, bound %6.2f); vs wrong: 2%% shift %8.1f, T+25%% %8.1f\n",
              c.name, kept, V, good.stat, good.df, chi2_bound(good.df), shifted, hotter_stat);
}

TEST(Sampling, DrawsFollowTheFilteredDistribution) {
  const std::vector<float> logits = random_logits(24, 1.3f, 7);
  const History h{{1, 5, 7, 7}, {5, 5, 9, 11, 11, 11}};
  const Case cases[] = {
      {"temperature 1", make(1.0f)},
      {"temperature 0.6", make(0.6f)},
      {"temperature 2", make(2.0f)},
      {"top_k 5", make(1.0f, 5)},
      {"top_k -1 (off)", make(1.0f, -1)},
      {"top_p 0.75", make(1.0f, 0, 0.75f)},
      {"min_p 0.12", make(1.0f, 0, 1, 0.12f)},
      {"repetition 1.4", make(1.0f, 0, 1, 0, 1.4f)},
      {"repetition 0.7", make(1.0f, 0, 1, 0, 0.7f)},
      {"presence 0.8 frequency 0.3", make(1.0f, 0, 1, 0, 1, 0.8f, 0.3f)},
      {"negative presence/frequency", make(1.0f, 0, 1, 0, 1, -0.5f, -0.4f)},
      {"top_k 9 + top_p 0.8", make(0.8f, 9, 0.8f)},
      {"all filters + penalties", make(0.9f, 12, 0.85f, 0.05f, 1.2f, 0.3f, 0.2f)},
  };
  for (const Case& c : cases) check_distribution(c, logits, h);
}

TEST(Sampling, TopKKeepsTiesAtTheThreshold) {
  // Tokens 1-4 tie at the 2nd largest value: top_k = 2 keeps all of them (vLLM's rule).
  const std::vector<float> logits = {2.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f, -1.0f, 0.5f};
  check_distribution({"top_k 2 with ties", make(1.0f, 2)}, logits, {});
  // top_p: the 4 tied tokens are all kept or all removed, never split.
  check_distribution({"top_p 0.5 with ties", make(1.0f, 0, 0.5f)}, logits, {});
}

TEST(Sampling, LargeRowDrawsOnlyKeptTokens) {
  // V = 200064 with top-k and top-p: every draw lies in the oracle's kept set, and the draws spread
  // over it (no fixed token).
  const int V = 200064;
  const std::vector<float> logits = random_logits(V, 6.0f, 11);
  const SamplingParams sp = make(1.0f, 40, 0.9f);
  const Reference ref = reference_distribution(logits, sp, {});
  const std::vector<int32_t> ids = draw(logits, sp, {}, 99, 24);
  std::set<int32_t> distinct;
  for (int32_t id : ids) {
    ASSERT_GT(ref.probs[id], 0) << "token " << id << " is filtered out";
    distinct.insert(id);
  }
  EXPECT_GE(distinct.size(), 3u);
}

// ---- greedy -----------------------------------------------------------------------------------

TEST(Sampling, GreedyIsTheArgmax) {
  cpu::CpuOps ops;
  const int R = 7, V = 1000;
  std::vector<float> logits = random_logits(R * V, 2.0f, 3);
  // Ties: the first maximum wins (torch.argmax).
  logits[2 * V + 10] = logits[2 * V + 500] = 50.f;
  logits[4 * V + 999] = logits[4 * V + 0] = 60.f;
  SampleBatchBuilder builder;
  const SamplingParams greedy;  // the default
  for (int r = 0; r < R; ++r) builder.add_row(greedy, uint64_t(r), uint32_t(r), SequencePenalties(greedy, {}));
  std::vector<int32_t> sampled(R, -1), argmax(R, -1);
  ops.sample(Tensor::make(logits.data(), DType::kF32, R, V), builder.batch(),
             Tensor::make(sampled.data(), DType::kI32, R));
  ops.argmax(Tensor::make(logits.data(), DType::kF32, R, V), Tensor::make(argmax.data(), DType::kI32, R), Tensor());
  EXPECT_EQ(sampled, argmax);
  EXPECT_EQ(sampled[2], 10);
  EXPECT_EQ(sampled[4], 0);
  // Temperatures below kGreedyTemperature are greedy too, whatever the filters say.
  EXPECT_EQ(draw(std::vector<float>(logits.begin(), logits.begin() + V), make(1e-6f, 3, 0.5f), {}, 5, 1)[0], argmax[0]);
}

// The winners of a vocab-parallel step's ranks combine to the argmax of the whole row.
TEST(Sampling, VocabParallelWinnersCombineToTheRowsArgmax) {
  const int R = 6, ranks = 4, slice = 50;
  const test::GatheredWinners w = test::gathered_winners(random_logits(R * ranks * slice, 2.0f, 8), R, ranks, slice);
  cpu::CpuOps ops;
  std::vector<int32_t> gathered = w.gathered, ids(R, -1);
  ops.combine_vocab_argmax(Tensor::make(gathered.data(), DType::kI32, int64_t(gathered.size()), 1), slice,
                           Tensor::make(ids.data(), DType::kI32, R, 1));
  EXPECT_EQ(ids, w.want);
  EXPECT_EQ(w.want[1], 1 * slice + 9);
  EXPECT_EQ(w.want[2], 2 * slice + 5);
  EXPECT_EQ(w.want[3], 0);
}

// Kept ids are taken oldest first, at most two wait, and a step cannot feed back ids never kept.
TEST(Sampling, KeptIdsAreTakenInOrderAndBounded) {
  cpu::CpuOps ops;
  StepTokens step;
  step.token_ids = {StepTokens::kFedBackId};
  step.positions = {0};
  step.seq_slots = {0};
  EXPECT_THROW(ops.begin_step(step), Error);
  EXPECT_THROW(ops.take_kept_ids(), Error);
  std::vector<int32_t> a = {4, 5}, b = {6, 7}, c = {8};
  ops.keep_ids(Tensor::make(a.data(), DType::kI32, 2, 1));
  ops.keep_ids(Tensor::make(b.data(), DType::kI32, 2, 1));
  EXPECT_THROW(ops.keep_ids(Tensor::make(c.data(), DType::kI32, 1, 1)), Error);
  EXPECT_EQ(ops.take_kept_ids(), a);
  EXPECT_EQ(ops.take_kept_ids(), b);
  EXPECT_THROW(ops.take_kept_ids(), Error);
}

TEST(Sampling, GreedyNanWinsAsInTorch) {
  std::vector<float> row = {1.f, 3.f, std::nanf(""), 5.f};
  EXPECT_EQ(draw(row, SamplingParams{}, {}, 0, 1)[0], 2);
}

TEST(Sampling, NonFiniteRows) {
  // A sampled row never draws a NaN or -inf token; an all -inf row falls back to index 0.
  std::vector<float> row = {-kInf, std::nanf(""), 0.5f, -kInf, 0.4f};
  for (int32_t id : draw(row, make(1.0f), {}, 3, 200)) EXPECT_TRUE(id == 2 || id == 4) << id;
  EXPECT_EQ(draw(std::vector<float>(5, -kInf), make(1.0f), {}, 3, 1)[0], 0);
  // +inf: the first +inf (no finite maximum: the argmax).
  EXPECT_EQ(draw({0.f, kInf, kInf}, make(1.0f), {}, 3, 1)[0], 1);
}

// ---- seeds ------------------------------------------------------------------------------------

TEST(Sampling, SeedsReproduceIndependentlyOfTheBatch) {
  const int V = 50;
  const std::vector<float> logits = random_logits(V, 1.0f, 21);
  const SamplingParams sp = make(1.0f, 20, 0.95f);
  const std::vector<int32_t> a = draw(logits, sp, {}, 42, 64);
  EXPECT_EQ(a, draw(logits, sp, {}, 42, 64));
  EXPECT_NE(a, draw(logits, sp, {}, 43, 64));
  // Steps 10..19 alone give what rows 10..19 gave in the larger batch.
  const std::vector<int32_t> part = draw(logits, sp, {}, 42, 10, 10);
  EXPECT_TRUE(std::equal(part.begin(), part.end(), a.begin() + 10));

  // A row's draw does not change when other requests (other params, seeds, penalties) share the batch.
  cpu::CpuOps ops;
  SampleBatchBuilder mixed;
  const SamplingParams other = make(0.5f, 3, 1, 0, 1.5f, 0.5f, 0.5f);
  const std::vector<int32_t> prompt = {1, 2, 3};
  SequencePenalties other_pen(other, prompt), none(sp, {});
  mixed.add_row(other, 7, 3, other_pen);
  mixed.add_row(sp, 42, 5, none);
  mixed.add_greedy_row();
  std::vector<float> rows;
  for (int r = 0; r < 3; ++r) rows.insert(rows.end(), logits.begin(), logits.end());
  std::vector<int32_t> ids(3, -1);
  ops.sample(Tensor::make(rows.data(), DType::kF32, 3, V), mixed.batch(), Tensor::make(ids.data(), DType::kI32, 3));
  EXPECT_EQ(ids[1], a[5]);
}

TEST(Sampling, ResolvedSeeds) {
  SamplingParams sp;
  sp.seed = 77;
  EXPECT_EQ(resolve_seed(sp), 77u);
  sp.seed.reset();
  EXPECT_NE(resolve_seed(sp), resolve_seed(sp));  // 2^-64 chance of a false failure
  EXPECT_NE(sequence_seed(5, 0), sequence_seed(5, 1));
  EXPECT_NE(sequence_seed(5, 0), sequence_seed(6, 0));
}

// ---- penalties ----------------------------------------------------------------------------------

TEST(Sampling, PenaltiesMoveTheRightLogits) {
  // Greedy rows show the penalised argmax exactly.
  const std::vector<float> pos = {0.f, 0.f, 3.0f, 0.f, 2.9f};
  SamplingParams rep = make(0.f, 0, 1, 0, 1.1f);     // 3.0 / 1.1 = 2.73 < 2.9
  EXPECT_EQ(draw(pos, rep, {{2}, {}}, 0, 1)[0], 4);  // in the prompt
  EXPECT_EQ(draw(pos, rep, {{}, {2}}, 0, 1)[0], 4);  // generated
  EXPECT_EQ(draw(pos, rep, {{4}, {}}, 0, 1)[0], 2);  // the other one penalised: still 2
  // Negative logits are multiplied: -1.0 * 1.1 = -1.1 < -1.05.
  const std::vector<float> neg = {-1.0f, -1.05f, -3.f};
  EXPECT_EQ(draw(neg, rep, {{0}, {}}, 0, 1)[0], 1);
  // A repetition penalty below 1 rewards repetition.
  EXPECT_EQ(draw(pos, make(0.f, 0, 1, 0, 0.9f), {{4}, {}}, 0, 1)[0], 4);  // 2.9 / 0.9 = 3.22

  // Presence/frequency count generated tokens only, never prompt tokens.
  SamplingParams freq = make(0.f, 0, 1, 0, 1, 0, 0.06f);
  EXPECT_EQ(draw(pos, freq, {{2, 2, 2}, {}}, 0, 1)[0], 2);
  EXPECT_EQ(draw(pos, freq, {{}, {2}}, 0, 1)[0], 2);     // 3.0 - 0.06 = 2.94 > 2.9
  EXPECT_EQ(draw(pos, freq, {{}, {2, 2}}, 0, 1)[0], 4);  // 3.0 - 0.12 < 2.9
  SamplingParams pres = make(0.f, 0, 1, 0, 1, 0.2f);
  EXPECT_EQ(draw(pos, pres, {{2}, {}}, 0, 1)[0], 2);
  EXPECT_EQ(draw(pos, pres, {{}, {2}}, 0, 1)[0], 4);
  // Negative presence promotes.
  EXPECT_EQ(draw(pos, make(0.f, 0, 1, 0, 1, -0.2f), {{}, {4}}, 0, 1)[0], 4);

  // The score itself: (x / rep - freq * count - presence) / temperature, vLLM's order.
  sampling::SampleRowArgs a =
      make_sample_row_args(make_sample_row(make(2.0f, 0, 1, 0, 1.25f, 0.5f, 0.25f), 0, 0), 0, 0);
  EXPECT_FLOAT_EQ(sampling::row_score(5.0f, 2, a), (5.0f / 1.25f - 0.25f * 2 - 0.5f) / 2.0f);
  EXPECT_FLOAT_EQ(sampling::row_score(-5.0f, 0, a), -5.0f * 1.25f / 2.0f);
  EXPECT_FLOAT_EQ(sampling::row_score(-5.0f, -1, a), -5.0f / 2.0f);
}

TEST(Sampling, PenaltyEntries) {
  SamplingParams sp = make(1.0f, 0, 1, 0, 1.2f);
  SequencePenalties pen(sp, std::vector<int32_t>{9, 3, 9, 1});
  pen.add_generated(3);
  pen.add_generated(4);
  pen.add_generated(4);
  using E = std::vector<std::pair<int32_t, int32_t>>;
  EXPECT_EQ(pen.entries(), (E{{1, 0}, {3, 1}, {4, 2}, {9, 0}}));
  // Presence/frequency alone need generated tokens only.
  SequencePenalties gen(make(1.0f, 0, 1, 0, 1, 0.5f), std::vector<int32_t>{9, 3});
  gen.add_generated(7);
  EXPECT_EQ(gen.entries(), (E{{7, 1}}));
  // No penalty: no entries at all.
  SequencePenalties none(make(1.0f), std::vector<int32_t>{9, 3});
  none.add_generated(7);
  EXPECT_FALSE(none.active());
  SampleBatchBuilder b;
  b.add_row(sp, 1, 0, pen);
  b.add_row(make(1.0f), 1, 0, none);
  b.add_row(sp, 1, 0, gen);
  EXPECT_EQ(b.batch().penalty_offsets, (std::vector<int32_t>{0, 4, 4, 5}));
  EXPECT_EQ(b.batch().penalty_token_ids, (std::vector<int32_t>{1, 3, 4, 9, 7}));
  EXPECT_EQ(b.batch().penalty_counts, (std::vector<int32_t>{0, 1, 2, 0, 1}));
}

// ---- validation -------------------------------------------------------------------------------

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Sampling, ValidateNamesTheBadParameter) {
  SamplingParams ok;
  EXPECT_NO_THROW(ok.validate(100));
  auto bad = [](auto edit) {
    SamplingParams sp;
    edit(sp);
    return [sp] { sp.validate(100); };
  };
  expect_error(bad([](auto& s) { s.temperature = -0.1f; }), "temperature");
  expect_error(bad([](auto& s) { s.temperature = kInf; }), "temperature");
  expect_error(bad([](auto& s) { s.top_k = -2; }), "top_k");
  expect_error(bad([](auto& s) { s.top_p = 0; }), "top_p");
  expect_error(bad([](auto& s) { s.top_p = 1.01f; }), "top_p");
  expect_error(bad([](auto& s) { s.top_p = std::nanf(""); }), "top_p");
  expect_error(bad([](auto& s) { s.min_p = -0.1f; }), "min_p");
  expect_error(bad([](auto& s) { s.min_p = 1.5f; }), "min_p");
  expect_error(bad([](auto& s) { s.repetition_penalty = 0; }), "repetition_penalty");
  expect_error(bad([](auto& s) { s.repetition_penalty = std::nanf(""); }), "repetition_penalty");
  expect_error(bad([](auto& s) { s.presence_penalty = kInf; }), "presence_penalty");
  expect_error(bad([](auto& s) { s.presence_penalty = 2.5f; }), "presence_penalty");
  expect_error(bad([](auto& s) { s.frequency_penalty = -kInf; }), "frequency_penalty");
  expect_error(bad([](auto& s) { s.max_tokens = 0; }), "max_tokens");
  expect_error(bad([](auto& s) { s.stop = {"ok", ""}; }), "stop string 1");
  expect_error(bad([](auto& s) { s.stop_token_ids = {5, 100}; }), "stop token id 100");
  expect_error(bad([](auto& s) { s.stop_token_ids = {-1}; }), "stop token id -1");
}

TEST(Sampling, BadBatchesAreNamed) {
  cpu::CpuOps ops;
  std::vector<float> logits(2 * 10, 0.f);
  std::vector<int32_t> ids(2);
  auto run = [&](SampleBatch b) {
    return [&, b] {
      ops.sample(Tensor::make(logits.data(), DType::kF32, 2, 10), b, Tensor::make(ids.data(), DType::kI32, 2));
    };
  };
  SampleBatch one;
  one.rows.resize(1);
  expect_error(run(one), "1 rows of sampling parameters for 2");
  SampleBatch b;
  b.rows.resize(2);
  b.penalty_offsets = {0, 2, 3};
  b.penalty_token_ids = {4, 3, 1};
  b.penalty_counts = {0, 0, 0};
  expect_error(run(b), "strictly increasing");
  b.penalty_token_ids = {3, 4, 10};
  expect_error(run(b), "penalty token id 10 outside");
  b.penalty_token_ids = {3, 4, 1};
  b.penalty_counts = {0, -1, 0};
  expect_error(run(b), "negative");
  b.penalty_counts = {0, 0};
  expect_error(run(b), "2 penalty counts for 3");
  SampleBatch t;
  t.rows.resize(2);
  t.rows[1].top_p = 0;
  expect_error(run(t), "row 1: top_p");
}

// ---- the shared arithmetic ----------------------------------------------------------------------

TEST(SamplingMath, PhiloxKnownAnswers) {
  // Random123's tests/kat_vectors, the three philox4x32 10 lines (counter, key -> output).
  using sampling::U32x4;
  auto run = [](U32x4 c, uint32_t k0, uint32_t k1) {
    const U32x4 r = sampling::philox4x32_10(c, k0, k1);
    return std::vector<uint32_t>(r.v, r.v + 4);
  };
  EXPECT_EQ(run(U32x4{{0, 0, 0, 0}}, 0, 0), (std::vector<uint32_t>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(run(U32x4{{~0u, ~0u, ~0u, ~0u}}, ~0u, ~0u),
            (std::vector<uint32_t>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(run(U32x4{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, 0xa4093822, 0x299f31d0),
            (std::vector<uint32_t>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(SamplingMath, LogAndExpAreAccurate) {
  double worst_log = 0, worst_exp = 0;
  for (float x = 5.9604645e-08f; x < 20.f; x *= 1.0137f)
    worst_log = std::max(worst_log, std::abs(sampling::log_positive(x) - std::log(double(x))) /
                                        std::max(1e-3, std::abs(std::log(double(x)))));
  for (float d = sampling::kCandidateCut; d <= 0.f; d += 0.0137f)
    worst_exp = std::max(worst_exp, std::abs(sampling::exp_nonpositive(d) / std::exp(double(d)) - 1));
  EXPECT_EQ(sampling::exp_nonpositive(0.f), 1.0f);
  EXPECT_LT(worst_log, 1e-6);
  EXPECT_LT(worst_exp, 1e-6);
  // The noise is finite and within the bound kCandidateCut relies on.
  sampling::SampleRowArgs a{};
  for (uint32_t t = 0; t < 100000; ++t) {
    const float g = sampling::gumbel_noise(a, t);
    ASSERT_TRUE(g >= -2.82f && g <= 16.65f) << g;
  }
}

TEST(SamplingMath, OrderKeysFollowTheFloats) {
  const float v[] = {-kInf, -3.f, -1e-30f, 0.f, 1e-30f, 2.f, kInf};
  for (size_t i = 1; i < std::size(v); ++i) EXPECT_LT(sampling::order_key(v[i - 1]), sampling::order_key(v[i]));
}

// ---- stopping ---------------------------------------------------------------------------------

std::string feed_all(StopMatcher& m, const std::vector<std::string>& pieces) {
  std::string out;
  for (const auto& p : pieces) out += m.feed(p);
  return out + m.flush();
}

TEST(StopMatcher, CutsExactly) {
  {
    StopMatcher m({"STOP"});
    EXPECT_EQ(feed_all(m, {"STOP", "more"}), "");  // at the start
    EXPECT_TRUE(m.stopped());
  }
  {
    StopMatcher m({"STOP"});
    EXPECT_EQ(feed_all(m, {"abc", "dSTOPe", "f"}), "abcd");  // in the middle of a piece
    EXPECT_EQ(m.matched(), 0);
  }
  {
    StopMatcher m({"STOP"});
    EXPECT_EQ(feed_all(m, {"hello", " world"}), "hello world");  // never: all text
    EXPECT_FALSE(m.stopped());
  }
  {
    StopMatcher m({"STOP"});
    EXPECT_EQ(feed_all(m, {"x", "ST"}), "xST");  // a prefix at the very end is flushed
  }
}

TEST(StopMatcher, HoldsBackOnlyWhatCouldStillMatch) {
  StopMatcher m({"<end>"});
  EXPECT_EQ(m.feed("ab<e"), "ab");  // "<e" may become "<end>"
  EXPECT_EQ(m.held_bytes(), 2u);
  EXPECT_EQ(m.feed("x"), "<ex");  // it did not
  EXPECT_EQ(m.feed("<"), "");
  EXPECT_EQ(m.feed("en"), "");
  EXPECT_EQ(m.feed("d> tail"), "");  // across three pieces
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.feed("later"), "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, OverlappingAndMultipleStops) {
  {
    // "aab": after "aa" the tail "aa" is not a prefix but "a" is; the match starts at the 2nd 'a'.
    StopMatcher m({"ab"});
    EXPECT_EQ(feed_all(m, {"a", "a", "b"}), "a");
  }
  {
    // Self-overlapping stop "aaab" in "aaaab".
    StopMatcher m({"aaab"});
    EXPECT_EQ(feed_all(m, {"aa", "a", "a", "b", "c"}), "a");
  }
  {
    // The earliest-starting stop string wins, whichever is listed first.
    StopMatcher m({"world", "o w"});
    EXPECT_EQ(feed_all(m, {"hello wor", "ld"}), "hell");
    EXPECT_EQ(m.matched(), 1);
  }
  {
    // One stop a prefix of another: the shorter completes first.
    StopMatcher m({"abcd", "ab"});
    EXPECT_EQ(feed_all(m, {"xa", "b", "cd"}), "x");
    EXPECT_EQ(m.matched(), 1);
  }
  {
    // A candidate for one stop string ends, another completes later.
    StopMatcher m({"12345", "34x"});
    EXPECT_EQ(feed_all(m, {"0123", "4x"}), "012");
    EXPECT_EQ(m.matched(), 1);
  }
}

TEST(StopMatcher, Utf8) {
  // "。" is 3 bytes (e3 80 82), "🛑" 4 bytes: the pieces split them mid-character.
  StopMatcher m({"。", "🛑"});
  const std::string text = "你好🛑再见";
  std::vector<std::string> bytes;
  for (char c : text) bytes.push_back(std::string(1, c));
  EXPECT_EQ(feed_all(m, bytes), "你好");
  EXPECT_EQ(m.matched(), 1);
  StopMatcher n({"。"});
  EXPECT_EQ(feed_all(n, {"\xe3\x80", "x", "\xe3", "\x80\x82", "y"}), "\xe3\x80x");
}

// What StopMatcher promises, computed the plain way: after each piece, the earliest-starting complete
// stop string in the text not yet emitted (the first listed on a tie) ends it; otherwise everything
// is emitted but the longest tail that is a proper prefix of some stop string. Quadratic, for tests.
class NaiveStopMatcher {
 public:
  explicit NaiveStopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string feed(std::string_view piece) {
    if (stopped_) return {};
    held_.append(piece);
    size_t first = std::string::npos;
    for (size_t i = 0; i < stops_.size(); ++i) {
      const size_t at = held_.find(stops_[i]);
      if (at < first) first = at, matched_ = int(i);
    }
    if (first != std::string::npos) {
      stopped_ = true;
      std::string out = held_.substr(0, first);
      held_.clear();
      return out;
    }
    size_t keep = 0;
    for (const auto& s : stops_)
      for (size_t len = std::min(s.size() - 1, held_.size()); len > keep; --len)
        if (held_.compare(held_.size() - len, len, s, 0, len) == 0) keep = len;
    std::string out = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out;
  }
  bool stopped() const { return stopped_; }
  int matched() const { return matched_; }
  size_t held_bytes() const { return held_.size(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
  int matched_ = -1;
};

// Random stop strings and texts over a 3-letter alphabet (so that partial and overlapping matches
// are everywhere), cut into random pieces: the automaton gives what the plain search gives, piece by
// piece, including the held-back tail and which stop matched.
TEST(StopMatcher, EqualsThePlainSearchOnRandomText) {
  std::mt19937 rng(2026);
  auto word = [&](size_t max_len) {
    std::string w(1 + rng() % max_len, 'a');
    for (char& c : w) c = char('a' + rng() % 3);
    return w;
  };
  int stopped = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<std::string> stops(1 + rng() % 4);
    for (auto& s : stops) s = word(trial % 2 ? 6 : 12);
    StopMatcher m(stops);
    NaiveStopMatcher naive(stops);
    const std::string text = word(80);
    for (size_t at = 0; at < text.size() && !naive.stopped();) {
      const size_t len = std::min(text.size() - at, size_t(1 + rng() % 5));
      const std::string_view piece = std::string_view(text).substr(at, len);
      ASSERT_EQ(m.feed(piece), naive.feed(piece)) << "trial " << trial << " at byte " << at;
      ASSERT_EQ(m.held_bytes(), naive.held_bytes()) << "trial " << trial;
      at += len;
    }
    ASSERT_EQ(m.stopped(), naive.stopped()) << "trial " << trial;
    ASSERT_EQ(m.matched(), naive.matched()) << "trial " << trial;
    stopped += m.stopped();
  }
  EXPECT_GT(stopped, 300) << "too few trials reached a stop string to test the cut";
  EXPECT_LT(stopped, 2700) << "too few trials ran to the end of their text";
}

// A long stop string that the text keeps almost completing (the old search cost the stop's length,
// squared, every piece: this took minutes; the automaton, a few milliseconds of a test).
TEST(StopMatcher, LongSelfOverlappingStop) {
  const std::string stop = std::string(100000, 'a') + "b";
  StopMatcher m({stop});
  std::string out;
  for (int i = 0; i < 30000; ++i) out += m.feed("aaaaaaa");  // 210000 bytes, 7 a piece
  EXPECT_EQ(out, std::string(210000 - 100000, 'a'));         // all but what may still start the stop
  EXPECT_EQ(m.held_bytes(), 100000u);
  EXPECT_EQ(m.feed("ab"), "a");  // the stop starts one byte into the held tail
  EXPECT_TRUE(m.stopped());
}

TEST(StopLimits, TooManyStopsAreAnError) {
  SamplingParams sp;
  sp.stop.assign(kMaxStopStrings, "x");
  sp.stop_token_ids.assign(kMaxStopTokenIds, 1);
  EXPECT_NO_THROW(sp.validate(10));
  sp.stop.push_back("y");
  EXPECT_THROW(sp.validate(10), Error);
  sp.stop.pop_back();
  sp.stop_token_ids.push_back(2);
  EXPECT_THROW(sp.validate(10), Error);
}

TEST(StopTokens, Checks) {
  SamplingParams sp;
  sp.stop_token_ids = {7};
  sp.max_tokens = 4;
  const std::vector<int32_t> eos = {2, 3};
  EXPECT_EQ(check_token_stop(sp, 7, eos, 1), FinishReason::kStopToken);
  EXPECT_EQ(check_token_stop(sp, 3, eos, 1), FinishReason::kEos);
  EXPECT_EQ(check_token_stop(sp, 5, eos, 3), FinishReason::kNone);
  EXPECT_EQ(check_token_stop(sp, 5, eos, 4), FinishReason::kLength);
  sp.ignore_eos = true;
  EXPECT_EQ(check_token_stop(sp, 3, eos, 1), FinishReason::kNone);
  EXPECT_STREQ(finish_reason_name(FinishReason::kEos), "stop");
  EXPECT_STREQ(finish_reason_name(FinishReason::kLength), "length");
}

}  // namespace
}  // namespace tpmoe
