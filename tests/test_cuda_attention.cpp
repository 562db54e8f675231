// CUDA attention (src/backends/cuda/attention.cu) against the CPU oracle (CpuOps::attention) on
// fresh random inputs: full and sparse layers, prefill (several sequences of different lengths in
// one step) and decode (1, 3, 19 tokens, each in its own slot at its own position, over a cache
// prefilled through both backends), GQA ratios 1, 2, 8, 16, 20, head_dim 32/64/128/256, index block
// sizes 8 and 64, topk 2 and 16, local 1 and 2. Every step also checks the cache rows exactly and,
// on sparse layers, the kept-block sets against cpu::select_blocks. The cache is paged (16
// positions a page) with a shuffled page table, so a kernel that ignored the table (or read a
// slot's positions as contiguous) would read other sequences' keys.
//
// Block selection is discrete: a near-tie in block scores could keep a different block on the GPU
// (fp32 sums in another order) than in the oracle, and a different kept set changes the output by
// far more than the tolerance. So the index q/k inputs are multiples of 0.25 in [-1, 1]: every
// product is a multiple of 1/16 and every sum of up to 256 of them is exact in fp32, whatever the
// order. Scores are then bit-identical on both sides, ties are exact, and the tie rule (lower block
// index wins) is exercised for real.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/attention.cuh"
#include "core/error.h"
#include "cuda_test_util.h"
#include "model/ops.h"
#include "test_util.h"

namespace tpmoe::test {
namespace {

using bf16 = __nv_bfloat16;

struct AttnCase {
  const char* name;
  int nq, nkv, hd;
  bool sparse;
  int ihd, bs, topk, local;  // indexer (sparse only)
  int max_len;
  int decode_ctx;  // longest context prefilled before the decode steps
};

std::ostream& operator<<(std::ostream& os, const AttnCase& c) { return os << c.name; }

// Multiples of 0.25 in [-1, 1]: exactly representable, exact dot products (see the file comment).
std::vector<float> exact_index_values(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(-4, 4);
  std::vector<float> v(n);
  for (auto& x : v) x = 0.25f * float(dist(rng));
  return v;
}

constexpr int kPageShift = 4;  // 16 positions a page

CacheShape paged_shape(const AttnCase& c, int max_seqs) {
  CacheShape shape;
  shape.num_layers = 1;
  shape.sparse_layer = {c.sparse};
  shape.num_kv_heads = c.nkv;
  shape.head_dim = c.hd;
  shape.index_head_dim = c.sparse ? c.ihd : 0;
  shape.max_seqs = max_seqs;
  shape.max_len = c.max_len;
  shape.page_size = 1 << kPageShift;
  shape.num_pages = max_seqs * shape.pages_per_seq();
  return shape;
}

// Every page of the pool handed to some (slot, page) in shuffled order.
std::vector<int32_t> shuffled_page_table(const CacheShape& shape, uint64_t seed) {
  std::vector<int32_t> table(size_t(shape.num_pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937_64(seed));
  return table;
}

// Both backends with one cache layer each; step() runs one step through both and checks it.
class Harness {
 public:
  Harness(const AttnCase& c, int max_seqs)
      : c_(c),
        max_seqs_(max_seqs),
        shape_(paged_shape(c, max_seqs)),
        page_table_(shuffled_page_table(shape_, 77)),
        kv_elems_(size_t(shape_.num_pages) * shape_.page_size * c.nkv * c.hd),
        ik_elems_(c.sparse ? size_t(shape_.num_pages) * shape_.page_size * c.ihd : 0),
        k_cache_(kv_elems_),
        v_cache_(kv_elems_),
        ik_cache_(std::max<size_t>(ik_elems_, 1)),
        page_table_device_(page_table_),
        k_mirror_(kv_elems_, 0.f),
        v_mirror_(kv_elems_, 0.f),
        ik_mirror_(ik_elems_, 0.f),
        written_(size_t(shape_.num_pages) * shape_.page_size, 0) {
    cpu_.init_cache(shape_);
  }

  void step(const std::vector<int32_t>& slots, const std::vector<int32_t>& positions, uint64_t seed,
            const std::string& what) {
    SCOPED_TRACE(what);
    const int T = int(slots.size());
    const int nq = c_.nq, nkv = c_.nkv, hd = c_.hd, ihd = c_.ihd, L = c_.max_len;
    const int nih = c_.sparse ? nkv : 0;
    StepTokens st;
    st.token_ids.assign(size_t(T), 0);
    st.positions = positions;
    st.seq_slots = slots;
    st.page_table = page_table_;

    // The oracle gets exactly the bf16 values the GPU gets.
    std::vector<float> q = round_bf16(random_floats(size_t(T) * nq * hd, 1.f, seed));
    std::vector<float> k = round_bf16(random_floats(size_t(T) * nkv * hd, 1.f, seed + 1));
    std::vector<float> v = round_bf16(random_floats(size_t(T) * nkv * hd, 1.f, seed + 2));
    std::vector<float> iq = c_.sparse ? exact_index_values(size_t(T) * nih * ihd, seed + 3) : std::vector<float>{};
    std::vector<float> ik = c_.sparse ? exact_index_values(size_t(T) * ihd, seed + 4) : std::vector<float>{};

    AttentionParams ap;
    ap.layer = 0;
    ap.num_q_heads = nq;
    ap.num_kv_heads = nkv;
    ap.head_dim = hd;
    ap.scale = 1.f / std::sqrt(float(hd));
    ap.num_index_heads = nih;
    ap.index_head_dim = c_.sparse ? ihd : 0;
    ap.block_size = c_.bs;
    ap.topk_blocks = c_.topk;
    ap.local_blocks = c_.local;

    // CPU oracle.
    std::vector<float> out_cpu(size_t(T) * nq * hd, 0.f);
    cpu_.begin_step(st);
    Tensor tiq{}, tik{};
    if (c_.sparse) {
      tiq = Tensor::make(iq.data(), DType::kF32, T, int64_t(nih) * ihd);
      tik = Tensor::make(ik.data(), DType::kF32, T, ihd);
    }
    cpu_.attention(Tensor::make(q.data(), DType::kF32, T, int64_t(nq) * hd),
                   Tensor::make(k.data(), DType::kF32, T, int64_t(nkv) * hd),
                   Tensor::make(v.data(), DType::kF32, T, int64_t(nkv) * hd), tiq, tik, ap,
                   Tensor::make(out_cpu.data(), DType::kF32, T, int64_t(nq) * hd));

    // GPU.
    DeviceBuffer<bf16> dq(to_bf16(q)), dk(to_bf16(k)), dv(to_bf16(v));
    DeviceBuffer<bf16> diq(c_.sparse ? to_bf16(iq) : std::vector<bf16>(1)),
        dik(c_.sparse ? to_bf16(ik) : std::vector<bf16>(1));
    DeviceBuffer<int32_t> dpos(positions), dslots(slots);
    DeviceBuffer<bf16> dout(size_t(T) * nq * hd);  // NaN-poisoned
    const size_t ws_bytes = cuda::attention_workspace_bytes(T, nq, nih, hd, L, c_.bs, c_.topk);
    DeviceBuffer<uint8_t> dws(ws_bytes);
    // 0x7F, not the 0xFF poison: an unwritten kept-block entry then reads as a huge block index
    // (out-of-range reads, garbage output) rather than as -1, a valid "no block".
    CUDA_CHECK(cudaMemset(dws.get(), 0x7F, std::max<size_t>(ws_bytes, 1)));

    cuda::AttentionKernelParams p;
    p.q = dq.get();
    p.k = dk.get();
    p.v = dv.get();
    p.index_q = c_.sparse ? diq.get() : nullptr;
    p.index_k = c_.sparse ? dik.get() : nullptr;
    p.cache.k = k_cache_.get();
    p.cache.v = v_cache_.get();
    p.cache.index_k = c_.sparse ? ik_cache_.get() : nullptr;
    p.cache.page_table = page_table_device_.get();
    p.cache.max_seqs = max_seqs_;
    p.cache.max_len = L;
    p.cache.page_shift = kPageShift;
    p.cache.pages_per_seq = shape_.pages_per_seq();
    p.cache.num_kv_heads = nkv;
    p.cache.head_dim = hd;
    p.cache.index_head_dim = c_.sparse ? ihd : 0;
    p.positions = dpos.get();
    p.seq_slots = dslots.get();
    p.num_tokens = T;
    p.num_q_heads = nq;
    p.num_kv_heads = nkv;
    p.head_dim = hd;
    p.scale = ap.scale;
    p.num_index_heads = nih;
    p.index_head_dim = ap.index_head_dim;
    p.block_size = c_.bs;
    p.topk_blocks = c_.topk;
    p.local_blocks = c_.local;
    p.out = dout.get();
    p.workspace = dws.get();
    p.workspace_bytes = ws_bytes;
    cuda::launch_attention(p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());

    // Output: every element written, within the bf16 tolerance.
    const std::vector<float> out_gpu = from_bf16(dout.download());
    const size_t non_finite =
        size_t(std::count_if(out_gpu.begin(), out_gpu.end(), [](float x) { return !std::isfinite(x); }));
    EXPECT_EQ(non_finite, 0u) << "output elements left unwritten (NaN poison) or non-finite";
    const double err = relative_l2(out_gpu, out_cpu);
    EXPECT_LT(err, kTolBf16) << "relative L2 of the attention output vs the CPU oracle";

    // Cache: the step's rows, and every row written by earlier steps, hold exactly the bf16 inputs.
    for (int t = 0; t < T; ++t) {
      const size_t row = size_t(shape_.row(page_table_, slots[t], positions[t]));
      written_[row] = 1;
      std::copy_n(k.begin() + size_t(t) * nkv * hd, nkv * hd, k_mirror_.begin() + row * nkv * hd);
      std::copy_n(v.begin() + size_t(t) * nkv * hd, nkv * hd, v_mirror_.begin() + row * nkv * hd);
      if (c_.sparse) std::copy_n(ik.begin() + size_t(t) * ihd, ihd, ik_mirror_.begin() + row * ihd);
    }
    const std::vector<float> kc = from_bf16(k_cache_.download()), vc = from_bf16(v_cache_.download());
    const std::vector<float> ikc = c_.sparse ? from_bf16(ik_cache_.download()) : std::vector<float>{};
    size_t cache_mismatches = 0;
    for (size_t row = 0; row < written_.size(); ++row) {
      if (!written_[row]) continue;
      for (size_t i = row * nkv * hd; i < (row + 1) * nkv * hd; ++i)
        cache_mismatches += (kc[i] != k_mirror_[i]) + (vc[i] != v_mirror_[i]);
      if (c_.sparse)
        for (size_t i = row * ihd; i < (row + 1) * ihd; ++i) cache_mismatches += ikc[i] != ik_mirror_[i];
    }
    EXPECT_EQ(cache_mismatches, 0u) << "cache elements differing from the bf16 inputs";

    // Kept blocks: the workspace opens with int32 [T][nih][topk] kept-block lists, -1 padded (the
    // layout attention.cu's header states); as sets they must equal the oracle's selection.
    if (c_.sparse && c_.topk > 0) {
      std::vector<int32_t> kept(size_t(T) * nih * c_.topk);
      CUDA_CHECK(cudaMemcpy(kept.data(), dws.get(), kept.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
      int set_mismatches = 0;
      for (int t = 0; t < T; ++t) {
        const int pos = positions[t];
        std::vector<float> scores(size_t(pos) + 1);
        for (int g = 0; g < nih; ++g) {
          const float* iqv = iq.data() + (size_t(t) * nih + g) * ihd;
          for (int s = 0; s <= pos; ++s) {
            const float* ikv = ik_mirror_.data() + size_t(shape_.row(page_table_, slots[t], s)) * ihd;
            float acc = 0.f;
            for (int d = 0; d < ihd; ++d) acc += iqv[d] * ikv[d];
            scores[s] = acc;
          }
          std::vector<int> want = cpu::select_blocks(scores.data(), pos, c_.bs, c_.topk, c_.local);
          std::vector<int> got;
          for (int e = 0; e < c_.topk; ++e) {
            const int b = kept[(size_t(t) * nih + g) * c_.topk + e];
            if (b != -1) got.push_back(b);
          }
          std::sort(want.begin(), want.end());
          std::sort(got.begin(), got.end());
          if (want != got && ++set_mismatches <= 5)
            ADD_FAILURE() << "kept blocks differ at token " << t << " (pos " << pos << "), index head " << g;
        }
      }
      EXPECT_EQ(set_mismatches, 0);
    }
  }

 private:
  AttnCase c_;
  int max_seqs_;
  CacheShape shape_;
  std::vector<int32_t> page_table_;
  size_t kv_elems_, ik_elems_;
  DeviceBuffer<bf16> k_cache_, v_cache_, ik_cache_;  // NaN-poisoned: a read of an unwritten row shows
  DeviceBuffer<int32_t> page_table_device_;
  std::vector<float> k_mirror_, v_mirror_, ik_mirror_;
  std::vector<char> written_;
  cpu::CpuOps cpu_;
};

class CudaAttention : public ::testing::TestWithParam<AttnCase> {};

// Several sequences of different lengths (crossing block boundaries) prefilled in one step.
TEST_P(CudaAttention, Prefill) {
  TPMOE_REQUIRE_GPU();
  const AttnCase& c = GetParam();
  const std::vector<int> lengths = {1, 7, 8, 9, 40, 100};
  Harness h(c, 8);
  std::vector<int32_t> slots, positions;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int slot = int((i * 5 + 2) % 8);  // distinct slots, not in step order
    for (int pos = 0; pos < lengths[i]; ++pos) {
      slots.push_back(slot);
      positions.push_back(pos);
    }
  }
  h.step(slots, positions, 1000, "prefill");
}

// T sequences of distinct lengths prefilled (checked too), then two decode steps of T tokens.
TEST_P(CudaAttention, Decode) {
  TPMOE_REQUIRE_GPU();
  const AttnCase& c = GetParam();
  constexpr int kMaxSeqs = 23;
  for (const int T : {1, 3, 19}) {
    Harness h(c, kMaxSeqs);
    std::vector<int32_t> seq_slot(static_cast<size_t>(T)), seq_len(static_cast<size_t>(T));
    for (int i = 0; i < T; ++i) {
      seq_slot[i] = (i * 7 + 3) % kMaxSeqs;  // distinct: 7 is coprime to 23
      seq_len[i] = c.decode_ctx - i * (c.decode_ctx / 20);
    }
    std::vector<int32_t> slots, positions;
    for (int i = 0; i < T; ++i)
      for (int pos = 0; pos < seq_len[i]; ++pos) {
        slots.push_back(seq_slot[i]);
        positions.push_back(pos);
      }
    const uint64_t seed = 2000 + uint64_t(T) * 100;
    h.step(slots, positions, seed, "prefill before decode, T=" + std::to_string(T));
    for (int d = 0; d < 2; ++d) {
      std::vector<int32_t> pos_now(static_cast<size_t>(T));
      for (int i = 0; i < T; ++i) pos_now[i] = seq_len[i] + d;
      h.step(seq_slot, pos_now, seed + 10 * (d + 1), "decode " + std::to_string(d) + ", T=" + std::to_string(T));
    }
  }
}

// name, nq, nkv, hd, sparse, ihd, bs, topk, local, max_len, decode_ctx
INSTANTIATE_TEST_SUITE_P(
    Cases, CudaAttention,
    ::testing::Values(AttnCase{"full_gqa2_hd32", 8, 4, 32, false, 0, 0, 0, 0, 256, 200},
                      AttnCase{"full_gqa8_hd128", 16, 2, 128, false, 0, 0, 0, 0, 2048, 700},
                      AttnCase{"full_gqa1_hd64", 4, 4, 64, false, 0, 0, 0, 0, 1024, 500},
                      // group 20 > 16 heads per block: two head chunks per KV head
                      AttnCase{"full_gqa20_hd256", 20, 1, 256, false, 0, 0, 0, 0, 512, 300},
                      AttnCase{"sparse_gqa2_hd32_bs8_top2_local1", 8, 4, 32, true, 32, 8, 2, 1, 256, 200},
                      AttnCase{"sparse_gqa8_hd128_bs8_top16_local2", 16, 2, 128, true, 64, 8, 16, 2, 2048, 700},
                      AttnCase{"sparse_gqa8_hd128_bs64_top2_local1", 8, 1, 128, true, 128, 64, 2, 1, 2048, 900},
                      // contexts past 16 blocks of 64: the top-16 selection matters in decode
                      AttnCase{"sparse_gqa16_hd64_bs64_top16_local2", 16, 1, 64, true, 128, 64, 16, 2, 4096, 1500},
                      AttnCase{"sparse_gqa1_hd32_bs8_top2_local2", 4, 4, 32, true, 32, 8, 2, 2, 512, 300}),
    [](const ::testing::TestParamInfo<AttnCase>& info) { return std::string(info.param.name); });

TEST(CudaAttentionErrors, UnsupportedHeadDimThrows) {
  TPMOE_REQUIRE_GPU();
  const int hd = 96, nkv = 1, nq = 1, L = 16;
  DeviceBuffer<bf16> q(nq * hd), k(nkv * hd), v(nkv * hd), out(nq * hd), kc(size_t(L) * nkv * hd),
      vc(size_t(L) * nkv * hd);
  DeviceBuffer<int32_t> pos(std::vector<int32_t>{0}), slot(std::vector<int32_t>{0});
  const size_t ws_bytes = cuda::attention_workspace_bytes(1, nq, 0, hd, L, 0, 0);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  cuda::AttentionKernelParams p;
  p.q = q.get();
  p.k = k.get();
  p.v = v.get();
  p.out = out.get();
  p.cache.k = kc.get();
  p.cache.v = vc.get();
  DeviceBuffer<int32_t> table(std::vector<int32_t>{0});
  p.cache.page_table = table.get();
  p.cache.max_seqs = 1;
  p.cache.max_len = L;
  p.cache.page_shift = 4;  // one page of 16 = L
  p.cache.pages_per_seq = 1;
  p.cache.num_kv_heads = nkv;
  p.cache.head_dim = hd;
  p.positions = pos.get();
  p.seq_slots = slot.get();
  p.num_tokens = 1;
  p.num_q_heads = nq;
  p.num_kv_heads = nkv;
  p.head_dim = hd;
  p.scale = 1.f;
  p.workspace = ws.get();
  p.workspace_bytes = ws_bytes;
  try {
    cuda::launch_attention(p, nullptr);
    FAIL() << "launch_attention accepted head_dim=96";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unsupported head_dim=96"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tpmoe::test
