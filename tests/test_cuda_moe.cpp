// The GPU MoE layer against the CPU oracle: the router (exact ids, ties to the lower id) and the
// expert computation (binning by physical row, SwiGLU-OAI, weighted combine) at awkward shapes:
// batch 1..256, repeated experts within a token, every token on one expert, shared rows at the end
// of the row range, widths that are not multiples of the tiles or of the 16-byte vector width; and
// the GEMV paths for one token and for 2-8 tokens against the oracle and the general path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/moe.cuh"
#include "backends/cuda/moe_gemv.cuh"
#include "core/error.h"
#include "cuda_test_util.h"
#include "test_util.h"

namespace tpmoe::test {
namespace {

// ------------------------------------------------------------------------------------------------
// Router
// ------------------------------------------------------------------------------------------------

struct RouteResult {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

RouteResult route_cpu(std::vector<float> logits, std::vector<float> bias, int T, int E, int k, int n_shared,
                      float shared_weight) {
  const int slots = k + n_shared;
  RouteResult r{std::vector<int32_t>(size_t(T) * slots), std::vector<float>(size_t(T) * slots)};
  cpu::CpuOps ops;
  ops.route(Tensor::make(logits.data(), DType::kF32, T, E), Tensor::make(bias.data(), DType::kF32, E),
            RouterParams{.num_experts = E, .top_k = k, .num_shared_slots = n_shared, .shared_weight = shared_weight},
            Tensor::make(r.ids.data(), DType::kI32, T, slots), Tensor::make(r.weights.data(), DType::kF32, T, slots));
  return r;
}

// The router's arguments for T tokens of E logits each, routed to k experts and n_shared shared slots
// with weight shared_weight, into ids and weights ([T][k + n_shared]).
cuda::RouteKernelParams route_params(const float* logits, const float* bias, int T, int E, int k, int n_shared,
                                     float shared_weight, int32_t* ids, float* weights) {
  cuda::RouteKernelParams p;
  p.logits = logits;
  p.bias = bias;
  p.slot_ids = ids;
  p.slot_weights = weights;
  p.num_tokens = T;
  p.num_experts = E;
  p.top_k = k;
  p.num_shared = n_shared;
  p.shared_weight = shared_weight;
  return p;
}

RouteResult route_gpu(const std::vector<float>& logits, const std::vector<float>& bias, int T, int E, int k,
                      int n_shared, float shared_weight) {
  const int slots = k + n_shared;
  DeviceBuffer<float> d_logits(logits), d_bias(bias);
  DeviceBuffer<int32_t> d_ids(size_t(T) * slots);  // poisoned: -1 until written
  DeviceBuffer<float> d_w(size_t(T) * slots);      // poisoned: NaN until written
  cuda::launch_route(
      route_params(d_logits.get(), d_bias.get(), T, E, k, n_shared, shared_weight, d_ids.get(), d_w.get()), nullptr);
  return {d_ids.download(), d_w.download()};
}

void check_route(const std::vector<float>& logits, const std::vector<float>& bias, int T, int E, int k, int n_shared,
                 float shared_weight) {
  const RouteResult want = route_cpu(logits, bias, T, E, k, n_shared, shared_weight);
  const RouteResult got = route_gpu(logits, bias, T, E, k, n_shared, shared_weight);
  ASSERT_EQ(got.ids, want.ids) << "T=" << T << " E=" << E << " k=" << k << " shared=" << n_shared;
  EXPECT_LT(relative_l2(got.weights, want.weights), kTolF32) << "T=" << T << " E=" << E << " k=" << k;
}

std::vector<float> uniform_floats(size_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

TEST(CudaMoeRoute, MatchesOracleOnRandomLogits) {
  TPMOE_REQUIRE_GPU();
  struct Shape {
    int T, E, k, n_shared;
  };
  for (const Shape s : {Shape{1, 128, 4, 1}, Shape{3, 128, 4, 1}, Shape{19, 128, 8, 0}, Shape{64, 256, 8, 1},
                        Shape{256, 128, 4, 1}, Shape{7, 40, 8, 2}, Shape{5, 3, 3, 1}, Shape{33, 1, 1, 0}}) {
    const auto logits = random_floats(size_t(s.T) * s.E, 2.f, 100 + s.T * 7 + s.E);
    const auto bias = uniform_floats(size_t(s.E), -0.05f, 0.05f, 200 + s.E);
    check_route(logits, bias, s.T, s.E, s.k, s.n_shared, 0.5f);
  }
}

TEST(CudaMoeRoute, TiesGoToTheLowerId) {
  TPMOE_REQUIRE_GPU();
  const int T = 4, E = 128, k = 4;
  // Other experts: sigmoid(logit) <= sigmoid(2), bias in [-0.01, 0.01]: far below the planted ones.
  std::vector<float> logits = uniform_floats(size_t(T) * E, -3.f, 2.f, 7);
  std::vector<float> bias = uniform_floats(size_t(E), -0.01f, 0.01f, 8);
  for (int e : {3, 35, 40, 77, 120, 121, 64, 100, 10, 20, 30, 5, 37, 69, 101, 127}) bias[e] = 0.05f;
  // Token 0: six equal choices for four places, two of them in the same lane (3, 35).
  for (int e : {121, 120, 77, 40, 35, 3}) logits[0 * E + e] = 4.f;
  // Token 1: three clear winners, then a tie for the last place between 100 and 64.
  for (int e : {10, 20, 30}) logits[1 * E + e] = 6.f;
  for (int e : {100, 64}) logits[1 * E + e] = 4.f;
  // Token 2: four equal in one lane (5, 37, 69, 101) and the top id 127 tied with them.
  for (int e : {127, 101, 69, 37, 5}) logits[2 * E + e] = 3.f;
  // Token 3: every logit equal and no bias: the k lowest ids.
  std::fill(logits.begin() + 3 * E, logits.begin() + 4 * E, 0.5f);
  std::vector<float> flat_bias = bias;
  check_route(logits, bias, T, E, k, 1, 0.5f);

  // The planted cases must mean what the test says (the oracle is the reference, but guard the setup).
  const RouteResult got = route_gpu(logits, bias, T, E, k, 1, 0.5f);
  const std::vector<int32_t> token0(got.ids.begin(), got.ids.begin() + 5);
  const std::vector<int32_t> token1(got.ids.begin() + 5, got.ids.begin() + 10);
  const std::vector<int32_t> token2(got.ids.begin() + 10, got.ids.begin() + 15);
  EXPECT_EQ(token0, (std::vector<int32_t>{3, 35, 40, 77, E}));
  EXPECT_EQ(token1[3], 64);
  EXPECT_EQ(token2, (std::vector<int32_t>{5, 37, 69, 101, E}));

  // All-equal choices: logits equal and bias zero.
  std::fill(flat_bias.begin(), flat_bias.end(), 0.f);
  check_route(logits, flat_bias, T, E, k, 1, 0.5f);
  const RouteResult flat = route_gpu(logits, flat_bias, T, E, k, 1, 0.5f);
  EXPECT_EQ(std::vector<int32_t>(flat.ids.begin() + 15, flat.ids.end()), (std::vector<int32_t>{0, 1, 2, 3, E}));
}

// A NaN logit or bias ranks as -inf, as in the oracle (test_router.cpp), so every id is an expert's:
// the warp's scan never takes a NaN, and a token of NaN logits came out with id 0x7fffffff before
// (a weight row far past the end, for the layer that routes inside). A chosen NaN score makes the
// token's weights NaN on both.
TEST(CudaMoeRoute, NaNRanksAsMinusInfinity) {
  TPMOE_REQUIRE_GPU();
  const int T = 3, E = 40, k = 8;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> logits = random_floats(size_t(T) * E, 2.f, 9);
  std::vector<float> bias = uniform_floats(size_t(E), -0.05f, 0.05f, 10);
  bias[7] = nan;
  for (int e : {0, 32, 39}) logits[e] = nan;                   // token 0: a few, two in lane 0
  std::fill(logits.begin() + E, logits.begin() + 2 * E, nan);  // token 1: all of them
  logits[2 * E + 5] = 9.f;                                     // token 2: only the bias's NaN
  const RouteResult want = route_cpu(logits, bias, T, E, k, 1, 0.5f);
  const RouteResult got = route_gpu(logits, bias, T, E, k, 1, 0.5f);
  ASSERT_EQ(got.ids, want.ids);
  for (size_t i = 0; i < want.weights.size(); ++i) {
    if (std::isnan(want.weights[i]))
      EXPECT_TRUE(std::isnan(got.weights[i])) << "slot " << i;
    else
      EXPECT_NEAR(got.weights[i], want.weights[i], 1e-6) << "slot " << i;
  }
  // The setup means what it says: NaN experts never chosen while numbers are left, token 1's the k
  // lowest ids.
  for (int s = 0; s < k; ++s) {
    for (int bad : {0, 7, 32, 39}) EXPECT_NE(got.ids[size_t(s)], bad);
    EXPECT_EQ(got.ids[size_t(k + 1 + s)], s);
    EXPECT_NE(got.ids[size_t(2 * (k + 1) + s)], 7);
  }
}

// ------------------------------------------------------------------------------------------------
// Experts
// ------------------------------------------------------------------------------------------------

std::vector<uint16_t> bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

struct MoeInputs {
  int T = 0, slots = 0, H = 0, I = 0, R = 0;
  float scale = 1.f;
  std::vector<float> x;           // [T, H], bf16-exact
  std::vector<uint16_t> gate_up;  // [R, 2I, H] bf16 bits
  std::vector<uint16_t> down;     // [R, H, I] bf16 bits
  std::vector<int32_t> ids;       // [T, slots]
  std::vector<float> weights;     // [T, slots]
};

MoeInputs make_inputs(int T, int slots, int H, int I, int R, float scale, std::vector<int32_t> ids, uint64_t seed) {
  MoeInputs in;
  in.T = T, in.slots = slots, in.H = H, in.I = I, in.R = R, in.scale = scale;
  in.x = round_bf16(random_floats(size_t(T) * H, 1.f, seed));
  in.gate_up = bf16_bits(random_floats(size_t(R) * 2 * I * H, 0.02f, seed + 1));
  in.down = bf16_bits(random_floats(size_t(R) * H * I, 0.02f, seed + 2));
  in.ids = std::move(ids);
  in.weights = uniform_floats(size_t(T) * slots, 0.05f, 1.f, seed + 3);
  return in;
}

std::vector<float> moe_cpu(MoeInputs in) {
  std::vector<float> out(size_t(in.T) * in.H);
  cpu::CpuOps ops;
  ops.moe_experts(Tensor::make(in.x.data(), DType::kF32, in.T, in.H),
                  Tensor::make(in.ids.data(), DType::kI32, in.T, in.slots),
                  Tensor::make(in.weights.data(), DType::kF32, in.T, in.slots),
                  Tensor::make(in.gate_up.data(), DType::kBF16, in.R, 2 * in.I, in.H),
                  Tensor::make(in.down.data(), DType::kBF16, in.R, in.H, in.I), SwigluParams{}, in.scale,
                  Tensor::make(out.data(), DType::kF32, in.T, in.H));
  return out;
}

// Device copies of the inputs, a poisoned output and a poisoned workspace sized for max_tokens.
struct MoeDevice {
  DeviceBuffer<__nv_bfloat16> x, gate_up, down, out;
  DeviceBuffer<int32_t> ids;
  DeviceBuffer<float> weights;
  DeviceBuffer<uint8_t> workspace;
  cuda::MoeKernelParams p;

  MoeDevice(const MoeInputs& in, int max_tokens)
      : x(to_bf16(in.x)),
        gate_up(in.gate_up.size()),
        down(in.down.size()),
        out(size_t(in.T) * in.H),
        ids(in.ids),
        weights(in.weights),
        workspace(cuda::moe_workspace_bytes(max_tokens, in.slots, in.H, in.I, in.R)) {
    CUDA_CHECK(cudaMemcpy(gate_up.get(), in.gate_up.data(), in.gate_up.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(down.get(), in.down.data(), in.down.size() * 2, cudaMemcpyHostToDevice));
    workspace.poison();  // launch_moe must not depend on what an earlier call left there
    p.x = x.get();
    p.slot_ids = ids.get();
    p.slot_weights = weights.get();
    p.gate_up = gate_up.get();
    p.down = down.get();
    p.out = out.get();
    p.num_tokens = in.T;
    p.slots = in.slots;
    p.hidden = in.H;
    p.inter = in.I;
    p.num_rows = in.R;
    p.scale = in.scale;
    p.workspace = workspace.get();
    p.workspace_bytes = workspace.size();
  }
};

void expect_matches_oracle(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  size_t not_finite = 0;
  for (float v : got) not_finite += !std::isfinite(v);
  EXPECT_EQ(not_finite, 0u) << what << ": output elements left unwritten (poison) or not finite";
  EXPECT_LT(relative_l2(got, want), kTolBf16) << what;
}

void check_moe(const MoeInputs& in, const char* what, int extra_workspace_tokens = 0,
               const cuda::MoeTuning& tuning = {}) {
  const std::vector<float> want = moe_cpu(in);
  MoeDevice dev(in, in.T + extra_workspace_tokens);
  dev.p.tuning = tuning;
  cuda::launch_moe(dev.p, nullptr);
  const std::vector<float> got = from_bf16(dev.out.download());
  expect_matches_oracle(got, want, what);
  // A second run over the now-dirty workspace gives the same bits.
  dev.out.poison();
  cuda::launch_moe(dev.p, nullptr);
  const std::vector<float> again = from_bf16(dev.out.download());
  EXPECT_EQ(0, std::memcmp(again.data(), got.data(), got.size() * sizeof(float))) << what << ": second run differs";
}

// Every token: k distinct routed ids from [0, E), then the shared rows E..R-1 (SPEC §4).
std::vector<int32_t> routed_plus_shared(int T, int E, int k, int n_shared, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids;
  std::vector<int32_t> all(static_cast<size_t>(E));
  for (int t = 0; t < T; ++t) {
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + k);
    for (int i = 0; i < n_shared; ++i) ids.push_back(E + i);
  }
  return ids;
}

TEST(CudaMoeExperts, BatchSizes) {
  TPMOE_REQUIRE_GPU();
  const int E = 16, k = 4, n = 1, H = 256, I = 128;
  for (int T : {1, 3, 19, 64, 256}) {
    const auto in = make_inputs(T, k + n, H, I, E + n, 2.f, routed_plus_shared(T, E, k, n, 11 + T), 1000 + T);
    check_moe(in, ("batch " + std::to_string(T)).c_str(), T == 19 ? 45 : 0);
  }
}

TEST(CudaMoeExperts, RepeatedExpertWithinAToken) {
  TPMOE_REQUIRE_GPU();
  const int T = 7, slots = 5, H = 128, I = 64, R = 17;
  std::vector<int32_t> ids;
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int> pick(0, 2);
  const int32_t choices[3] = {0, 1, R - 1};
  for (int t = 0; t < T; ++t) {
    if (t == 0) {
      ids.insert(ids.end(), {2, 2, 2, 9, R - 1});
    } else {
      for (int s = 0; s < slots; ++s) ids.push_back(choices[pick(rng)]);
    }
  }
  check_moe(make_inputs(T, slots, H, I, R, 0.75f, ids, 21), "repeated experts");
}

TEST(CudaMoeExperts, AllTokensOnOneExpert) {
  TPMOE_REQUIRE_GPU();
  // 200 pairs on row 5: seven token blocks, the last one partial.
  const int T = 100, slots = 2, H = 128, I = 96, R = 9;
  check_moe(make_inputs(T, slots, H, I, R, 1.f, std::vector<int32_t>(size_t(T) * slots, 5), 31), "one expert");
}

TEST(CudaMoeExperts, SharedRowsAtTheEndOfTheRowRange) {
  TPMOE_REQUIRE_GPU();
  // E = 256 routed rows + 1 shared row (id 256 = num_rows - 1) in every token, and routed ids
  // crowded at the top of the routed range: binning by E instead of num_rows drops row 256.
  const int T = 40, E = 256, k = 4, n = 1, R = E + n, H = 128, I = 64;
  std::vector<int32_t> ids;
  std::mt19937_64 rng(5);
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> top = {255, 254, 253, 252, 251, 250, 0};
    std::shuffle(top.begin(), top.end(), rng);
    ids.insert(ids.end(), top.begin(), top.begin() + k);
    ids.push_back(R - 1);
  }
  check_moe(make_inputs(T, k + n, H, I, R, 2.f, ids, 41), "shared rows at the end");

  // Only the last row: every pair on id num_rows - 1.
  check_moe(make_inputs(9, 3, H, I, R, 2.f, std::vector<int32_t>(27, R - 1), 43), "only the last row");
}

TEST(CudaMoeExperts, WidthsNotMultiplesOfTheTiles) {
  TPMOE_REQUIRE_GPU();
  // hidden 200 / inter 72: not multiples of the 32-wide k chunks nor of the 16/32-row tiles.
  check_moe(make_inputs(19, 3, 200, 72, 9, 1.5f, routed_plus_shared(19, 8, 2, 1, 51), 52), "H=200 I=72");
  // hidden 100 / inter 45: not multiples of the 16-byte vector width (scalar load path).
  check_moe(make_inputs(5, 3, 100, 45, 6, 1.f, routed_plus_shared(5, 5, 2, 1, 53), 54), "H=100 I=45");
  // Tiny: fewer than one chunk per warp.
  check_moe(make_inputs(2, 2, 8, 8, 3, 1.f, routed_plus_shared(2, 2, 1, 1, 55), 56), "H=8 I=8");
}

TEST(CudaMoeExperts, RealisticShape) {
  TPMOE_REQUIRE_GPU();
  const int E = 16, k = 4, n = 1, H = 1024, I = 384;
  for (int T : {1, 3, 64}) {
    check_moe(make_inputs(T, k + n, H, I, E + n, 2.f, routed_plus_shared(T, E, k, n, 61 + T), 62 + T),
              ("H=1024 I=384 batch " + std::to_string(T)).c_str());
  }
}

TEST(CudaMoeExperts, LargeBatchesAtOddWidths) {
  TPMOE_REQUIRE_GPU();
  // Batch 128 and 256 (32-pair token blocks) at widths that are not multiples of the tiles.
  const int E = 16, k = 4, n = 1;
  for (int T : {128, 256}) {
    check_moe(make_inputs(T, k + n, 200, 72, E + n, 2.f, routed_plus_shared(T, E, k, n, 91 + T), 92 + T),
              ("H=200 I=72 batch " + std::to_string(T)).c_str());
  }
}

TEST(CudaMoeExperts, EveryTokenBlockWidthAndLaunchMode) {
  TPMOE_REQUIRE_GPU();
  // launch_moe picks the token block (8, 16 or 32 pairs) from the batch; force each one, with and
  // without programmatic dependent launch and the down-weight L2 prefetch, on shapes where an expert
  // has more pairs than a block (repeats within a token, all tokens on one expert, the shared row).
  for (int bm : {8, 16, 32}) {
    for (int mode = 0; mode < 3; ++mode) {
      cuda::MoeTuning t;
      t.block_m = bm;
      t.pdl = mode != 1;
      t.down_prefetch_bytes = mode == 2 ? 0 : (1 << 20);
      t.auto_select = false;
      t.single_token_gemv = false;  // the T=1 and T=7 cases test the general path (the GEMVs: below)
      t.batch_gemv = false;
      const std::string tag = " bm=" + std::to_string(bm) + " mode=" + std::to_string(mode);
      check_moe(make_inputs(1, 5, 256, 128, 17, 2.f, routed_plus_shared(1, 16, 4, 1, 101), 102), ("T=1" + tag).c_str(),
                0, t);
      check_moe(make_inputs(19, 5, 200, 72, 9, 1.5f, routed_plus_shared(19, 8, 4, 1, 103), 104),
                ("T=19 H=200 I=72" + tag).c_str(), 0, t);
      check_moe(make_inputs(13, 3, 100, 45, 6, 1.f, std::vector<int32_t>(39, 5), 105),
                ("one expert H=100 I=45" + tag).c_str(), 0, t);
      std::vector<int32_t> rep;
      for (int tk = 0; tk < 7; ++tk) rep.insert(rep.end(), {2, 2, 2, 9, 16});
      check_moe(make_inputs(7, 5, 128, 64, 17, 0.75f, rep, 106), ("repeats" + tag).c_str(), 0, t);
    }
  }
}

// One token runs the two GEMV kernels of moe_gemv.cuh unless told otherwise: both against the oracle,
// with and without PDL, at shapes with the shared row, repeats within the token, widths the GEMVs
// decline (H % 8 != 0: the general path), the tp-8 slice width and gate_up's k split. The down
// kernel splits the slots across a block's warps below 2 row groups of 4 an SM (on an H200: H < 1056,
// with several slots a warp at 11 slots) and walks them in one warp above (H = 1536, 2056).
TEST(CudaMoeExperts, SingleTokenPath) {
  TPMOE_REQUIRE_GPU();
  std::vector<std::pair<MoeInputs, std::string>> cases;
  cases.emplace_back(make_inputs(1, 5, 256, 128, 17, 2.f, routed_plus_shared(1, 16, 4, 1, 111), 112), "H=256 I=128");
  cases.emplace_back(make_inputs(1, 5, 1024, 384, 17, 2.f, routed_plus_shared(1, 16, 4, 1, 113), 114), "H=1024 I=384");
  cases.emplace_back(make_inputs(1, 5, 128, 64, 17, 0.75f, {2, 2, 2, 9, 16}, 115), "repeats");
  cases.emplace_back(make_inputs(1, 11, 256, 64, 17, 1.f, routed_plus_shared(1, 16, 10, 1, 121), 122), "11 slots");
  // Few (slot, row) pairs: on an H200 gate_up splits each pair's k across 2 warps here, 4 at H=2056 below.
  cases.emplace_back(make_inputs(1, 5, 1536, 48, 17, 1.f, routed_plus_shared(1, 16, 4, 1, 125), 126),
                     "H=1536 I=48 (k split two ways)");
  cases.emplace_back(make_inputs(1, 3, 2056, 40, 6, 1.f, routed_plus_shared(1, 5, 2, 1, 117), 118),
                     "H=2056 I=40 (rows not multiples of a pass)");
  cases.emplace_back(make_inputs(1, 3, 100, 45, 6, 1.f, routed_plus_shared(1, 5, 2, 1, 119), 120), "H=100 I=45");
  for (const auto& [in, name] : cases) {
    for (int mode = 0; mode < 3; ++mode) {
      cuda::MoeTuning t;
      t.single_token_gemv = mode != 2;
      t.pdl = mode != 1;
      check_moe(in, (name + " mode=" + std::to_string(mode)).c_str(), 0, t);
    }
  }
}

// The few-token GEMVs of moe_gemv.cuh (2-8 tokens, after the alignment; by default only for MXFP8 at
// 2-4 tokens, here asked for): against the oracle with and without PDL, and the general path on the
// same inputs, at shapes with the shared
// row in every token, repeats within a token, a row with more than 8 pairs (two token blocks of one
// row), 11 slots, the tp-8 slice width (gate_up's k split) and rows not multiples of a pass.
TEST(CudaMoeExperts, FewTokensPath) {
  TPMOE_REQUIRE_GPU();
  std::vector<std::pair<MoeInputs, std::string>> cases;
  for (int T : {2, 3, 5, 8})
    cases.emplace_back(make_inputs(T, 5, 256, 128, 17, 2.f, routed_plus_shared(T, 16, 4, 1, 131 + T), 132 + T),
                       "T=" + std::to_string(T) + " H=256 I=128");
  cases.emplace_back(make_inputs(8, 5, 1024, 384, 17, 2.f, routed_plus_shared(8, 16, 4, 1, 141), 142),
                     "T=8 H=1024 I=384");
  cases.emplace_back(make_inputs(2, 5, 1536, 48, 17, 1.f, routed_plus_shared(2, 16, 4, 1, 143), 144),
                     "T=2 H=1536 I=48 (k split)");
  std::vector<int32_t> rep;
  for (int t = 0; t < 7; ++t) rep.insert(rep.end(), {2, 2, 2, 9, 16});  // row 2: 21 pairs, three blocks
  cases.emplace_back(make_inputs(7, 5, 128, 64, 17, 0.75f, rep, 145), "repeats");
  cases.emplace_back(make_inputs(4, 11, 256, 64, 17, 1.f, routed_plus_shared(4, 16, 10, 1, 146), 147), "11 slots");
  cases.emplace_back(make_inputs(3, 3, 2056, 40, 6, 1.f, routed_plus_shared(3, 5, 2, 1, 148), 149),
                     "H=2056 I=40 (rows not multiples of a pass)");
  for (const auto& [in, name] : cases) {
    for (int mode = 0; mode < 3; ++mode) {
      cuda::MoeTuning t;
      t.batch_gemv = mode != 2;
      t.auto_select = false;  // by default launch_moe keeps bf16 weights on the grouped GEMMs
      t.pdl = mode != 1;
      MoeDevice probe(in, in.T);
      EXPECT_TRUE(cuda::moe_gemv_batch_fits(probe.p)) << name << ": the case must take the few-token path";
      check_moe(in, (name + " mode=" + std::to_string(mode)).c_str(), 0, t);
    }
  }
}

// A slot id outside [0, num_rows) is a routing bug: the token's output is NaN on either path.
TEST(CudaMoeExperts, BadSlotIdGivesNaN) {
  TPMOE_REQUIRE_GPU();
  for (bool gemv : {true, false}) {
    MoeDevice dev(make_inputs(1, 3, 128, 64, 6, 1.f, {1, 6, 5}, 123), 1);
    dev.p.tuning.single_token_gemv = gemv;
    // Zeros, not the NaN poison: the NaN must be written.
    CUDA_CHECK(cudaMemset(dev.out.get(), 0, dev.out.size() * sizeof(__nv_bfloat16)));
    cuda::launch_moe(dev.p, nullptr);
    for (float v : from_bf16(dev.out.download())) ASSERT_TRUE(std::isnan(v)) << (gemv ? "GEMV path" : "general path");
  }
  // Two tokens, the second with the bad id: its row is NaN, the first token's is not.
  for (bool gemv : {true, false}) {
    MoeDevice dev(make_inputs(2, 3, 128, 64, 6, 1.f, {1, 2, 5, 1, 6, 5}, 124), 2);
    dev.p.tuning.batch_gemv = gemv;
    dev.p.tuning.auto_select = !gemv;  // bf16: the GEMVs only when asked for
    CUDA_CHECK(cudaMemset(dev.out.get(), 0, dev.out.size() * sizeof(__nv_bfloat16)));
    cuda::launch_moe(dev.p, nullptr);
    const std::vector<float> out = from_bf16(dev.out.download());
    const char* path = gemv ? "few-token GEMVs" : "general path";
    for (int h = 0; h < 128; ++h) {
      ASSERT_TRUE(std::isfinite(out[size_t(h)])) << path << ": token 0, row " << h;
      ASSERT_TRUE(std::isnan(out[128 + size_t(h)])) << path << ": token 1, row " << h;
    }
  }
}

// A layer that routes itself (MoeKernelParams::route) gives the bits of launch_route and then
// launch_moe: the output, the slots it writes and the routing statistics, on the single-token GEMVs
// (which route inside their kernels) and on the general path, with and without PDL; and those slots
// run through the oracle give the output. Routing of another shape than the layer's is refused.
TEST(CudaMoeExperts, RoutingInsideTheLayerMatchesRoutingFirst) {
  TPMOE_REQUIRE_GPU();
  struct Shape {
    int T, E, k, n, H, I;
  };
  // H = 2304: the down kernel's slot walk; the narrower ones: its slot split (moe_gemv.cu).
  for (const Shape s : {Shape{1, 128, 4, 1, 1024, 384}, Shape{1, 40, 8, 2, 256, 64}, Shape{1, 16, 4, 0, 128, 72},
                        Shape{1, 16, 4, 1, 2304, 64}, Shape{6, 128, 4, 1, 256, 128}}) {
    const int slots = s.k + s.n;
    const MoeInputs in =
        make_inputs(s.T, slots, s.H, s.I, s.E + s.n, 1.5f, std::vector<int32_t>(size_t(s.T) * slots, 0), 131 + s.E);
    std::vector<float> logits = random_floats(size_t(s.T) * s.E, 2.f, 132 + s.E);
    std::vector<float> bias = uniform_floats(size_t(s.E), -0.05f, 0.05f, 133);
    logits[3] = logits[s.E - 1] = 8.f;  // a tie among the first token's top choices
    bias[3] = bias[s.E - 1] = 0.f;
    const DeviceBuffer<float> d_logits(logits), d_bias(bias);
    const DeviceBuffer<int32_t> real_tokens(std::vector<int32_t>{s.T});
    for (int mode = 0; mode < 4; ++mode) {
      const std::string what = "T=" + std::to_string(s.T) + " E=" + std::to_string(s.E) + " k=" + std::to_string(s.k) +
                               " n=" + std::to_string(s.n) + " mode=" + std::to_string(mode);
      MoeDevice first(in, s.T), inside(in, s.T);
      DeviceBuffer<uint8_t> flags_first(std::vector<uint8_t>(size_t(s.E), 0)),
          flags_inside(std::vector<uint8_t>(size_t(s.E), 0));
      cuda::RouteKernelParams r =
          route_params(d_logits.get(), d_bias.get(), s.T, s.E, s.k, s.n, 0.4f, /*ids=*/nullptr, /*weights=*/nullptr);
      r.num_real_tokens = real_tokens.get();
      for (MoeDevice* dev : {&first, &inside}) {
        dev->p.tuning.single_token_gemv = mode < 2;
        dev->p.tuning.pdl = mode % 2 == 0;
        dev->ids.poison();
        dev->weights.poison();
      }
      cuda::RouteKernelParams r_first = r, r_inside = r;
      r_first.slot_ids = first.ids.get();
      r_first.slot_weights = first.weights.get();
      r_first.routed_flags = flags_first.get();
      r_inside.slot_ids = inside.ids.get();
      r_inside.slot_weights = inside.weights.get();
      r_inside.routed_flags = flags_inside.get();
      cuda::launch_route(r_first, nullptr);
      cuda::launch_moe(first.p, nullptr);
      inside.p.route = r_inside;
      cuda::launch_moe(inside.p, nullptr);

      const std::vector<int32_t> ids = first.ids.download();
      const std::vector<float> weights = first.weights.download();
      ASSERT_EQ(inside.ids.download(), ids) << what;
      ASSERT_EQ(inside.weights.download(), weights) << what;
      EXPECT_EQ(flags_inside.download(), flags_first.download()) << what;
      const std::vector<float> out = from_bf16(inside.out.download());
      EXPECT_EQ(out, from_bf16(first.out.download())) << what;
      MoeInputs routed = in;
      routed.ids = ids;
      routed.weights = weights;
      expect_matches_oracle(out, moe_cpu(routed), what.c_str());

      inside.p.route.num_shared = s.n + 1;  // slots of another layer
      EXPECT_THROW(cuda::launch_moe(inside.p, nullptr), Error) << what;
    }
  }
}

// A single token whose router logits are all NaN, routed inside the layer (the single-token GEMVs)
// and first (the general path): the k lowest ids, a NaN output row, and no fault (the routing of
// NaN once gave an id far past the weights).
TEST(CudaMoeExperts, NaNRouterLogitsGiveANaNRow) {
  TPMOE_REQUIRE_GPU();
  const int E = 16, k = 4, n = 1, H = 256, I = 128;
  const MoeInputs in = make_inputs(1, k + n, H, I, E + n, 1.f, std::vector<int32_t>(k + n, 0), 161);
  const DeviceBuffer<float> logits(std::vector<float>(E, std::numeric_limits<float>::quiet_NaN()));
  const DeviceBuffer<float> bias(std::vector<float>(E, 0.f));
  const DeviceBuffer<int32_t> real_tokens(std::vector<int32_t>{1});
  for (bool inside : {true, false}) {
    MoeDevice dev(in, 1);
    DeviceBuffer<uint8_t> flags(std::vector<uint8_t>(E, 0));
    dev.ids.poison();
    dev.weights.poison();
    cuda::RouteKernelParams r =
        route_params(logits.get(), bias.get(), 1, E, k, n, 0.4f, dev.ids.get(), dev.weights.get());
    r.num_real_tokens = real_tokens.get();
    r.routed_flags = flags.get();
    dev.p.tuning.single_token_gemv = inside;
    if (inside) {
      dev.p.route = r;
    } else {
      cuda::launch_route(r, nullptr);
    }
    cuda::launch_moe(dev.p, nullptr);
    const char* path = inside ? "routed inside" : "routed first";
    EXPECT_EQ(dev.ids.download(), (std::vector<int32_t>{0, 1, 2, 3, E})) << path;
    EXPECT_EQ(flags.download(), (std::vector<uint8_t>{1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})) << path;
    for (float v : from_bf16(dev.out.download())) ASSERT_TRUE(std::isnan(v)) << path;
  }
}

TEST(CudaMoeExperts, GraphReplayWithNewRouting) {
  TPMOE_REQUIRE_GPU();
  // The grid depends on the arguments only: one captured graph serves any routing.
  const int T = 8, E = 16, k = 4, n = 1, H = 256, I = 128;
  MoeInputs in = make_inputs(T, k + n, H, I, E + n, 2.f, routed_plus_shared(T, E, k, n, 71), 72);
  MoeDevice dev(in, T);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda::launch_moe(dev.p, stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; ++round) {
    in.ids = round == 2 ? std::vector<int32_t>(size_t(T) * (k + n), E) : routed_plus_shared(T, E, k, n, 73 + round);
    dev.ids.upload(in.ids);
    dev.out.poison();
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_matches_oracle(from_bf16(dev.out.download()), moe_cpu(in), "graph replay");
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaMoeExperts, RejectsASmallWorkspace) {
  TPMOE_REQUIRE_GPU();
  const auto in = make_inputs(4, 2, 64, 32, 3, 1.f, std::vector<int32_t>(8, 1), 81);
  MoeDevice dev(in, 4);
  dev.p.workspace_bytes = cuda::moe_workspace_bytes(3, 2, 64, 32, 3);
  EXPECT_THROW(cuda::launch_moe(dev.p, nullptr), Error);
}

}  // namespace
}  // namespace tpmoe::test
