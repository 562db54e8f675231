// Dense projections through cuBLASLt (Gemm::linear) against the CPU oracle's linear, at awkward
// shapes: batch 1, 3, 19; widths that are not multiples of the vector width; bf16 and fp32 outputs.
#include <gtest/gtest.h>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/gemm.h"
#include "cuda_test_util.h"
#include "test_util.h"

namespace tpmoe {
namespace {

// fp32 output: bf16 x bf16 products are exact in fp32, so only the summation order differs; but
// over K up to 8192 in tensor-core fragment order (maybe split-K) that is more than kTolF32 allows.
constexpr double kTolFp32Output = 1e-4;

struct Shape {
  int M, N, K;
};

class CudaGemm : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaGemm, LinearMatchesCpu) {
  TPMOE_REQUIRE_GPU();
  const auto [M, N, K] = GetParam();
  const auto x = test::round_bf16(test::random_floats(size_t(M) * K, 1.0f, 11 + M));
  const auto w = test::round_bf16(test::random_floats(size_t(N) * K, 0.02f, 29 + N));

  // Oracle: fp32 math over the same bf16 values.
  std::vector<uint16_t> w_bits(w.size());
  for (size_t i = 0; i < w.size(); ++i) w_bits[i] = f32_to_bf16(w[i]);
  std::vector<float> x_host = x, want(size_t(M) * N);
  cpu::CpuOps cpu;
  cpu.linear(Tensor::make(x_host.data(), DType::kF32, M, K), Tensor::make(w_bits.data(), DType::kBF16, N, K),
             Tensor::make(want.data(), DType::kF32, M, N));

  cuda::Gemm gemm;
  test::DeviceBuffer<__nv_bfloat16> dx(test::to_bf16(x)), dw(test::to_bf16(w));
  test::DeviceBuffer<float> out_f32(size_t(M) * N);
  test::DeviceBuffer<__nv_bfloat16> out_bf16(size_t(M) * N);
  gemm.linear(dx.get(), dw.get(), out_f32.get(), true, M, N, K, nullptr);
  gemm.linear(dx.get(), dw.get(), out_bf16.get(), false, M, N, K, nullptr);
  EXPECT_LT(test::relative_l2(out_f32.download(), want), kTolFp32Output);
  EXPECT_LT(test::relative_l2(test::from_bf16(out_bf16.download()), want), test::kTolBf16);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaGemm,
                         ::testing::Values(Shape{1, 8, 16}, Shape{3, 100, 72}, Shape{19, 384, 128},
                                           Shape{1, 6144, 8192}, Shape{19, 512, 6144}, Shape{64, 257, 136}),
                         [](const auto& info) {
                           return "M" + std::to_string(info.param.M) + "_N" + std::to_string(info.param.N) + "_K" +
                                  std::to_string(info.param.K);
                         });

}  // namespace
}  // namespace tpmoe
