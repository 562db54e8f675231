// CUDA norm kernels (src/backends/cuda/norm.cu) against the CPU oracle: add_rmsnorm against
// cpu::gemma_rmsnorm_row, head_norm_rope against cpu::CpuOps::head_norm_rope, on random inputs at
// awkward shapes (rows 1/3/19/64, widths that are not multiples of the vector width, odd rotary
// halves, positions up to ~5000). Outputs start poisoned with NaN (DeviceBuffer), so an element a
// kernel forgot to write fails relative_l2. head_norm_rope's store into the paged KV cache is
// checked bit for bit against its own in-place result (and attention over it in
// test_cuda_attention.cpp, CudaRotateAndAttend).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/norm.cuh"
#include "core/error.h"
#include "cuda_test_util.h"
#include "test_util.h"

namespace tpmoe {
namespace {

using test::DeviceBuffer;
using test::from_bf16;
using test::random_floats;
using test::relative_l2;
using test::round_bf16;
using test::to_bf16;

constexpr float kEps = 1e-6f;

// One head_norm_rope tensor of `tokens` x `heads` heads (x is set where the test knows it).
cuda::HeadNormRopeParams rope_params(const float* weight, const int32_t* positions, int tokens, int heads, int head_dim,
                                     int rotary_dim, float theta) {
  cuda::HeadNormRopeParams p;
  p.weight = weight;
  p.positions = positions;
  p.num_tokens = tokens;
  p.num_heads = heads;
  p.head_dim = head_dim;
  p.rotary_dim = rotary_dim;
  p.theta = theta;
  p.eps = kEps;
  return p;
}

struct NormCase {
  int rows;
  int hidden;
  bool with_partial;
};

// `offset` elements into every buffer: a non-zero offset misaligns the pointers and forces the
// scalar path even when hidden % 8 == 0.
void check_add_rmsnorm(const NormCase& c, int offset, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "rows=" << c.rows << " hidden=" << c.hidden << " partial=" << c.with_partial
                                  << " offset=" << offset);
  const size_t n = size_t(c.rows) * c.hidden;
  // The residual stream is fp32 on the device too: the oracle gets exactly these values.
  const std::vector<float> residual = random_floats(n, 1.0f, seed);
  // The partial sum arrives in bf16; the oracle gets the bf16-rounded values the kernel reads.
  const std::vector<float> partial = round_bf16(random_floats(n, 0.5f, seed + 1));
  const std::vector<float> weight = random_floats(size_t(c.hidden), 0.1f, seed + 2);

  std::vector<float> residual_dev_init(n + offset, 0.f), weight_dev_init(size_t(c.hidden) + offset, 0.f);
  std::copy(residual.begin(), residual.end(), residual_dev_init.begin() + offset);
  std::copy(weight.begin(), weight.end(), weight_dev_init.begin() + offset);
  std::vector<float> partial_dev_init(n + offset, 0.f);
  std::copy(partial.begin(), partial.end(), partial_dev_init.begin() + offset);

  DeviceBuffer<float> d_residual(residual_dev_init);
  DeviceBuffer<float> d_weight(weight_dev_init);
  DeviceBuffer<__nv_bfloat16> d_partial(to_bf16(partial_dev_init));
  DeviceBuffer<__nv_bfloat16> d_out(n + offset);  // poisoned

  cuda::AddRmsNormParams p;
  p.partial = c.with_partial ? d_partial.get() + offset : nullptr;
  p.residual = d_residual.get() + offset;
  p.weight = d_weight.get() + offset;
  p.out = d_out.get() + offset;
  p.rows = c.rows;
  p.hidden = c.hidden;
  p.eps = kEps;
  cuda::launch_add_rmsnorm(p, nullptr);

  // Oracle: residual' = residual + bf16-rounded partial, one fp32 add per element exactly as the
  // kernel does it, so the fp32 residual must match to kTolF32 (in fact bit for bit); then the
  // Gemma norm of each row of residual' in the CPU's own (double-accumulated) arithmetic.
  std::vector<float> ref_residual = residual;
  if (c.with_partial)
    for (size_t i = 0; i < n; ++i) ref_residual[i] += partial[i];
  std::vector<float> ref_out(n);
  for (int r = 0; r < c.rows; ++r)
    cpu::gemma_rmsnorm_row(&ref_residual[size_t(r) * c.hidden], weight.data(), c.hidden, kEps,
                           &ref_out[size_t(r) * c.hidden]);

  const std::vector<float> got_residual_all = d_residual.download();
  const std::vector<float> got_residual(got_residual_all.begin() + offset, got_residual_all.end());
  const std::vector<float> got_out_all = from_bf16(d_out.download());
  const std::vector<float> got_out(got_out_all.begin() + offset, got_out_all.end());
  EXPECT_LE(relative_l2(got_residual, ref_residual), test::kTolF32);
  EXPECT_LE(relative_l2(got_out, ref_out), test::kTolBf16);
}

TEST(CudaNorm, AddRmsNormMatchesCpu) {
  TPMOE_REQUIRE_GPU();
  uint64_t seed = 100;
  for (int rows : {1, 3, 19, 64})
    for (int hidden : {128, 6144, 100, 1000, 8})
      for (bool with_partial : {true, false}) check_add_rmsnorm({rows, hidden, with_partial}, 0, seed++);
}

TEST(CudaNorm, AddRmsNormScalarPathOnUnalignedPointers) {
  TPMOE_REQUIRE_GPU();
  uint64_t seed = 200;
  for (int rows : {1, 19})
    for (int hidden : {128, 6144})
      for (bool with_partial : {true, false}) check_add_rmsnorm({rows, hidden, with_partial}, 1, seed++);
}

TEST(CudaNorm, AddRmsNormLargeHidden) {
  TPMOE_REQUIRE_GPU();
  // Wider than one 1024-thread block covers in a single vector step: threads loop.
  check_add_rmsnorm({3, 12288, true}, 0, 300);
  check_add_rmsnorm({3, 12290, true}, 0, 301);  // the scalar path, 12 elements per thread
}

TEST(CudaNorm, ZeroRowsLaunchNothing) {
  TPMOE_REQUIRE_GPU();
  cuda::AddRmsNormParams p;  // every pointer null: nothing may be touched
  p.rows = 0;
  p.hidden = 128;
  EXPECT_NO_THROW(cuda::launch_add_rmsnorm(p, nullptr));
  cuda::HeadNormRopeParams q;
  q.num_tokens = 0;
  q.num_heads = 4;
  q.head_dim = 128;
  q.rotary_dim = 64;
  EXPECT_NO_THROW(cuda::launch_head_norm_rope(q, nullptr));
  CUDA_CHECK(cudaDeviceSynchronize());
}

struct RopeCase {
  int tokens;
  int heads;
  int head_dim;
  int rotary_dim;
  float theta;
};

void check_head_norm_rope(const RopeCase& c, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "tokens=" << c.tokens << " heads=" << c.heads << " head_dim=" << c.head_dim
                                  << " rotary_dim=" << c.rotary_dim << " theta=" << c.theta);
  const size_t n = size_t(c.tokens) * c.heads * c.head_dim;
  const std::vector<float> x = round_bf16(random_floats(n, 1.0f, seed));
  const std::vector<float> weight = random_floats(size_t(c.head_dim), 0.1f, seed + 1);
  // Positions up to ~5000 (angles up to 5000 rad at i = 0), including 0 and the largest.
  constexpr int kMaxPos = 5000;
  std::mt19937 rng(uint32_t(seed + 2));
  std::uniform_int_distribution<int32_t> pos_dist(0, kMaxPos - 1);
  std::vector<int32_t> positions(size_t(c.tokens));
  for (auto& pos : positions) pos = pos_dist(rng);
  positions[0] = c.tokens > 1 ? 0 : kMaxPos - 1;
  if (c.tokens > 2) positions[size_t(c.tokens) - 1] = kMaxPos - 1;

  DeviceBuffer<__nv_bfloat16> d_x(to_bf16(x));
  DeviceBuffer<float> d_weight(weight);
  DeviceBuffer<int32_t> d_pos(positions);
  cuda::HeadNormRopeParams p =
      rope_params(d_weight.get(), d_pos.get(), c.tokens, c.heads, c.head_dim, c.rotary_dim, c.theta);
  p.x = d_x.get();
  cuda::launch_head_norm_rope(p, nullptr);

  // Oracle: the CPU op on the same bf16-rounded input (fp32 throughout), at the same positions.
  cpu::CpuOps ops;
  CacheShape shape;
  shape.num_layers = 0;  // head_norm_rope touches no cache; only the step's positions are needed
  shape.max_seqs = 1;
  shape.max_len = kMaxPos;
  shape.num_pages = shape.pages_per_seq();
  ops.init_cache(shape);
  StepTokens step;
  step.token_ids.assign(size_t(c.tokens), 0);
  step.positions = positions;
  step.seq_slots.assign(size_t(c.tokens), 0);
  ops.begin_step(step);
  std::vector<float> ref = x;
  std::vector<float> w = weight;
  RopeParams rp;
  rp.head_dim = c.head_dim;
  rp.rotary_dim = c.rotary_dim;
  rp.theta = c.theta;
  rp.eps = kEps;
  const HeadNormRope item{Tensor::make(ref.data(), DType::kF32, c.tokens, int64_t(c.heads) * c.head_dim), c.heads,
                          Tensor::make(w.data(), DType::kF32, c.head_dim), rp};
  ops.head_norm_rope(std::span(&item, 1));

  const std::vector<float> got = from_bf16(d_x.download());
  EXPECT_LE(relative_l2(got, ref), test::kTolBf16);
  // Per head too: a head with wrong rotation would hide in the global norm of a big case.
  const int hd = c.head_dim;
  for (size_t h = 0; h < n / size_t(hd); ++h) {
    const std::span<const float> g(&got[h * hd], size_t(hd)), r(&ref[h * hd], size_t(hd));
    ASSERT_LE(relative_l2(g, r), 2 * test::kTolBf16) << "head row " << h;  // one head: fewer values average out
  }
}

TEST(CudaNorm, HeadNormRopeMatchesCpu) {
  TPMOE_REQUIRE_GPU();
  const RopeCase cases[] = {
      {1, 8, 128, 64, 5e6f},   // m3 decode, one token
      {3, 4, 32, 16, 5e6f},    // tiny preset
      {19, 5, 128, 64, 5e6f},  //
      {64, 2, 32, 16, 5e6f},   //
      {64, 3, 128, 64, 1e4f},  // a smaller theta: faster-turning high channels
      {7, 3, 64, 18, 1e4f},    // rotary half 9: pairs not a multiple of anything
      {3, 2, 256, 256, 1e4f},  // largest head, fully rotated
      {5, 2, 256, 0, 1e4f},    // no rotation: norm only
      {4, 3, 100, 36, 5e6f},   // head_dim not a multiple of 32
  };
  uint64_t seed = 1000;
  for (const auto& c : cases) check_head_norm_rope(c, seed += 10);
}

// A layer's q, k, index q and index k in one launch give bitwise what one launch each gives.
TEST(CudaNorm, HeadNormRopeBatchEqualsOneLaunchEach) {
  TPMOE_REQUIRE_GPU();
  const int T = 5;
  const RopeCase cases[] = {{T, 8, 128, 64, 5e6f}, {T, 1, 128, 64, 5e6f}, {T, 4, 64, 64, 5e6f}, {T, 1, 64, 64, 5e6f}};
  std::vector<int32_t> positions{0, 3, 17, 1000, 4999};
  DeviceBuffer<int32_t> d_pos(positions);
  std::vector<std::unique_ptr<DeviceBuffer<__nv_bfloat16>>> batched, single;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> weights;
  std::vector<cuda::HeadNormRopeParams> params;
  uint64_t seed = 77;
  for (const RopeCase& c : cases) {
    const auto x = to_bf16(random_floats(size_t(T) * c.heads * c.head_dim, 1.f, seed++));
    batched.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(x));
    single.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(x));
    weights.push_back(std::make_unique<DeviceBuffer<float>>(random_floats(size_t(c.head_dim), 0.1f, seed++)));
    params.push_back(rope_params(weights.back()->get(), d_pos.get(), T, c.heads, c.head_dim, c.rotary_dim, c.theta));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].x = batched[i]->get();
  }
  cuda::launch_head_norm_rope_batch(params.data(), int(params.size()), nullptr);
  for (size_t i = 0; i < params.size(); ++i) {
    cuda::HeadNormRopeParams p = params[i];
    p.x = single[i]->get();
    cuda::launch_head_norm_rope(p, nullptr);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const auto a = batched[i]->download(), b = single[i]->download();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])), 0) << "tensor " << i;
  }
}

// The cache store (CudaOps::rotate_and_attend's launch): the items that store write each normed,
// rotated head into its token's paged cache row too, and a copy item (v) lands there unchanged. x
// must come out bitwise as without the store, every stored row must hold exactly x's (or v's) bits,
// and nothing else of the cache may be touched (it starts poisoned, 0xFFFF per element). Tokens sit
// in several slots at scattered positions of a shuffled page table (4 positions a page), so a row
// computed without the table, or from the wrong token, lands somewhere else.
TEST(CudaNorm, HeadNormRopeStoresIntoThePagedCache) {
  TPMOE_REQUIRE_GPU();
  struct StoreCase {
    int tokens, heads, kv_heads, head_dim, rotary_dim, index_head_dim;
  };
  constexpr int kPageShift = 2, kPageSize = 1 << kPageShift, kSlots = 5, kMaxLen = 64;
  constexpr int kPagesPerSeq = kMaxLen / kPageSize, kPoolRows = kSlots * kMaxLen;
  const StoreCase cases[] = {
      {1, 8, 2, 128, 64, 128},  // decode, m3-like
      {19, 4, 1, 32, 16, 64},   //
      {3, 2, 2, 256, 256, 32},  // the largest head: 32 vectors of 8, one per lane
      {7, 3, 3, 64, 18, 100},   // rotary half 9; an index head of 100 (scalar store, no copy)
  };
  uint64_t seed = 500;
  for (const StoreCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "tokens=" << c.tokens << " kv_heads=" << c.kv_heads << " head_dim=" << c.head_dim
                                    << " rotary_dim=" << c.rotary_dim << " index_head_dim=" << c.index_head_dim);
    const int T = c.tokens, kv_row = c.kv_heads * c.head_dim;
    std::mt19937 rng{uint32_t(seed)};
    // Distinct (slot, position) per token, positions anywhere below kMaxLen.
    std::vector<int32_t> slots(static_cast<size_t>(T)), positions(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) {
      slots[t] = int32_t((t * 3 + 1) % kSlots);
      positions[t] = int32_t((t * 13 + 5) % kMaxLen);
    }
    std::vector<int32_t> table(size_t(kSlots) * kPagesPerSeq);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);

    // q, k, index q, index k: the shapes of a layer; k stores and carries v, index k stores.
    struct Item {
      int heads, head_dim;
      bool store;
    };
    const Item layout[] = {{c.heads, c.head_dim, false},
                           {c.kv_heads, c.head_dim, true},
                           {c.kv_heads, c.index_head_dim, false},
                           {1, c.index_head_dim, true}};
    DeviceBuffer<int32_t> d_pos(positions), d_slots(slots), d_table(table);
    std::vector<std::unique_ptr<DeviceBuffer<__nv_bfloat16>>> plain, stored, caches;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> weights;
    std::vector<cuda::HeadNormRopeParams> params;
    for (const Item& it : layout) {
      const auto x = to_bf16(random_floats(size_t(T) * it.heads * it.head_dim, 1.f, seed++));
      plain.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(x));
      stored.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(x));
      caches.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(size_t(kPoolRows) * it.heads * it.head_dim));
      weights.push_back(std::make_unique<DeviceBuffer<float>>(random_floats(size_t(it.head_dim), 0.1f, seed++)));
      params.push_back(rope_params(weights.back()->get(), d_pos.get(), T, it.heads, it.head_dim,
                                   std::min(c.rotary_dim, it.head_dim), 5e6f));
    }
    const std::vector<__nv_bfloat16> v = to_bf16(random_floats(size_t(T) * kv_row, 1.f, seed++));
    DeviceBuffer<__nv_bfloat16> d_v(v), d_v_cache(size_t(kPoolRows) * kv_row);

    std::vector<cuda::HeadNormRopeParams> with_store = params;
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].x = plain[i]->get();
      with_store[i].x = stored[i]->get();
      if (layout[i].store) with_store[i].cache = caches[i]->get();
    }
    with_store[1].copy = d_v.get();
    with_store[1].copy_cache = d_v_cache.get();
    cuda::CacheRowStore store;
    store.pages = {d_table.get(), kPageShift, kPagesPerSeq};
    store.seq_slots = d_slots.get();
    cuda::launch_head_norm_rope_batch(params.data(), int(params.size()), nullptr);
    cuda::launch_head_norm_rope_batch(with_store.data(), int(with_store.size()), nullptr, store);

    // Expected caches: poison, with token t's row of x (after the kernel) or v at its pool row.
    auto bits = [](const std::vector<__nv_bfloat16>& a) {
      std::vector<uint16_t> out(a.size());
      std::memcpy(out.data(), a.data(), a.size() * sizeof(uint16_t));
      return out;
    };
    auto expect_cache = [&](const std::vector<uint16_t>& rows, int row_elems, const std::vector<uint16_t>& got,
                            const char* what) {
      std::vector<uint16_t> want(size_t(kPoolRows) * row_elems, 0xFFFF);
      for (int t = 0; t < T; ++t) {
        const int32_t page = table[size_t(slots[t]) * kPagesPerSeq + positions[t] / kPageSize];
        const size_t pool_row = size_t(page) * kPageSize + size_t(positions[t] % kPageSize);
        std::copy_n(rows.begin() + size_t(t) * row_elems, row_elems, want.begin() + pool_row * row_elems);
      }
      size_t mismatches = 0;
      for (size_t i = 0; i < want.size(); ++i) mismatches += got[i] != want[i];
      EXPECT_EQ(mismatches, 0u) << what << ": cache elements differing from the expected rows (or poison)";
    };
    for (size_t i = 0; i < params.size(); ++i) {
      const auto a = bits(stored[i]->download()), b = bits(plain[i]->download());
      EXPECT_EQ(a, b) << "tensor " << i << ": the store changed the in-place result";
      const auto cache = bits(caches[i]->download());
      if (layout[i].store)
        expect_cache(a, layout[i].heads * layout[i].head_dim, cache, i == 1 ? "k" : "index k");
      else
        EXPECT_EQ(cache, std::vector<uint16_t>(cache.size(), 0xFFFF)) << "tensor " << i << " stored without a cache";
    }
    expect_cache(bits(v), kv_row, bits(d_v_cache.download()), "v");
    EXPECT_EQ(bits(d_v.download()), bits(v)) << "v itself must not change";
  }
}

TEST(CudaNorm, HeadNormRopeCacheStoreRejectsBadArguments) {
  TPMOE_REQUIRE_GPU();
  constexpr int hd = 64;
  DeviceBuffer<__nv_bfloat16> d_x{size_t(hd)}, d_cache{size_t(4 * hd)}, d_v{size_t(hd + 8)},
      d_v_cache{size_t(4 * hd + 8)};
  DeviceBuffer<float> d_w{size_t(hd)};
  DeviceBuffer<int32_t> d_pos(std::vector<int32_t>{1}), d_slots(std::vector<int32_t>{0}),
      d_table(std::vector<int32_t>{0});
  cuda::HeadNormRopeParams p = rope_params(d_w.get(), d_pos.get(), 1, 1, hd, 32, 1e4f);
  p.x = d_x.get();
  p.cache = d_cache.get();
  cuda::CacheRowStore store;
  store.pages = {d_table.get(), 2, 1};
  store.seq_slots = d_slots.get();
  auto expect_error = [&](const cuda::HeadNormRopeParams& q, const cuda::CacheRowStore& s, const char* message) {
    try {
      cuda::launch_head_norm_rope_batch(&q, 1, nullptr, s);
      ADD_FAILURE() << "accepted; expected: " << message;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  expect_error(p, {}, "needs the launch's CacheRowStore");  // a store without a page table
  cuda::HeadNormRopeParams q = p;
  q.copy = d_v.get();  // without copy_cache
  expect_error(q, store, "copy and copy_cache must be set together");
  q.copy = d_v.get() + 1;  // 2 bytes off: not 16-byte aligned
  q.copy_cache = d_v_cache.get();
  expect_error(q, store, "16-byte aligned");
  q.copy = d_v.get();
  q.copy_cache = d_v_cache.get() + 4;  // 8 bytes off
  expect_error(q, store, "16-byte aligned");
  q.copy_cache = d_v_cache.get();
  q.head_dim = 60;  // not a multiple of 8
  q.rotary_dim = 30;
  expect_error(q, store, "head_dim a multiple of 8");
  EXPECT_NO_THROW(cuda::launch_head_norm_rope_batch(&p, 1, nullptr, store));  // the well-formed store
  CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(CudaNorm, HeadNormRopeRejectsUnsupportedShapes) {
  TPMOE_REQUIRE_GPU();
  DeviceBuffer<__nv_bfloat16> d_x(size_t(512));
  DeviceBuffer<float> d_w(size_t(512));
  DeviceBuffer<int32_t> d_pos(std::vector<int32_t>{0});
  // head_dim 512: above the 256 the kernel holds in registers.
  cuda::HeadNormRopeParams p = rope_params(d_w.get(), d_pos.get(), 1, 1, 512, 64, 1e4f);
  p.x = d_x.get();
  EXPECT_THROW(cuda::launch_head_norm_rope(p, nullptr), Error);
  p.head_dim = 128;
  p.rotary_dim = 63;  // odd
  EXPECT_THROW(cuda::launch_head_norm_rope(p, nullptr), Error);
}

}  // namespace
}  // namespace tpmoe
