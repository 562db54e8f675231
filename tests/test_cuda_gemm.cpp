// Dense projections through cuBLASLt (Gemm::linear), the grouped GEMM as a linear (launch_bf16_linear,
// its k split over a cluster where the tiles are few), the skinny linear (launch_skinny_linear, every
// tiling) and the decode GEMV (launch_gemv) against the
// CPU oracle's linear, at awkward shapes: batch 1, 3, 19; widths that are not multiples of the vector
// width; bf16 and fp32 outputs. At the end, CudaOps::linears over weights that lie back to back.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/gemm.h"
#include "backends/cuda/gemv.cuh"
#include "backends/cuda/moe.cuh"
#include "backends/cuda/norm.cuh"
#include "backends/cuda/skinny_linear.cuh"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "model/presets.h"
#include "test_util.h"

namespace tpmoe {
namespace {

// fp32 output: bf16 x bf16 products are exact in fp32, so only the summation order differs; but
// over K up to 8192 in tensor-core fragment order (maybe split-K) that is more than kTolF32 allows.
constexpr double kTolFp32Output = 1e-4;

struct Shape {
  int M, N, K;
};

// Random bf16 activations [M, K] and weights [N, K] on the device, and the CPU oracle's output for
// them: fp32 math over the same bf16 values.
struct LinearProblem {
  std::vector<float> x, w, want;
  test::DeviceBuffer<__nv_bfloat16> dx, dw;
  LinearProblem(Shape s, uint64_t seed)
      : x(test::round_bf16(test::random_floats(size_t(s.M) * s.K, 1.0f, seed + s.M))),
        w(test::round_bf16(test::random_floats(size_t(s.N) * s.K, 0.02f, seed + 18 + s.N))),
        want(size_t(s.M) * s.N),
        dx(test::to_bf16(x)),
        dw(test::to_bf16(w)) {
    std::vector<uint16_t> w_bits(w.size());
    for (size_t i = 0; i < w.size(); ++i) w_bits[i] = f32_to_bf16(w[i]);
    cpu::CpuOps cpu;
    cpu.linear(Tensor::make(x.data(), DType::kF32, s.M, s.K), Tensor::make(w_bits.data(), DType::kBF16, s.N, s.K),
               Tensor::make(want.data(), DType::kF32, s.M, s.N));
  }
};

std::string shape_name(const ::testing::TestParamInfo<Shape>& info) {
  return "M" + std::to_string(info.param.M) + "_N" + std::to_string(info.param.N) + "_K" + std::to_string(info.param.K);
}

class CudaGemm : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaGemm, LinearMatchesCpu) {
  TPMOE_REQUIRE_GPU();
  const auto [M, N, K] = GetParam();
  LinearProblem lp(GetParam(), 11);
  const std::vector<float>& want = lp.want;
  auto& dx = lp.dx;
  auto& dw = lp.dw;

  cuda::Gemm gemm;
  test::DeviceBuffer<float> out_f32(size_t(M) * N);
  test::DeviceBuffer<__nv_bfloat16> out_bf16(size_t(M) * N);
  gemm.linear(dx.get(), dw.get(), out_f32.get(), true, M, N, K, nullptr);
  gemm.linear(dx.get(), dw.get(), out_bf16.get(), false, M, N, K, nullptr);
  EXPECT_LT(test::relative_l2(out_f32.download(), want), kTolFp32Output);
  EXPECT_LT(test::relative_l2(test::from_bf16(out_bf16.download()), want), test::kTolBf16);

  // The grouped GEMM as a linear (fresh, poisoned outputs: every element must be written), twice:
  // a k split adds its CTAs' sums in a fixed order, so the bits repeat.
  for (bool f32 : {true, false}) {
    std::vector<float> runs[2];
    for (auto& got : runs) {
      test::DeviceBuffer<float> o32(size_t(M) * N);
      test::DeviceBuffer<__nv_bfloat16> o16(size_t(M) * N);
      cuda::launch_bf16_linear({dx.get(), dw.get(), f32 ? static_cast<void*>(o32.get()) : o16.get(), f32, M, N, K},
                               nullptr);
      got = f32 ? o32.download() : test::from_bf16(o16.download());
    }
    size_t not_finite = 0;
    for (float v : runs[0]) not_finite += !std::isfinite(v);
    EXPECT_EQ(not_finite, 0u) << "launch_bf16_linear left elements unwritten, out " << (f32 ? "f32" : "bf16");
    EXPECT_LT(test::relative_l2(runs[0], want), f32 ? kTolFp32Output : test::kTolBf16) << "launch_bf16_linear";
    EXPECT_EQ(runs[0], runs[1]) << "launch_bf16_linear: the same bits every run";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaGemm,
                         ::testing::Values(Shape{1, 8, 16}, Shape{3, 100, 72}, Shape{19, 384, 128},
                                           Shape{1, 6144, 8192}, Shape{19, 512, 6144}, Shape{64, 257, 136},
                                           // a tp-8 rank's k_proj and q_proj at 16 and 40 tokens (k
                                           // split 8 and 4 ways), K off the 8-wide loads
                                           Shape{16, 128, 6144}, Shape{40, 1024, 6144}, Shape{10, 7, 4100}),
                         shape_name);

// ---- the skinny linear (skinny_linear.cuh): one pass over the weight for 1-128 tokens ---------------

class CudaSkinnyLinear : public ::testing::TestWithParam<Shape> {};

// Every tiling (row tile of 16, 32, 64 or 128 rows; k split over 1, 3 or 8 CTAs of a cluster, cut
// down where a CTA would get no stage of 128 k) against the CPU oracle, with poisoned outputs
// (every element must be written), and the launcher's own choice twice: the same bits every run.
TEST_P(CudaSkinnyLinear, EveryTilingMatchesCpu) {
  TPMOE_REQUIRE_GPU();
  const auto [M, N, K] = GetParam();
  LinearProblem lp(GetParam(), 13);
  const std::vector<float>& want = lp.want;
  auto& dx = lp.dx;
  auto& dw = lp.dw;

  auto run = [&](bool f32, cuda::SkinnyLinearTiling tiling) {
    test::DeviceBuffer<float> o32(size_t(M) * N);
    test::DeviceBuffer<__nv_bfloat16> o16(size_t(M) * N);
    const cuda::SkinnyLinearParams p{dx.get(), dw.get(), nullptr, f32 ? static_cast<void*>(o32.get()) : o16.get(),
                                     f32,      M,        N,       K};
    EXPECT_TRUE(cuda::skinny_linear_fits(p));
    cuda::launch_skinny_linear(p, nullptr, tiling);
    return f32 ? o32.download() : test::from_bf16(o16.download());
  };
  for (int rw : {1, 2, 4, 8})
    for (int splits : {1, 3, 8})
      for (bool f32 : {true, false}) {
        const std::vector<float> got = run(f32, {rw, splits});
        size_t not_finite = 0;
        for (float v : got) not_finite += !std::isfinite(v);
        const std::string what = "row warps " + std::to_string(rw) + ", k splits " + std::to_string(splits) +
                                 (f32 ? ", out f32" : ", out bf16");
        EXPECT_EQ(not_finite, 0u) << what << ": elements left unwritten";
        EXPECT_LT(test::relative_l2(got, want), f32 ? kTolFp32Output : test::kTolBf16) << what;
      }
  EXPECT_EQ(run(true, {}), run(true, {})) << "the launcher's tiling: the same bits every run";
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaSkinnyLinear,
                         ::testing::Values(Shape{1, 8, 16}, Shape{9, 40, 2048}, Shape{17, 130, 1000},
                                           Shape{33, 384, 6144}, Shape{64, 257, 136}, Shape{100, 72, 416},
                                           Shape{128, 1000, 512}, Shape{65, 31, 6152}),
                         shape_name);

// What it cannot read it declines (and its launcher names): more than 128 tokens, K off the 8-wide
// loads, misaligned activations, an output on top of the input.
TEST(CudaSkinnyLinear, DeclinesWhatItCannotRead) {
  TPMOE_REQUIRE_GPU();
  test::DeviceBuffer<__nv_bfloat16> x(size_t(129) * 64 + 8), w(size_t(64) * 64);
  test::DeviceBuffer<float> out(size_t(129) * 64);
  const cuda::SkinnyLinearParams ok{x.get(), w.get(), nullptr, out.get(), true, 128, 64, 64};
  EXPECT_TRUE(cuda::skinny_linear_fits(ok));
  auto bad = ok;
  bad.M = 129;
  EXPECT_FALSE(cuda::skinny_linear_fits(bad));
  EXPECT_THROW(cuda::launch_skinny_linear(bad, nullptr), Error);
  bad = ok;
  bad.K = 60;
  EXPECT_FALSE(cuda::skinny_linear_fits(bad));
  bad = ok;
  bad.x = x.get() + 1;
  EXPECT_FALSE(cuda::skinny_linear_fits(bad));
  bad = ok;
  bad.out = const_cast<__nv_bfloat16*>(bad.x);
  EXPECT_FALSE(cuda::skinny_linear_fits(bad));
  EXPECT_THROW(cuda::launch_skinny_linear(ok, nullptr, {3, 1}), Error);  // row warps not 1, 2, 4 or 8
}

}  // namespace
}  // namespace tpmoe

// ---- the decode GEMV (gemv.cuh): up to 6 projections of one input in one launch ------------------

namespace tpmoe {
namespace {

struct GemvCase {
  int M, K;
};

class CudaGemv : public ::testing::TestWithParam<GemvCase> {};

// Each output of one launch against the CPU oracle, and bit-equal to the same projection launched
// alone: fusing projections into one launch changes nothing but the launch count.
TEST_P(CudaGemv, EveryOutputMatchesCpuAndItsOwnLaunch) {
  TPMOE_REQUIRE_GPU();
  const auto [M, K] = GetParam();
  // Rows per projection, ragged on purpose; at K >= 1024 the first four split k over 4 warps, 1100
  // rows over 2, 2100 rows not at all (gemv.cu's choose_k_split).
  const std::vector<int> widths = {100, 8, 1, 257, 1100, 2100};
  const auto x = test::round_bf16(test::random_floats(size_t(M) * K, 1.0f, 5 + M));
  test::DeviceBuffer<__nv_bfloat16> dx(test::to_bf16(x));
  std::vector<float> x_host = x;
  cpu::CpuOps cpu;

  std::vector<std::vector<float>> want;
  std::deque<test::DeviceBuffer<__nv_bfloat16>> weights, outs_bf16;  // deque: buffers do not move
  std::deque<test::DeviceBuffer<float>> outs_f32;
  cuda::GemvParams fused;
  fused.x = dx.get();
  fused.M = M;
  fused.K = K;
  for (size_t i = 0; i < widths.size(); ++i) {
    const int N = widths[i];
    const auto w = test::round_bf16(test::random_floats(size_t(N) * K, 0.02f, 41 + int(i)));
    std::vector<uint16_t> w_bits(w.size());
    for (size_t j = 0; j < w.size(); ++j) w_bits[j] = f32_to_bf16(w[j]);
    std::vector<float> ref(size_t(M) * N);
    cpu.linear(Tensor::make(x_host.data(), DType::kF32, M, K), Tensor::make(w_bits.data(), DType::kBF16, N, K),
               Tensor::make(ref.data(), DType::kF32, M, N));
    want.push_back(ref);
    weights.emplace_back(test::to_bf16(w));
    outs_bf16.emplace_back(size_t(M) * N);
    outs_f32.emplace_back(size_t(M) * N);
    // Odd outputs in fp32 (the router's logits), even ones in bf16.
    const bool f32 = i % 2 == 1;
    fused.outputs[fused.count++] = {weights.back().get(), nullptr,
                                    f32 ? static_cast<void*>(outs_f32.back().get()) : outs_bf16.back().get(), f32, N};
  }
  ASSERT_TRUE(cuda::gemv_fits(fused));
  cuda::launch_gemv(fused, nullptr);
  for (size_t i = 0; i < widths.size(); ++i) {
    const bool f32 = i % 2 == 1;
    const std::vector<float> got = f32 ? outs_f32[i].download() : test::from_bf16(outs_bf16[i].download());
    EXPECT_LT(test::relative_l2(got, want[i]), f32 ? kTolFp32Output : test::kTolBf16) << "output " << i;

    cuda::GemvParams alone = fused;
    alone.outputs[0] = fused.outputs[i];
    alone.count = 1;
    test::DeviceBuffer<float> own_f32(size_t(M) * widths[i]);
    test::DeviceBuffer<__nv_bfloat16> own_bf16(size_t(M) * widths[i]);
    alone.outputs[0].out = f32 ? static_cast<void*>(own_f32.get()) : own_bf16.get();
    cuda::launch_gemv(alone, nullptr);
    if (f32)
      EXPECT_EQ(own_f32.download(), outs_f32[i].download()) << "output " << i;
    else
      EXPECT_EQ(test::from_bf16(own_bf16.download()), test::from_bf16(outs_bf16[i].download())) << "output " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaGemv,
                         ::testing::Values(GemvCase{1, 16}, GemvCase{1, 6144}, GemvCase{3, 272}, GemvCase{8, 3072},
                                           GemvCase{5, 8192}),
                         [](const auto& info) {
                           return "M" + std::to_string(info.param.M) + "_K" + std::to_string(info.param.K);
                         });

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The GEMV that normalises its own input (GemvInputNorm) against add_rmsnorm and then the plain
// GEMV: x, the new residual and every output bit for bit, the residual it read left as it was. Hidden
// sizes whose norm threads (norm_math.cuh) are fewer than a GEMV block's 128 (32: K 16, 128), more
// and not a multiple of them (160: K 1040), and six times as many (768: K 6144). Both run twice in a
// row, the fused one with its residual buffers swapped between launches, as the model runs them.
TEST(CudaGemv, InputNormInsideIsTheNormThenTheGemv) {
  TPMOE_REQUIRE_GPU();
  const std::vector<int> widths = {100, 1, 257};
  for (const auto& [M, K] : std::vector<std::pair<int, int>>{{2, 16}, {1, 128}, {3, 1040}, {8, 6144}}) {
    SCOPED_TRACE("M " + std::to_string(M) + " K " + std::to_string(K));
    const std::vector<float> residual = test::random_floats(size_t(M) * K, 3.0f, 70 + K);
    const std::vector<float> norm_w = test::random_floats(size_t(K), 0.3f, 71 + K);
    test::DeviceBuffer<__nv_bfloat16> partial(test::to_bf16(test::random_floats(size_t(M) * K, 1.0f, 72 + K)));
    test::DeviceBuffer<float> dnorm_w(norm_w), res_ref(residual), res_a(residual), res_b(size_t(M) * K);
    test::DeviceBuffer<__nv_bfloat16> x_ref(size_t(M) * K), x(size_t(M) * K);
    std::deque<test::DeviceBuffer<__nv_bfloat16>> weights;
    std::deque<test::DeviceBuffer<float>> out_ref, out;  // fp32 and bf16 outputs both as fp32-sized buffers
    cuda::GemvParams ref, fused;
    ref.x = x_ref.get();
    ref.M = fused.M = M;
    ref.K = fused.K = K;
    for (size_t i = 0; i < widths.size(); ++i) {
      const int N = widths[i];
      weights.emplace_back(test::to_bf16(test::random_floats(size_t(N) * K, 0.02f, 80 + int(i))));
      out_ref.emplace_back(size_t(M) * N);
      out.emplace_back(size_t(M) * N);
      const bool f32 = i % 2 == 1;
      ref.outputs[ref.count++] = {weights.back().get(), nullptr, out_ref.back().get(), f32, N};
      fused.outputs[fused.count++] = {weights.back().get(), nullptr, out.back().get(), f32, N};
    }
    for (int launch = 0; launch < 2; ++launch) {
      test::DeviceBuffer<float>& read = launch == 0 ? res_a : res_b;  // the model's `now`
      test::DeviceBuffer<float>& written = launch == 0 ? res_b : res_a;
      const std::vector<float> before = read.download();
      fused.norm = {partial.get(), read.get(), written.get(), dnorm_w.get(), 1e-6f, x.get()};
      ASSERT_TRUE(cuda::gemv_fits(fused));
      cuda::launch_add_rmsnorm({partial.get(), res_ref.get(), dnorm_w.get(), x_ref.get(), M, K, 1e-6f}, nullptr);
      cuda::launch_gemv(ref, nullptr);
      cuda::launch_gemv(fused, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(same_bits(written.download(), res_ref.download())) << "new residual, launch " << launch;
      EXPECT_TRUE(same_bits(read.download(), before)) << "residual read, launch " << launch;
      EXPECT_TRUE(same_bits(x.download(), x_ref.download())) << "x, launch " << launch;
      for (size_t i = 0; i < widths.size(); ++i)  // a bf16 output leaves the same poisoned tail in both
        EXPECT_TRUE(same_bits(out[i].download(), out_ref[i].download())) << "output " << i << ", launch " << launch;
    }
  }
}

// The norm inside pays where few blocks read the rows (a router), not where a thousand would (a
// full-width projection at 8 tokens: 163 MB of reads from L2).
TEST(CudaGemv, InputNormInsideOnlyWhereItPays) {
  TPMOE_REQUIRE_GPU();
  test::DeviceBuffer<__nv_bfloat16> x(8 * 6144), w(4096 * 6144), partial(8 * 6144);
  test::DeviceBuffer<float> out(8 * 4096), residual(8 * 6144), spare(8 * 6144), norm_w(6144);
  cuda::GemvParams p;
  p.x = x.get();
  p.M = 1;
  p.K = 6144;
  p.outputs[0] = {w.get(), nullptr, out.get(), true, 128};  // a router: 64 blocks
  p.count = 1;
  p.norm = {partial.get(), residual.get(), spare.get(), norm_w.get(), 1e-6f, x.get()};
  EXPECT_FALSE(cuda::gemv_fits(p));  // with an input norm x is computed (norm.out): an x beside it is refused
  p.x = nullptr;
  EXPECT_TRUE(cuda::gemv_norm_pays(p));
  p.M = 8;
  p.outputs[0].N = 4096;  // 512 blocks
  EXPECT_TRUE(cuda::gemv_fits(p));
  EXPECT_FALSE(cuda::gemv_norm_pays(p));
  cuda::GemvParams q = p;
  q.norm.residual_out = nullptr;
  EXPECT_FALSE(cuda::gemv_fits(q));
  q.norm.residual_out = residual.get();  // the sums may not go where every block reads
  EXPECT_FALSE(cuda::gemv_fits(q));
  q = p;
  q.norm.out = nullptr;
  EXPECT_FALSE(cuda::gemv_fits(q));
  q = p;
  q.norm.residual = residual.get() + 1;  // not 16-byte aligned
  EXPECT_FALSE(cuda::gemv_fits(q));
  EXPECT_THROW(cuda::launch_gemv(q, nullptr), Error);
}

TEST(CudaGemv, DeclinesWhatItCannotRead) {
  TPMOE_REQUIRE_GPU();
  test::DeviceBuffer<__nv_bfloat16> x(9 * 64), w(64 * 64), out(9 * 64);
  test::DeviceBuffer<uint8_t> scale(64 * 2);
  cuda::GemvParams p;
  p.x = x.get();
  p.M = 1;
  p.K = 64;
  p.outputs[0] = {w.get(), nullptr, out.get(), false, 64};
  p.count = 1;
  EXPECT_TRUE(cuda::gemv_fits(p));
  cuda::GemvParams q = p;
  q.M = 9;  // more tokens than the GEMV serves
  EXPECT_FALSE(cuda::gemv_fits(q));
  EXPECT_THROW(cuda::launch_gemv(q, nullptr), Error);
  q = p;
  q.K = 56;  // K % 16 != 0
  EXPECT_FALSE(cuda::gemv_fits(q));
  q = p;
  q.x = x.get() + 1;  // not 16-byte aligned
  EXPECT_FALSE(cuda::gemv_fits(q));
  q = p;
  q.outputs[1] = {w.get(), scale.get(), out.get(), false, 64};  // an MXFP8 weight beside a bf16 one
  q.count = 2;
  EXPECT_FALSE(cuda::gemv_fits(q));
  q = p;
  q.outputs[0].out = const_cast<__nv_bfloat16*>(p.x);  // out aliases x
  EXPECT_THROW(cuda::launch_gemv(q, nullptr), Error);
}

}  // namespace
}  // namespace tpmoe

// ---- CudaOps::linears: projections whose weights lie back to back run as one matmul ----------------

namespace tpmoe {
namespace {

// Weights of one format on the device, twice: back to back in one buffer (as DeviceWeights places a
// layer's projections; MXFP8 scales back to back in another) and apart, a gap after each part.
struct JoinedAndApart {
  std::vector<float> values;  // what the weights hold, [rows, K] (MXFP8: dequantized)
  std::unique_ptr<test::DeviceBuffer<uint8_t>> together, together_scale, apart, apart_scale;
  std::vector<Tensor> joined_parts, apart_parts;
};

JoinedAndApart weights_both_ways(const std::vector<int>& widths, int K, bool mxfp8) {
  int rows = 0;
  for (int n : widths) rows += n;
  JoinedAndApart w;
  std::vector<float> v = test::round_bf16(test::random_floats(size_t(rows) * K, 0.02f, 71));
  std::vector<uint8_t> bytes, scales;
  if (mxfp8) {
    const auto [q, sc] = quantize_mxfp8({rows, K}, v);
    bytes.resize(q.bytes.size());
    scales.resize(sc.bytes.size());
    std::memcpy(bytes.data(), q.bytes.data(), bytes.size());
    std::memcpy(scales.data(), sc.bytes.data(), scales.size());
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = fp8_e4m3_to_f32(bytes[i]) * e8m0_to_f32(scales[i / size_t(kMxfp8BlockSize)]);
  } else {
    const std::vector<__nv_bfloat16> b = test::to_bf16(v);
    bytes.resize(b.size() * 2);
    std::memcpy(bytes.data(), b.data(), bytes.size());
  }
  w.values = v;
  const DType dtype = mxfp8 ? DType::kF8E4M3 : DType::kBF16;
  const size_t elem = mxfp8 ? 1 : 2;
  constexpr size_t kGap = 256;  // bytes after each part laid apart (keeps 16-byte alignment)
  w.together = std::make_unique<test::DeviceBuffer<uint8_t>>(bytes);
  w.apart = std::make_unique<test::DeviceBuffer<uint8_t>>(bytes.size() + widths.size() * kGap);
  if (mxfp8) {
    w.together_scale = std::make_unique<test::DeviceBuffer<uint8_t>>(scales);
    w.apart_scale = std::make_unique<test::DeviceBuffer<uint8_t>>(scales.size() + widths.size() * kGap);
  }
  size_t at = 0, at_scale = 0, apart_at = 0, apart_scale_at = 0;
  for (int n : widths) {
    const size_t part = size_t(n) * K * elem, part_scale = mxfp8 ? size_t(n) * K / kMxfp8BlockSize : 0;
    Tensor joined = Tensor::make(w.together->get() + at, dtype, n, K),
           apart = Tensor::make(w.apart->get() + apart_at, dtype, n, K);
    CUDA_CHECK(cudaMemcpy(apart.data, bytes.data() + at, part, cudaMemcpyHostToDevice));
    if (mxfp8) {
      joined.scale = w.together_scale->get() + at_scale;
      apart.scale = w.apart_scale->get() + apart_scale_at;
      CUDA_CHECK(cudaMemcpy(apart.scale, scales.data() + at_scale, part_scale, cudaMemcpyHostToDevice));
    }
    w.joined_parts.push_back(joined);
    w.apart_parts.push_back(apart);
    at += part;
    at_scale += part_scale;
    apart_at += part + kGap;
    apart_scale_at += part_scale + kGap;
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  return w;
}

// A layer's projections of one input (q, k, v and the indexer's q and k of a narrow rank), their
// weights once back to back and once apart: the same outputs within the bf16 tolerance of the CPU
// oracle either way (on the values the weights hold), every element written, and as a recorded step
// the joined form takes fewer launches (one matmul and the column split, against one matmul each and,
// for bf16, cuBLASLt's split-k reductions). Batch 3 is the GEMV's (one launch either way); from 9
// tokens bf16 runs the skinny linear up to 16 and cuBLASLt beyond, MXFP8 the skinny linear up to 64.
void check_joined_linears(bool mxfp8) {
  const int K = 1024;
  const std::vector<int> widths = {512, 64, 64, 64, 64};
  const JoinedAndApart w = weights_both_ways(widths, K, mxfp8);

  cuda::CudaReserve r;
  r.max_tokens = 64;
  r.arena_bytes = 16 << 20;
  r.num_q_heads = 1;
  r.head_dim = 64;
  cuda::CudaOps ops(r);
  CacheShape shape;
  shape.num_layers = 1;
  shape.sparse_layer = {false};
  shape.num_kv_heads = 1;
  shape.head_dim = 64;
  shape.max_seqs = 64;
  shape.max_len = 16;
  shape.num_pages = shape.max_seqs * shape.pages_per_seq();
  ops.init_cache(shape);

  for (const int M : {3, 9, 16, 17, 64}) {
    SCOPED_TRACE(testing::Message() << "M=" << M);
    const std::vector<float> x = test::round_bf16(test::random_floats(size_t(M) * K, 1.0f, 90 + M));
    StepTokens st;
    st.token_ids.assign(size_t(M), 0);
    st.positions.assign(size_t(M), 0);
    for (int t = 0; t < M; ++t) st.seq_slots.push_back(t);
    int launches[2] = {};
    for (const bool joined : {true, false}) {
      SCOPED_TRACE(joined ? "back to back" : "apart");
      ops.begin_step(st);
      Tensor tx = ops.alloc(M, K);
      CUDA_CHECK(cudaMemcpy(tx.data, test::to_bf16(x).data(), tx.nbytes(), cudaMemcpyHostToDevice));
      std::vector<Projection> items;
      for (size_t i = 0; i < widths.size(); ++i) {
        Tensor out = ops.alloc(M, widths[i]);
        CUDA_CHECK(cudaMemset(out.data, 0xFF, out.nbytes()));  // NaN until written
        items.push_back({joined ? w.joined_parts[i] : w.apart_parts[i], out});
      }
      CUDA_CHECK(cudaDeviceSynchronize());
      ops.run_step(2 * M + joined, [&] {
        ops.linears(tx, items);
        return items[0].out;
      });
      CUDA_CHECK(cudaStreamSynchronize(ops.stream()));
      launches[joined] = ops.last_step_launches();
      size_t first_row = 0;
      for (size_t i = 0; i < widths.size(); ++i) {
        std::vector<float> x_host = x, want(size_t(M) * widths[i]);
        cpu::CpuOps cpu;
        cpu.linear(Tensor::make(x_host.data(), DType::kF32, M, K),
                   Tensor::make(const_cast<float*>(w.values.data()) + first_row * K, DType::kF32, widths[i], K),
                   Tensor::make(want.data(), DType::kF32, M, widths[i]));
        std::vector<__nv_bfloat16> got_bf16(size_t(M) * widths[i]);
        CUDA_CHECK(cudaMemcpy(got_bf16.data(), items[i].out.data, got_bf16.size() * 2, cudaMemcpyDeviceToHost));
        const std::vector<float> got = test::from_bf16(got_bf16);
        size_t not_finite = 0;
        for (float v : got) not_finite += !std::isfinite(v);
        EXPECT_EQ(not_finite, 0u) << "output " << i << " left unwritten";
        EXPECT_LT(test::relative_l2(got, want), test::kTolBf16) << "output " << i;
        first_row += size_t(widths[i]);
      }
    }
    if (M > 8) {
      EXPECT_LT(launches[1], launches[0]) << "back to back, apart";
    } else {
      EXPECT_EQ(launches[1], launches[0]) << "the GEMV takes both forms in one launch";
    }
  }
}

TEST(CudaOpsLinears, WeightsBackToBackRunAsOneMatmulWithTheSameOutputs) {
  TPMOE_REQUIRE_GPU();
  check_joined_linears(false);
}

TEST(CudaOpsLinears, Mxfp8WeightsAndScalesBackToBackRunAsOneMatmulWithTheSameOutputs) {
  TPMOE_REQUIRE_GPU();
  check_joined_linears(true);
}

}  // namespace
}  // namespace tpmoe
