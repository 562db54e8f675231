// Weight-only MXFP8 on the GPU against the CPU oracle (which dequantizes on load): the FP8 linear
// (launch_fp8_linear) and the MoE grouped GEMM with FP8 experts (launch_moe with scales) at awkward
// shapes, the in-register e4m3 -> bf16 widening bit-exact for every byte and scale, the device
// quantizer bit-exact against the host one, and the MXFP8 fixture end to end on the CUDA engine.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/moe.cuh"
#include "backends/cuda/mxfp8.cuh"
#include "backends/cuda/skinny_linear.cuh"
#include "core/error.h"
#include "cuda_test_util.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/presets.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe::test {
namespace {

// MXFP8 weights: e4m3 bytes, E8M0 scales and the fp32 values they stand for.
struct Mx {
  std::vector<uint8_t> q, s;
  std::vector<float> value;
};

// Random weights whose magnitude varies by 32-block (2^-4..2^3 times stddev), with a few values
// pushed into e4m3's subnormal range, quantized by the host quantizer.
Mx random_mx(std::vector<int64_t> shape, float stddev, uint64_t seed) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<float> v = random_floats(size_t(n), stddev, seed);
  std::mt19937_64 rng(seed + 99);
  std::uniform_int_distribution<int> shift(-4, 3);
  for (int64_t b = 0; b < n / 32; ++b) {
    const float f = std::ldexp(1.f, shift(rng));
    for (int i = 0; i < 32; ++i) v[b * 32 + i] *= f;
    v[b * 32 + (b % 32)] *= 1.f / 2048;  // subnormal in its block
  }
  const auto [q, s] = quantize_mxfp8(shape, v);
  Mx m;
  m.q.resize(q.bytes.size());
  m.s.resize(s.bytes.size());
  std::memcpy(m.q.data(), q.bytes.data(), m.q.size());
  std::memcpy(m.s.data(), s.bytes.data(), m.s.size());
  const int64_t K = shape.back();
  m.value.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i)
    m.value[i] = fp8_e4m3_to_f32(m.q[i]) * e8m0_to_f32(m.s[(i / K) * (K / 32) + (i % K) / 32]);
  return m;
}

// ---- linear ------------------------------------------------------------------------------------

std::vector<float> linear_cpu(const std::vector<float>& x, const std::vector<float>& w, int M, int N, int K) {
  std::vector<float> out(size_t(M) * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += double(x[size_t(m) * K + k]) * w[size_t(n) * K + k];
      out[size_t(m) * N + n] = float(acc);
    }
  return out;
}

// w_offset: bytes before the weights in their buffer (8: 8- but not 16-byte aligned weights); grouped:
// the grouped GEMM whatever the shape (launch_grouped_linear), else launch_fp8_linear's choice.
std::vector<float> linear_gpu(const std::vector<float>& x, const Mx& w, int M, int N, int K, bool out_f32,
                              size_t w_offset = 0, bool grouped = false) {
  DeviceBuffer<__nv_bfloat16> dx(to_bf16(x));
  std::vector<uint8_t> q(w_offset, 0);
  q.insert(q.end(), w.q.begin(), w.q.end());
  DeviceBuffer<uint8_t> dq(q), ds(w.s);
  cuda::Fp8LinearParams p;
  p.x = dx.get();
  p.w = dq.get() + w_offset;
  p.w_scale = ds.get();
  p.M = M, p.N = N, p.K = K;
  p.out_f32 = out_f32;
  auto launch = [&] { grouped ? cuda::launch_grouped_linear(p, nullptr) : cuda::launch_fp8_linear(p, nullptr); };
  if (out_f32) {
    DeviceBuffer<float> out(size_t(M) * N);  // poisoned
    p.out = out.get();
    launch();
    return out.download();
  }
  DeviceBuffer<__nv_bfloat16> out(size_t(M) * N);
  p.out = out.get();
  launch();
  return from_bf16(out.download());
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t not_finite = 0;
  for (float v : got) not_finite += !std::isfinite(v);
  EXPECT_EQ(not_finite, 0u) << what << ": elements left unwritten (poison) or not finite";
  const double err = relative_l2(got, want);
  EXPECT_LT(err, tol) << what;
}

TEST(CudaMxfp8Linear, MatchesOracleAtAwkwardShapes) {
  TPMOE_REQUIRE_GPU();
  struct Shape {
    int M, N, K;
  };
  for (const Shape s : {Shape{1, 40, 32}, Shape{3, 96, 160}, Shape{19, 1, 96}, Shape{64, 200, 256}, Shape{100, 72, 416},
                        Shape{300, 130, 128}, Shape{2, 1024, 6144}, Shape{8, 6144, 1024},
                        // decode-sized M runs the GEMV: K not a multiple of its 512-wide pass, and
                        // activations past 48 KiB of shared memory (up to the 200 KiB it takes)
                        Shape{5, 33, 8192}, Shape{8, 17, 12800}, Shape{7, 300, 544},
                        // few row tiles against a long k: the grouped GEMM splits k over a cluster
                        // of CTAs (8 and 4 splits; K ending in half a 64-wide chunk; 5 token blocks)
                        Shape{16, 128, 6144}, Shape{33, 72, 4128}, Shape{9, 40, 2048}, Shape{40, 64, 3072}}) {
    const std::vector<float> x = round_bf16(random_floats(size_t(s.M) * s.K, 1.f, 7 + s.M + s.K));
    const Mx w = random_mx({s.N, s.K}, 0.02f, 11 + s.N);
    const std::vector<float> want = linear_cpu(x, w.value, s.M, s.N, s.K);
    for (bool f32 : {true, false}) {
      const std::string what = fmt::format("M={} N={} K={} out {}", s.M, s.N, s.K, f32 ? "f32" : "bf16");
      // fp32 out: only the bf16 activations' products summed in another order (the weights widen
      // exactly); bf16 out adds one rounding. Past the GEMV's range, the grouped GEMM too (what
      // launch_fp8_linear runs up to 64 tokens is the skinny linear).
      expect_close(linear_gpu(x, w, s.M, s.N, s.K, f32), want, f32 ? 1e-5 : kTolBf16, what);
      if (s.M > 8)
        expect_close(linear_gpu(x, w, s.M, s.N, s.K, f32, 0, true), want, f32 ? 1e-5 : kTolBf16, what + ", grouped");
    }
  }
}

// Weights 8- but not 16-byte aligned (a view into a larger buffer): the grouped GEMM reads each
// lane's 16 bytes as two 8-byte loads instead of one 16-byte load; same values.
TEST(CudaMxfp8Linear, ReadsWeightsThatAreOnlyEightByteAligned) {
  TPMOE_REQUIRE_GPU();
  const int M = 100, N = 72, K = 416;  // the grouped GEMM; K ends in half a 64-wide chunk
  const std::vector<float> x = round_bf16(random_floats(size_t(M) * K, 1.f, 29));
  const Mx w = random_mx({N, K}, 0.02f, 31);
  const std::vector<float> aligned = linear_gpu(x, w, M, N, K, true, 0, true);
  expect_close(aligned, linear_cpu(x, w.value, M, N, K), 1e-5, "16-byte aligned weights");
  EXPECT_EQ(linear_gpu(x, w, M, N, K, true, 8, true), aligned) << "8-byte aligned weights";
  // launch_fp8_linear takes them too (the skinny linear needs 16-byte alignment, so it runs the
  // grouped GEMM for them).
  expect_close(linear_gpu(x, w, M, N, K, true, 8), linear_cpu(x, w.value, M, N, K), 1e-5, "launch_fp8_linear");
}

// A k split adds its CTAs' sums in a fixed order, whichever CTA of the cluster adds them: the same
// bits every run, on the grouped GEMM and on the skinny linear.
TEST(CudaMxfp8Linear, SplitKGivesTheSameBitsEveryRun) {
  TPMOE_REQUIRE_GPU();
  const int M = 16, N = 128, K = 6144;  // a tp-8 rank's k_proj at 16 tokens: 8 splits
  const std::vector<float> x = round_bf16(random_floats(size_t(M) * K, 1.f, 41));
  const Mx w = random_mx({N, K}, 0.02f, 43);
  for (bool grouped : {true, false}) {
    const std::vector<float> first = linear_gpu(x, w, M, N, K, true, 0, grouped);
    for (int run = 0; run < 3; ++run)
      EXPECT_EQ(linear_gpu(x, w, M, N, K, true, 0, grouped), first) << "run " << run << (grouped ? ", grouped" : "");
  }
}

// The skinny linear with MXFP8 weights (launch_skinny_linear: what launch_fp8_linear runs for 9-64
// tokens), every tiling against the oracle: 64-wide chunks, K ending in half a chunk (4128), scales
// of every magnitude.
TEST(CudaMxfp8Linear, SkinnyLinearMatchesOracleForEveryTiling) {
  TPMOE_REQUIRE_GPU();
  struct Shape {
    int M, N, K;
  };
  for (const Shape s : {Shape{9, 40, 2048}, Shape{33, 72, 4128}, Shape{64, 200, 256}, Shape{128, 130, 1024}}) {
    const std::vector<float> x = round_bf16(random_floats(size_t(s.M) * s.K, 1.f, 3 + s.M + s.K));
    const Mx w = random_mx({s.N, s.K}, 0.02f, 17 + s.N);
    const std::vector<float> want = linear_cpu(x, w.value, s.M, s.N, s.K);
    DeviceBuffer<__nv_bfloat16> dx(to_bf16(x));
    DeviceBuffer<uint8_t> dq(w.q), ds(w.s);
    for (int rw : {1, 2, 4, 8})
      for (int splits : {1, 3, 8}) {
        DeviceBuffer<float> out(size_t(s.M) * s.N);  // poisoned
        const cuda::SkinnyLinearParams p{dx.get(), dq.get(), ds.get(), out.get(), true, s.M, s.N, s.K};
        ASSERT_TRUE(cuda::skinny_linear_fits(p));
        cuda::launch_skinny_linear(p, nullptr, {rw, splits});
        expect_close(out.download(), want, 1e-5,
                     fmt::format("M={} N={} K={} row warps {} k splits {}", s.M, s.N, s.K, rw, splits));
      }
  }
}

// One-hot activations make out[m, n] = W[n, m] exactly: every e4m3 byte (NaN excepted) under every
// scale that keeps every value of the row a normal, finite bf16 (a row holding an infinity would make
// 0 * inf = NaN in its other outputs), both sides of the one-multiply limit s = 134.
TEST(CudaMxfp8Linear, WideningIsExactForEveryByteAndScale) {
  TPMOE_REQUIRE_GPU();
  const int K = 256, N = 237;  // row n uses scale 10 + n: s = 10..246 (448 * 2^119 < bf16's largest)
  Mx w;
  w.q.resize(size_t(N) * K);
  w.s.resize(size_t(N) * K / 32);
  for (int n = 0; n < N; ++n) {
    for (int k = 0; k < K; ++k) {
      uint8_t b = uint8_t(k + 7 * n);
      if ((b & 0x7f) == 0x7f) b ^= 1;  // no NaN bytes (the loader rejects them)
      w.q[size_t(n) * K + k] = b;
    }
    for (int c = 0; c < K / 32; ++c) w.s[size_t(n) * (K / 32) + c] = uint8_t(std::min(254, 10 + n));
  }
  for (int M : {8, 256}) {  // token blocks of 8 and 32
    std::vector<float> x(size_t(M) * K, 0.f);
    for (int m = 0; m < M; ++m) x[size_t(m) * K + (m * 37) % K] = 1.f;
    const std::vector<float> got = linear_gpu(x, w, M, N, K, true);
    int checked = 0;
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        const int k = (m * 37) % K;
        const uint8_t b = w.q[size_t(n) * K + k];
        const float want = fp8_e4m3_to_f32(b) * e8m0_to_f32(w.s[size_t(n) * (K / 32) + k / 32]);
        ASSERT_EQ(got[size_t(m) * N + n], want)
            << "byte 0x" << std::hex << int(b) << std::dec << " scale " << int(w.s[size_t(n) * (K / 32) + k / 32]);
        ++checked;
      }
    EXPECT_EQ(checked, M * N);
  }
}

TEST(CudaMxfp8Linear, RejectsWhatItCannotRead) {
  TPMOE_REQUIRE_GPU();
  DeviceBuffer<__nv_bfloat16> x(48);
  DeviceBuffer<uint8_t> q(48), s(2);
  DeviceBuffer<float> out(1);
  cuda::Fp8LinearParams p{x.get(), q.get(), s.get(), out.get(), true, 1, 1, 48};
  EXPECT_THROW(cuda::launch_fp8_linear(p, nullptr), Error);  // K % 32 != 0
  p.K = 32;
  p.w_scale = nullptr;
  EXPECT_THROW(cuda::launch_fp8_linear(p, nullptr), Error);  // no scales
}

// ---- MoE ---------------------------------------------------------------------------------------

std::vector<float> moe_cpu(std::vector<float> x, std::vector<int32_t> ids, std::vector<float> weights,
                           std::vector<float> gate_up, std::vector<float> down, int T, int slots, int H, int I, int R,
                           float scale) {
  std::vector<float> out(size_t(T) * H);
  cpu::CpuOps ops;
  ops.moe_experts(Tensor::make(x.data(), DType::kF32, T, H), Tensor::make(ids.data(), DType::kI32, T, slots),
                  Tensor::make(weights.data(), DType::kF32, T, slots),
                  Tensor::make(gate_up.data(), DType::kF32, R, 2 * I, H),
                  Tensor::make(down.data(), DType::kF32, R, H, I), SwigluParams{}, scale,
                  Tensor::make(out.data(), DType::kF32, T, H));
  return out;
}

std::vector<int32_t> routed_plus_shared(int T, int E, int k, int n_shared, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids, all(static_cast<size_t>(E));
  for (int t = 0; t < T; ++t) {
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + k);
    for (int i = 0; i < n_shared; ++i) ids.push_back(E + i);
  }
  return ids;
}

// Which experts path launch_moe takes: its own choice, the GEMVs of moe_gemv.cuh (1 token; 2-8 tokens)
// where they take the shape, or the general path (grouped GEMMs).
enum class MoePath { kDefault, kGemv, kGeneral };

void check_moe_fp8(int T, int E, int k, int H, int I, const std::string& what, MoePath path = MoePath::kDefault) {
  const int n = 1, R = E + n, slots = k + n;
  const float scale = 2.f;
  const std::vector<float> x = round_bf16(random_floats(size_t(T) * H, 1.f, 3 + T));
  const Mx gu = random_mx({R, 2 * I, H}, 0.05f, 5 + H), dn = random_mx({R, H, I}, 0.05f, 9 + I);
  const std::vector<int32_t> ids = routed_plus_shared(T, E, k, n, 17 + T);
  std::vector<float> w(size_t(T) * slots);
  std::mt19937_64 rng(T);
  std::uniform_real_distribution<float> u(0.05f, 1.f);
  for (auto& v : w) v = u(rng);
  const std::vector<float> want = moe_cpu(x, ids, w, gu.value, dn.value, T, slots, H, I, R, scale);

  DeviceBuffer<__nv_bfloat16> dx(to_bf16(x)), out(size_t(T) * H);
  DeviceBuffer<uint8_t> dgu(gu.q), dgus(gu.s), ddn(dn.q), ddns(dn.s);
  DeviceBuffer<int32_t> dids(ids);
  DeviceBuffer<float> dw(w);
  DeviceBuffer<uint8_t> ws(cuda::moe_workspace_bytes(T, slots, H, I, R));
  cuda::MoeKernelParams p;
  p.x = dx.get();
  p.slot_ids = dids.get();
  p.slot_weights = dw.get();
  p.gate_up = dgu.get();
  p.gate_up_scale = dgus.get();
  p.down = ddn.get();
  p.down_scale = ddns.get();
  p.out = out.get();
  p.num_tokens = T;
  p.slots = slots;
  p.hidden = H;
  p.inter = I;
  p.num_rows = R;
  p.scale = scale;
  p.workspace = ws.get();
  p.workspace_bytes = ws.size();
  p.tuning.single_token_gemv = p.tuning.batch_gemv = path != MoePath::kGeneral;
  if (path == MoePath::kGemv) p.tuning.auto_select = false;  // the few-token GEMVs at any 2-8 tokens
  cuda::launch_moe(p, nullptr);
  expect_close(from_bf16(out.download()), want, kTolBf16, what);
}

TEST(CudaMxfp8Moe, MatchesOracleAtAwkwardShapes) {
  TPMOE_REQUIRE_GPU();
  // Token blocks of 8, 16 and 32 pairs; K/32 of 8 (scale words) and of 5 or 3 (scale bytes).
  for (int T : {1, 3, 19, 64, 150}) check_moe_fp8(T, 16, 4, 256, 96, fmt::format("T={} E=16 k=4 H=256 I=96", T));
  check_moe_fp8(5, 7, 3, 160, 64, "T=5 E=7 k=3 H=160 I=64");
  // 2-4 tokens: the few-token GEMVs by default; 8 only when asked for.
  check_moe_fp8(2, 8, 4, 1024, 384, "T=2 E=8 k=4 H=1024 I=384 (tp-8 slice width), few-token GEMVs");
  check_moe_fp8(2, 8, 4, 1024, 384, "T=2 E=8 k=4 H=1024 I=384, general path", MoePath::kGeneral);
  check_moe_fp8(8, 16, 4, 1024, 384, "T=8 E=16 k=4 H=1024 I=384, few-token GEMVs", MoePath::kGemv);
  check_moe_fp8(8, 16, 4, 1024, 384, "T=8 E=16 k=4 H=1024 I=384, general path", MoePath::kGeneral);
  check_moe_fp8(3, 16, 4, 256, 96, "T=3 E=16 k=4 H=256 I=96, general path", MoePath::kGeneral);
  // One token: the single-token GEMVs (moe_gemv.cuh), and the general path they replace.
  check_moe_fp8(1, 8, 4, 1024, 384, "T=1 H=1024 I=384, single-token GEMVs");
  check_moe_fp8(1, 8, 4, 1024, 384, "T=1 H=1024 I=384, general path", MoePath::kGeneral);
  check_moe_fp8(1, 7, 3, 160, 64, "T=1 E=7 k=3 H=160 I=64, single-token GEMVs");
  // The down GEMV's two forms: the slot split above (few row groups), the slot walk here (on an H200:
  // 576 row groups of 4, at least 2 an SM).
  check_moe_fp8(1, 8, 4, 2304, 96, "T=1 E=8 k=4 H=2304 I=96, single-token GEMVs (down walks the slots)");
}

// ---- device quantizer --------------------------------------------------------------------------

TEST(CudaMxfp8Quantize, MatchesHostQuantizerBitForBit) {
  TPMOE_REQUIRE_GPU();
  const int64_t n = 32 * 1000;
  std::vector<float> v = round_bf16(random_floats(size_t(n), 0.02f, 4));
  for (int64_t i = 0; i < n; i += 97) v[i] *= 1e-3f;
  for (int64_t i = 0; i < 64; ++i) v[i] = 0.f;  // all-zero blocks
  v = round_bf16(v);
  const auto [q, s] = quantize_mxfp8({n / 32, 32}, v);
  DeviceBuffer<__nv_bfloat16> in(to_bf16(v));
  DeviceBuffer<uint8_t> dq{static_cast<size_t>(n)}, ds{static_cast<size_t>(n / 32)};
  cuda::launch_quantize_mxfp8(in.get(), dq.get(), ds.get(), n, nullptr);
  const auto gq = dq.download(), gs = ds.download();
  EXPECT_EQ(0, std::memcmp(gq.data(), q.bytes.data(), size_t(n)));
  EXPECT_EQ(0, std::memcmp(gs.data(), s.bytes.data(), size_t(n / 32)));
}

// ---- the engine ---------------------------------------------------------------------------------

// The fixture's MXFP8 values as a bf16 checkpoint (exact: an e4m3 value times a power of two is a
// bf16), same hub names, no quantization_config.
std::filesystem::path dequantized_copy(const std::filesystem::path& dir) {
  const auto src = io::SafetensorsSet::open_dir(dir);
  std::map<std::string, io::OwnedTensor> out;
  for (const auto& name : src.names()) {
    const io::TensorView& v = *src.find(name);
    if (name.size() > 10 && name.compare(name.size() - 10, 10, "_scale_inv") == 0) continue;
    if (v.dtype != DType::kF8E4M3) {
      out[name] = io::OwnedTensor::copy_of(v);
      continue;
    }
    const io::TensorView& sc = *src.find(name + "_scale_inv");
    const int64_t K = v.shape.back();
    std::vector<float> f(size_t(v.numel()));
    for (int64_t i = 0; i < v.numel(); ++i)
      f[i] = fp8_e4m3_to_f32(uint8_t(v.data[i])) * e8m0_to_f32(uint8_t(sc.data[(i / K) * (K / 32) + (i % K) / 32]));
    out[name] = io::OwnedTensor::from_f32(v.shape, f, DType::kBF16);
    EXPECT_EQ(out[name].to_f32(), f) << name << ": not exactly a bf16";
  }
  ModelConfig config = ModelConfig::from_file(dir / "config.json");
  config.quantization = {};
  const auto copy = make_temp_dir("mxfp8-as-bf16");
  io::write_safetensors(copy / "model.safetensors", out);
  std::ofstream(copy / "config.json") << config.to_json(ModelConfig::JsonForm::kMultimodalLegacy).dump(2) << "\n";
  return copy;
}

// The MXFP8 fixture on the CUDA engine (FP8 weights kept on the device, widened in registers)
// against the bf16 CUDA engine on the same values: the weights are bitwise the same bf16 numbers, so
// only the GEMMs' fp32 summation order (and the bf16 roundings it flips) differ. Both are printed
// against the CPU oracle; the FP8 path must be no further from it than the bf16 path, within slack.
TEST(CudaMxfp8Model, FixtureMatchesTheBf16PathOnTheSameValues) {
  TPMOE_REQUIRE_GPU();
  const auto dir = std::filesystem::path(__FILE__).parent_path() / "fixtures" / "m3-tiny-mxfp8";
  const GenerateRequest req = test::teacher_forced_request(test::load_fixture_reference(dir / "reference.safetensors"));
  const GenerateResult cpu = Engine::from_checkpoint(dir, {})->generate(req);
  const auto bf16_dir = dequantized_copy(dir);
  // Shared fusion on in every step, off, and on with every step over a 1-token limit (the fused
  // rows, FP8 with their scales, run as the shared MLP).
  for (int mode = 0; mode < 3; ++mode) {
    const bool fused = mode != 1;
    EngineOptions o;
    o.device = "cuda";
    o.shared_expert_fusion = fused;
    o.shared_fusion_max_tokens = mode == 2 ? 1 : 0;
    const GenerateResult fp8 = Engine::from_checkpoint(dir, o)->generate(req);
    const GenerateResult bf16 = Engine::from_checkpoint(bf16_dir, o)->generate(req);
    auto err = [](const GenerateResult& a, const GenerateResult& b) {
      return std::make_pair(relative_l2(concat(a.prefill_logits), concat(b.prefill_logits)),
                            relative_l2(concat(a.step_logits), concat(b.step_logits)));
    };
    const auto [fp8_cpu_p, fp8_cpu_s] = err(fp8, cpu);
    const auto [bf16_cpu_p, bf16_cpu_s] = err(bf16, cpu);
    const auto [fp8_bf16_p, fp8_bf16_s] = err(fp8, bf16);
    std::printf(
        "MXFP8 fixture, shared fusion %s, relative L2 (prefill / steps): GPU mxfp8 vs CPU %.3g / %.3g, GPU bf16 vs "
        "CPU %.3g / %.3g, GPU mxfp8 vs GPU bf16 %.3g / %.3g\n",
        mode == 0   ? "on"
        : mode == 1 ? "off"
                    : "on (rows as the MLP)",
        fp8_cpu_p, fp8_cpu_s, bf16_cpu_p, bf16_cpu_s, fp8_bf16_p, fp8_bf16_s);
    EXPECT_LT(fp8_cpu_p, 1.25 * bf16_cpu_p + 0.01);
    EXPECT_LT(fp8_cpu_s, 1.25 * bf16_cpu_s + 0.01);
    EXPECT_LT(fp8_bf16_p, 1.25 * bf16_cpu_p + 0.01);
  }
  std::filesystem::remove_all(bf16_dir);
}

}  // namespace
}  // namespace tpmoe::test
