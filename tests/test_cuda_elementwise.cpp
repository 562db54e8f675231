// CUDA elementwise kernels (src/backends/cuda/elementwise.cu) against the CPU oracle: embed and
// argmax against cpu::CpuOps, swiglu against cpu::swiglu_oai, add/gather against their one-line
// definitions, fill_random bit for bit against tpmoe::random_value. Awkward shapes (rows 1/3/19/64,
// widths not a multiple of the vector width, unaligned pointers for the scalar paths); outputs start
// poisoned with NaN (DeviceBuffer), so an element a kernel forgot to write fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/elementwise.cuh"
#include "core/error.h"
#include "cuda_test_util.h"
#include "model/presets.h"
#include "test_util.h"

namespace tpmoe {
namespace {

using test::DeviceBuffer;
using test::from_bf16;
using test::random_floats;
using test::relative_l2;
using test::round_bf16;
using test::to_bf16;

std::vector<uint16_t> bits_of(const std::vector<__nv_bfloat16>& v) {
  std::vector<uint16_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * 2);
  return out;
}

// Index of the first element where a and b differ (-1: equal). Bitwise comparisons go through this
// so that a failure names one element instead of printing vectors of 10^5 values.
template <class T>
int64_t first_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return int64_t(i);
  return -1;
}

// ---- embed ---------------------------------------------------------------------------------------

TEST(CudaElementwise, EmbedMatchesCpu) {
  TPMOE_REQUIRE_GPU();
  uint64_t seed = 10;
  for (int vocab : {512, 1001})
    for (int hidden : {128, 100, 6144})
      for (int tokens : {1, 3, 19, 64}) {
        SCOPED_TRACE(testing::Message() << "vocab=" << vocab << " hidden=" << hidden << " tokens=" << tokens);
        const std::vector<float> table = round_bf16(random_floats(size_t(vocab) * hidden, 1.0f, seed++));
        std::mt19937 rng(uint32_t(seed++));
        std::uniform_int_distribution<int32_t> id_dist(0, vocab - 1);
        StepTokens step;
        for (int t = 0; t < tokens; ++t) step.token_ids.push_back(id_dist(rng));
        step.token_ids[0] = vocab - 1;  // the last row of the table
        if (tokens > 1) step.token_ids[1] = 0;
        step.positions.assign(size_t(tokens), 0);
        step.seq_slots.assign(size_t(tokens), 0);

        DeviceBuffer<__nv_bfloat16> d_table(to_bf16(table));
        DeviceBuffer<int32_t> d_ids(step.token_ids);
        DeviceBuffer<float> d_out(size_t(tokens) * hidden);
        cuda::EmbedParams p;
        p.table = d_table.get();
        p.token_ids = d_ids.get();
        p.out = d_out.get();
        p.num_tokens = tokens;
        p.hidden = hidden;
        p.vocab = vocab;
        cuda::launch_embed(p, nullptr);

        cpu::CpuOps ops;
        CacheShape shape;
        shape.max_seqs = 1;
        shape.max_len = 1;
        shape.num_pages = 1;
        ops.init_cache(shape);
        ops.begin_step(step);
        std::vector<float> ref(size_t(tokens) * hidden);
        std::vector<float> table_copy = table;
        ops.embed(Tensor::make(table_copy.data(), DType::kF32, vocab, hidden),
                  Tensor::make(ref.data(), DType::kF32, tokens, hidden));
        // Widening bf16 to fp32 is exact: the rows must be equal, not just close.
        EXPECT_EQ(first_mismatch(d_out.download(), ref), -1);
      }
}

TEST(CudaElementwise, EmbedBadIdWritesNanRowAndReadsNothingOutside) {
  TPMOE_REQUIRE_GPU();
  for (int hidden : {128, 100}) {
    const int vocab = 16;
    const std::vector<float> table = round_bf16(random_floats(size_t(vocab) * hidden, 1.0f, 77));
    const std::vector<int32_t> ids = {3, -1, vocab, 15};
    DeviceBuffer<__nv_bfloat16> d_table(to_bf16(table));
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> d_out(ids.size() * hidden);
    CUDA_CHECK(cudaMemset(d_out.get(), 0, ids.size() * hidden * sizeof(float)));  // NaN must come from the kernel
    cuda::EmbedParams p{d_table.get(), d_ids.get(), d_out.get(), int(ids.size()), hidden, vocab};
    cuda::launch_embed(p, nullptr);
    const std::vector<float> got = d_out.download();
    for (int c = 0; c < hidden; ++c) {
      EXPECT_EQ(got[0 * hidden + c], table[3 * hidden + c]);
      EXPECT_TRUE(std::isnan(got[1 * hidden + c]));
      EXPECT_TRUE(std::isnan(got[2 * hidden + c]));
      EXPECT_EQ(got[3 * hidden + c], table[15 * hidden + c]);
    }
  }
}

// ---- add_bf16 ------------------------------------------------------------------------------------

// `offset` > 0 misaligns both pointers: the scalar path.
void check_add_bf16(int64_t n, int offset, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "n=" << n << " offset=" << offset);
  const std::vector<float> x = round_bf16(random_floats(size_t(n + offset), 1.0f, seed));
  const std::vector<float> y = round_bf16(random_floats(size_t(n + offset), 1.0f, seed + 1));
  DeviceBuffer<__nv_bfloat16> d_x(to_bf16(x)), d_y(to_bf16(y));
  cuda::launch_add_bf16(d_x.get() + offset, d_y.get() + offset, n, nullptr);
  // One fp32 add of two bf16 values, one rounding: the result is determined bit for bit.
  std::vector<float> ref = y;
  for (int64_t i = offset; i < n + offset; ++i) ref[size_t(i)] = y[size_t(i)] + x[size_t(i)];
  EXPECT_EQ(first_mismatch(bits_of(d_y.download()), bits_of(to_bf16(ref))), -1);
}

TEST(CudaElementwise, AddBf16IsExact) {
  TPMOE_REQUIRE_GPU();
  uint64_t seed = 20;
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(8), int64_t(1000), int64_t(19 * 6144), int64_t(100003)})
    for (int offset : {0, 1}) check_add_bf16(n, offset, seed += 2);
}

// ---- swiglu --------------------------------------------------------------------------------------

TEST(CudaElementwise, SwigluMatchesCpu) {
  TPMOE_REQUIRE_GPU();
  SwigluParams sp;  // alpha 1.702, limit 7
  uint64_t seed = 30;
  for (int rows : {1, 3, 19, 64})
    for (int n : {128, 100, 1000, 3072}) {
      SCOPED_TRACE(testing::Message() << "rows=" << rows << " n=" << n);
      // std 4: a good share of gates and ups lie beyond +-7, so both clamps are exercised.
      std::vector<float> gu = round_bf16(random_floats(size_t(rows) * 2 * n, 4.0f, seed++));
      gu[0] = 50.f;                 // gate far above the limit
      gu[size_t(n)] = -50.f;        // up far below -limit
      gu[size_t(2 * n) - 1] = 9.f;  // up above the limit
      DeviceBuffer<__nv_bfloat16> d_gu(to_bf16(gu));
      DeviceBuffer<__nv_bfloat16> d_out(size_t(rows) * n);
      cuda::SwigluKernelParams p;
      p.gate_up = d_gu.get();
      p.out = d_out.get();
      p.rows = rows;
      p.n = n;
      p.alpha = sp.alpha;
      p.limit = sp.limit;
      cuda::launch_swiglu(p, nullptr);

      std::vector<float> ref(size_t(rows) * n);
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < n; ++i)
          ref[size_t(r) * n + i] = cpu::swiglu_oai(gu[size_t(r) * 2 * n + i], gu[size_t(r) * 2 * n + n + i], sp);
      EXPECT_LE(relative_l2(from_bf16(d_out.download()), ref), test::kTolBf16);
    }
}

// ---- gather_rows ---------------------------------------------------------------------------------

TEST(CudaElementwise, GatherRowsCopiesExactly) {
  TPMOE_REQUIRE_GPU();
  uint64_t seed = 40;
  for (int cols : {128, 100, 6144})
    for (int offset : {0, 1}) {
      SCOPED_TRACE(testing::Message() << "cols=" << cols << " offset=" << offset);
      const int src_rows = 23;
      const std::vector<float> x = round_bf16(random_floats(size_t(src_rows) * cols + offset, 1.0f, seed++));
      const std::vector<int32_t> rows = {22, 0, 5, 5, 17, 0, 1, 22, 9, 3, 11, 12, 13, 14, 15, 16, 2, 4, 6};  // 19
      DeviceBuffer<__nv_bfloat16> d_x(to_bf16(x));
      DeviceBuffer<int32_t> d_rows(rows);
      DeviceBuffer<__nv_bfloat16> d_out(rows.size() * cols + offset);
      cuda::launch_gather_rows(d_x.get() + offset, d_rows.get(), int(rows.size()), cols, d_out.get() + offset, nullptr);
      const std::vector<uint16_t> got = bits_of(d_out.download());
      const std::vector<uint16_t> src = bits_of(to_bf16(x));
      for (size_t r = 0; r < rows.size(); ++r)
        for (int c = 0; c < cols; ++c)
          ASSERT_EQ(got[offset + r * cols + c], src[offset + size_t(rows[r]) * cols + c])
              << "row " << r << " col " << c;
    }
}

// ---- split_columns -------------------------------------------------------------------------------

// A [rows, sum cols_i] matrix's column runs into their outputs, bit for bit: bf16 and fp32, widths that
// take 16-byte copies (a layer's projections) and widths or offsets that do not (the element path),
// rows past one grid's worth.
template <class T>
void check_split_columns(const std::vector<int>& cols, int rows, int offset, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "elem " << sizeof(T) << " bytes, rows " << rows << ", offset " << offset);
  int total = 0;
  for (int c : cols) total += c;
  std::vector<T> in(size_t(rows) * total + offset);
  std::mt19937 rng{uint32_t(seed)};
  for (T& x : in) x = T(rng());  // raw bits, copied as they are
  DeviceBuffer<T> d_in(in);
  std::vector<std::unique_ptr<DeviceBuffer<T>>> d_out;
  cuda::SplitColumnsParams p;
  p.in = d_in.get() + offset;
  p.rows = rows;
  p.elem_bytes = int(sizeof(T));
  for (int c : cols) {
    d_out.push_back(std::make_unique<DeviceBuffer<T>>(size_t(rows) * c + offset));
    p.out[p.count] = d_out.back()->get() + offset;
    p.cols[p.count++] = c;
  }
  cuda::launch_split_columns(p, nullptr);
  int start = 0;
  for (size_t i = 0; i < cols.size(); ++i) {
    const std::vector<T> got = d_out[i]->download();
    std::vector<T> want(got.begin(), got.begin() + offset);  // the offset's elements: not written
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols[i]; ++c) want.push_back(in[offset + size_t(r) * total + start + c]);
    EXPECT_EQ(first_mismatch(got, want), -1) << "output " << i;
    start += cols[i];
  }
}

TEST(CudaElementwise, SplitColumnsCopiesExactly) {
  TPMOE_REQUIRE_GPU();
  // uint16_t / uint32_t stand for bf16 / fp32 bits: the kernel copies bytes.
  check_split_columns<uint16_t>({1024, 128, 128, 128, 128}, 64, 0, 1);  // a tp-8 rank's q, k, v, index q, index k
  check_split_columns<uint16_t>({1024, 128, 128, 128, 128}, 3, 1, 2);   // unaligned: the element path
  check_split_columns<uint16_t>({96, 20, 36}, 19, 0, 3);                // 40 bytes a row: the element path
  check_split_columns<uint16_t>({64, 32, 32, 64, 32}, 80000, 1, 4);     // more elements than one grid's threads
  check_split_columns<uint32_t>({128, 256}, 17, 0, 5);                  // fp32 outputs (a router's logits)
  check_split_columns<uint32_t>({3, 5, 7, 1, 2, 9, 4, 6}, 5, 0, 6);     // eight outputs, the element path
}

TEST(CudaElementwise, SplitColumnsRefusesBadArguments) {
  TPMOE_REQUIRE_GPU();
  DeviceBuffer<uint16_t> buf(64);
  cuda::SplitColumnsParams p;
  p.in = buf.get();
  p.rows = 1;
  EXPECT_THROW(cuda::launch_split_columns(p, nullptr), Error) << "no outputs";
  p.out[0] = buf.get();
  p.cols[0] = 8;
  p.count = 1;
  p.elem_bytes = 3;
  EXPECT_THROW(cuda::launch_split_columns(p, nullptr), Error) << "3-byte elements";
  p.elem_bytes = 2;
  p.count = 2;  // out[1] unset
  EXPECT_THROW(cuda::launch_split_columns(p, nullptr), Error) << "an unset output";
}

// ---- argmax --------------------------------------------------------------------------------------

void check_argmax(int vocab, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "vocab=" << vocab);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::vector<std::vector<float>> rows;
  auto random_row = [&](float stddev) { return random_floats(size_t(vocab), stddev, seed++); };
  rows.push_back(random_row(3.f));  // plain random
  {
    auto r = random_row(1.f);  // the maximum at index 0
    r[0] = 100.f;
    rows.push_back(r);
  }
  {
    auto r = random_row(1.f);  // the maximum at the last index
    r[size_t(vocab) - 1] = 100.f;
    rows.push_back(r);
  }
  const int tie_first = std::min(17, vocab / 3);
  {
    auto r = random_row(1.f);  // exact ties: the first one wins
    for (int i : {vocab - 1, vocab / 2 + 1, vocab / 3, 17}) r[size_t(i)] = 50.f;
    rows.push_back(r);
  }
  {
    auto r = random_row(1.f);  // tie between the last index and index 0
    r[size_t(vocab) - 1] = 50.f;
    r[0] = 50.f;
    rows.push_back(r);
  }
  rows.push_back(std::vector<float>(size_t(vocab), 0.25f));  // all equal: index 0
  rows.push_back(std::vector<float>(size_t(vocab), -kInf));  // all -inf: index 0
  {
    std::vector<float> r(size_t(vocab), -kInf);  // one finite value among -inf
    r[size_t(vocab) - 2] = -1e30f;
    rows.push_back(r);
  }
  {
    auto r = random_row(1.f);  // ties in the last lanes' chunks and a +inf
    r[size_t(vocab) - 3] = kInf;
    r[size_t(vocab) - 1] = kInf;
    rows.push_back(r);
  }
  for (int i = 0; i < 10; ++i) rows.push_back(random_row(1.f));  // 19 rows in all

  const int R = int(rows.size());
  std::vector<float> logits;
  for (const auto& r : rows) logits.insert(logits.end(), r.begin(), r.end());
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(R));
  CUDA_CHECK(cudaMemset(d_ids.get(), 0x7f, size_t(R) * sizeof(int32_t)));  // no valid id
  DeviceBuffer<uint8_t> workspace(cuda::argmax_workspace_bytes(R, vocab));
  cuda::launch_argmax(d_logits.get(), R, vocab, d_ids.get(), nullptr, workspace.get(), workspace.size(), nullptr);

  cpu::CpuOps ops;
  std::vector<int32_t> ref(static_cast<size_t>(R));
  ops.argmax(Tensor::make(logits.data(), DType::kF32, R, vocab), Tensor::make(ref.data(), DType::kI32, R), Tensor());
  const std::vector<int32_t> got = d_ids.download();
  EXPECT_EQ(got, ref);
  // The constructed rows, spelled out (the oracle is std::max_element: the first maximum).
  EXPECT_EQ(got[1], 0);
  EXPECT_EQ(got[2], vocab - 1);
  EXPECT_EQ(got[3], tie_first);
  EXPECT_EQ(got[4], 0);
  EXPECT_EQ(got[5], 0);
  EXPECT_EQ(got[6], 0);
  EXPECT_EQ(got[7], vocab - 2);
  EXPECT_EQ(got[8], vocab - 3);
}

TEST(CudaElementwise, ArgmaxFirstMaximum) {
  TPMOE_REQUIRE_GPU();
  check_argmax(200064, 50);  // the real vocabulary (float4 path)
  check_argmax(512, 60);     // the tiny preset
  check_argmax(1001, 70);    // not a multiple of 4: the scalar path
  check_argmax(9001, 90);    // three first-pass chunks on the scalar path
  check_argmax(40, 80);      // fewer elements than threads
}

// ---- fill_random ---------------------------------------------------------------------------------

TEST(CudaElementwise, FillRandomIsBitwiseThePresetsValues) {
  TPMOE_REQUIRE_GPU();
  const uint64_t seed = 1234;
  const uint64_t key = tensor_key("model.layers.3.mlp.experts.gate_up_proj");
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(100003)})
    for (uint64_t offset : {uint64_t(0), uint64_t(12345), (uint64_t(1) << 40) + 3})
      for (float stddev : {0.02f, 1.0f}) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " offset=" << offset << " stddev=" << stddev);
        std::vector<float> ref(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) ref[size_t(i)] = random_value(seed, key, offset + uint64_t(i), stddev);

        cuda::FillRandomParams p;
        p.cols = p.out_row_stride = p.index_row_stride = n;
        p.seed = seed;
        p.key = key;
        p.index_offset = offset;
        p.stddev = stddev;
        DeviceBuffer<__nv_bfloat16> d_bf16(static_cast<size_t>(n));
        p.out = d_bf16.get();
        cuda::launch_fill_random(p, nullptr);
        // to_bf16 rounds as f32_to_bf16 does
        EXPECT_EQ(first_mismatch(bits_of(d_bf16.download()), bits_of(to_bf16(ref))), -1);

        DeviceBuffer<float> d_f32(static_cast<size_t>(n));
        p.out = d_f32.get();
        p.out_f32 = true;
        cuda::launch_fill_random(p, nullptr);
        EXPECT_EQ(first_mismatch(d_f32.download(), ref), -1);
      }
}

TEST(CudaElementwise, FillRandomBlockIsTheBlockOfTheWholeTensor) {
  TPMOE_REQUIRE_GPU();
  // A 5 x 7 block at (3, 11) of a [40, 29] canonical tensor, written into rows 9 wide (a column
  // slice next to others): every element is the whole tensor's element at the same place.
  const uint64_t seed = 7, key = tensor_key("model.layers.0.self_attn.o_proj.weight");
  const int64_t K = 29, r0 = 3, c0 = 11, rows = 5, cols = 7, stride = 9;
  cuda::FillRandomParams p;
  p.rows = rows;
  p.cols = cols;
  p.out_row_stride = stride;
  p.seed = seed;
  p.key = key;
  p.index_offset = uint64_t(r0 * K + c0);
  p.index_row_stride = K;
  p.stddev = 0.02f;
  p.out_f32 = true;
  DeviceBuffer<float> d(static_cast<size_t>(rows * stride));
  p.out = d.get();
  cuda::launch_fill_random(p, nullptr);
  const std::vector<float> got = d.download();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      EXPECT_EQ(got[size_t(r * stride + c)], random_value(seed, key, uint64_t((r0 + r) * K + c0 + c), 0.02f));
    for (int64_t c = cols; c < stride; ++c)
      EXPECT_TRUE(std::isnan(got[size_t(r * stride + c)])) << "written past the block";
  }
}

// ---- empty launches ------------------------------------------------------------------------------

TEST(CudaElementwise, EmptyLaunchesDoNothing) {
  TPMOE_REQUIRE_GPU();
  // Null pointers everywhere: a zero-sized launch must return before touching anything.
  EXPECT_NO_THROW(cuda::launch_embed(cuda::EmbedParams{}, nullptr));
  EXPECT_NO_THROW(cuda::launch_add_bf16(nullptr, nullptr, 0, nullptr));
  EXPECT_NO_THROW(cuda::launch_swiglu(cuda::SwigluKernelParams{}, nullptr));
  EXPECT_NO_THROW(cuda::launch_gather_rows(nullptr, nullptr, 0, 128, nullptr, nullptr));
  EXPECT_NO_THROW(cuda::launch_argmax(nullptr, 0, 512, nullptr, nullptr, nullptr, 0, nullptr));
  EXPECT_NO_THROW(cuda::launch_fill_random(cuda::FillRandomParams{}, nullptr));
  CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace tpmoe
