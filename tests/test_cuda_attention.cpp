// CUDA attention (src/backends/cuda/attention.cu) against the CPU oracle (CpuOps::attention) on
// fresh random inputs: full and sparse layers, prefill (several sequences of different lengths in
// one step) and decode (1, 3, 19 tokens, each in its own slot at its own position, over a cache
// prefilled through both backends), GQA ratios 1, 2, 4, 8, 16, 20, head_dim 32/64/128/256 (so blocks
// of one key group and of several, with and without splits after them: attention.cu), index block
// sizes 8 and 64, topk 2, 16, 32 and 40, local 1 and 2. Every step also checks the cache rows
// exactly, the splits' merge in a cluster against their merge through the workspace bit for bit
// and, on sparse layers, the kept-block sets against cpu::select_blocks. The cache is paged (16
// positions a page) with a shuffled page table, so a kernel that ignored the table (or read a
// slot's positions as contiguous) would read other sequences' keys.
//
// Block selection is discrete: a near-tie in block scores could keep a different block on the GPU
// (fp32 sums in another order) than in the oracle, and a different kept set changes the output by
// far more than the tolerance. So the index q/k inputs are multiples of 0.25 in [-1, 1]: every
// product is a multiple of 1/16 and every sum of up to 256 of them is exact in fp32, whatever the
// order. Scores are then bit-identical on both sides, ties are exact, and the tie rule (lower block
// index wins) is exercised for real.
//
// CudaRotateAndAttend (at the end) holds the model's fused path - norm + RoPE storing the keys into
// the cache, attention without its cache write - to the bits of the unfused ops.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/attention.cuh"
#include "backends/cuda/cuda_ops.h"
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
  // Every step's context bound (AttentionKernelParams::context_bound; 0: max_len), as CudaOps sets it
  // from the step's positions. A sparse case whose bound has at most topk blocks runs without the
  // selection launch (attention_keeps_every_block).
  int context_bound = 0;
  // Every launch with splits merges them in a cluster (2-16 splits a row), so the workspace's
  // partials are never written (checked: a silent fallback to the workspace path would write them).
  bool merges_in_cluster = false;
  // Added to every k element and taken from every q element (after the random draw): every score
  // then lies far below zero (about -offset^2 * hd * scale), so a softmax that subtracted anything
  // but the running maximum of the scores would underflow to 0 / 0.
  float qk_offset = 0.f;
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

// One layer's paged cache: pages of 1 << kPageShift positions, a page for every position of every slot.
CacheShape paged_shape(bool sparse, int nkv, int hd, int ihd, int max_seqs, int max_len) {
  CacheShape shape;
  shape.num_layers = 1;
  shape.sparse_layer = {sparse};
  shape.num_kv_heads = nkv;
  shape.head_dim = hd;
  shape.index_head_dim = sparse ? ihd : 0;
  shape.max_seqs = max_seqs;
  shape.max_len = max_len;
  shape.page_size = 1 << kPageShift;
  shape.num_pages = max_seqs * shape.pages_per_seq();
  return shape;
}

CacheShape paged_shape(const AttnCase& c, int max_seqs) {
  return paged_shape(c.sparse, c.nkv, c.hd, c.ihd, max_seqs, c.max_len);
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
    std::vector<float> q = random_floats(size_t(T) * nq * hd, 1.f, seed);
    std::vector<float> k = random_floats(size_t(T) * nkv * hd, 1.f, seed + 1);
    for (float& x : q) x -= c_.qk_offset;
    for (float& x : k) x += c_.qk_offset;
    q = round_bf16(q);
    k = round_bf16(k);
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
    // (out-of-range reads, garbage output) rather than as -1, a valid "no block". The head (the
    // splits' arrival counters) starts zeroed, as the workspace's contract asks.
    const size_t zeroed = cuda::attention_workspace_zeroed_bytes();
    CUDA_CHECK(cudaMemset(dws.get(), 0x7F, std::max<size_t>(ws_bytes, 1)));
    CUDA_CHECK(cudaMemset(dws.get(), 0, zeroed));

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
    p.context_bound = c_.context_bound;
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
    // As CudaOps sets it. In a decode step the split kernel starts copying the keys below each
    // query's position before its PDL wait, while the cache write launched just before it stores
    // the step's own rows; those rows are NaN until then (the cache's poison: a step never writes a
    // row twice), so a query row read too early shows as a non-finite output below.
    EarlierKeysScratch scratch(shape_.num_pages);
    const bool decode_step = step_keeps_earlier_keys(st, shape_, scratch);
    p.decode_step = decode_step;
    cuda::launch_attention(p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());

    // Output: every element written, within the bf16 tolerance.
    const std::vector<float> out_gpu = from_bf16(dout.download());
    const size_t non_finite =
        size_t(std::count_if(out_gpu.begin(), out_gpu.end(), [](float x) { return !std::isfinite(x); }));
    EXPECT_EQ(non_finite, 0u) << "output elements left unwritten (NaN poison) or non-finite";
    const double err = relative_l2(out_gpu, out_cpu);
    EXPECT_LT(err, kTolBf16) << "relative L2 of the attention output vs the CPU oracle";

    if (c_.merges_in_cluster) {  // past the arrival counters (a full layer keeps no block lists): the poison
      std::vector<uint8_t> ws(ws_bytes);
      CUDA_CHECK(cudaMemcpy(ws.data(), dws.get(), ws_bytes, cudaMemcpyDeviceToHost));
      EXPECT_EQ(size_t(std::count(ws.begin() + zeroed, ws.end(), uint8_t(0x7F))), ws_bytes - zeroed)
          << "split states went through the workspace where the case merges them in a cluster";
    }

    // The same launch with every key read after the wait gives the same bits: when the keys are
    // read changes nothing else. (The cache write stores the same rows again.)
    if (decode_step) {
      DeviceBuffer<bf16> dout_after(size_t(T) * nq * hd);
      p.out = dout_after.get();
      p.decode_step = false;
      cuda::launch_attention(p, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<bf16> early = dout.download(), after = dout_after.download();
      EXPECT_EQ(std::memcmp(early.data(), after.data(), early.size() * sizeof(bf16)), 0)
          << "decode_step changed the attention output";
    }

    // The splits merged through the workspace (the last to arrive merges) give the same bits as
    // in a cluster (the others push their states into split 0's shared memory, split 0 merges), where
    // the launch made clusters (2-16 splits); elsewhere both launches take the workspace path.
    {
      DeviceBuffer<bf16> dout_ws(size_t(T) * nq * hd);
      p.out = dout_ws.get();
      p.decode_step = decode_step;
      p.merge_splits_in_cluster = false;
      cuda::launch_attention(p, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      p.merge_splits_in_cluster = true;
      const std::vector<bf16> in_cluster = dout.download(), through_ws = dout_ws.download();
      EXPECT_EQ(std::memcmp(in_cluster.data(), through_ws.data(), in_cluster.size() * sizeof(bf16)), 0)
          << "the splits' merge in a cluster and through the workspace differ";
    }

    // The arrival counters are back at zero for the next launch (each split's last block resets
    // its row's): a leftover count would make a later launch merge before its splits are in.
    std::vector<int32_t> arrivals(zeroed / sizeof(int32_t));
    CUDA_CHECK(cudaMemcpy(arrivals.data(), dws.get(), zeroed, cudaMemcpyDeviceToHost));
    EXPECT_EQ(size_t(std::count(arrivals.begin(), arrivals.end(), 0)), arrivals.size())
        << "arrival counters left non-zero after the launch";

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

    // Kept blocks: past the arrival counters the workspace holds int32 [T][nih][topk] kept-block
    // lists, -1 padded (the layout attention.cu's header states); as sets they must equal the
    // oracle's selection. Where the bound keeps every block there was no selection: the lists are
    // the poison still, and the oracle's selection keeps every block up to each query's.
    const bool every_block_kept =
        c_.sparse && cuda::attention_keeps_every_block(c_.context_bound > 0 ? c_.context_bound : L, c_.bs, c_.topk);
    if (c_.sparse && c_.topk > 0) {
      std::vector<int32_t> kept(size_t(T) * nih * c_.topk);
      CUDA_CHECK(cudaMemcpy(kept.data(), dws.get() + zeroed, kept.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
      int set_mismatches = 0;
      size_t poisoned_entries = 0;
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
            if (every_block_kept) {
              poisoned_entries += b == 0x7F7F7F7F;
            } else if (b != -1) {
              got.push_back(b);
            }
          }
          if (every_block_kept) {  // the layer ran as full attention over [0, pos]: blocks 0 .. pos / bs
            got.resize(size_t(pos / c_.bs + 1));
            std::iota(got.begin(), got.end(), 0);
          }
          std::sort(want.begin(), want.end());
          std::sort(got.begin(), got.end());
          if (want != got && ++set_mismatches <= 5)
            ADD_FAILURE() << "kept blocks differ at token " << t << " (pos " << pos << "), index head " << g;
        }
      }
      EXPECT_EQ(set_mismatches, 0);
      if (every_block_kept) {
        EXPECT_EQ(poisoned_entries, kept.size()) << "the selection ran where it keeps every block";
      }
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

// name, nq, nkv, hd, sparse, ihd, bs, topk, local, max_len, decode_ctx[, context_bound, merges_in_cluster,
// qk_offset]
INSTANTIATE_TEST_SUITE_P(
    Cases, CudaAttention,
    ::testing::Values(AttnCase{"full_gqa2_hd32", 8, 4, 32, false, 0, 0, 0, 0, 256, 200},
                      AttnCase{"full_gqa8_hd128", 16, 2, 128, false, 0, 0, 0, 0, 2048, 700},
                      // a tp-8 rank's full layer at a short context: bound 512, so 16 one-tile splits
                      // (32 keys) at 1 and 3 tokens, merged in 1 and 3 clusters of 16 (the opt-in
                      // size; every GPU of the sm_90 kind holds 3 at once), and 8 splits of 64 at 19
                      // tokens in clusters of 8; the splits past a query's position leave after the
                      // cluster's barrier without pushing a state; the prefill steps run 5-8 splits,
                      // or one (no states at all)
                      AttnCase{"full_gqa8_hd128_bound512", 8, 1, 128, false, 0, 0, 0, 0, 2048, 400, 512, true},
                      // the same at bound 256: one tile a split (32 keys, 8 splits in a cluster) in the
                      // decode steps of 1 and 3 tokens; 4 splits of 64 at 19 tokens and in the prefills
                      // of 165 and 200 (more rows than attention.cu's kOneTileRows; the longer prefills'
                      // partial rows cap theirs at 3 and 1). A 4-split launch takes 48768 bytes of
                      // dynamic shared memory next to ~2 KiB of static arrays: over the 48 KiB a kernel
                      // has without the opt-in (alone in a process, as ctest runs it, nothing raised
                      // the limit before)
                      AttnCase{"full_gqa8_hd128_bound256", 8, 1, 128, false, 0, 0, 0, 0, 2048, 200, 256, true},
                      AttnCase{"full_gqa1_hd64", 4, 4, 64, false, 0, 0, 0, 0, 1024, 500},
                      // scores of about -2048 / sqrt(128), -261 in log2 units: exp2 of one is 0 in fp32
                      AttnCase{"full_gqa8_hd128_neg_scores", 16, 2, 128, false, 0, 0, 0, 0, 2048, 300, 0, false, 4.f},
                      // 16 heads a block, one key group: at 19 tokens the partial rows cap the splits
                      // at 26 of 79 keys, so a decode split walks three tiles, the first two of them
                      // copied before the PDL wait and the third in the walk's pipeline
                      AttnCase{"full_gqa16_hd64_three_tile_splits", 32, 2, 64, false, 0, 0, 0, 0, 2048, 700},
                      // few narrow heads a KV group and a long cache: 16 key groups a block and still
                      // 4 splits at batch 1 (the groups' merge feeding the splits' merge)
                      AttnCase{"full_gqa2_hd32_long", 8, 4, 32, false, 0, 0, 0, 0, 4096, 1500},
                      // group 20 > 16 heads per block: two head chunks per KV head. At 1 and 3 tokens
                      // the one-tile rule would give 16 splits, whose 15 pushed states of 16 heads of
                      // 256 dims do not fit split 0's shared memory: the launch takes the portable
                      // plan, 8 splits of 64 in a cluster of 8, never the workspace
                      AttnCase{"full_gqa20_hd256", 20, 1, 256, false, 0, 0, 0, 0, 512, 300, 0, true},
                      AttnCase{"sparse_gqa2_hd32_bs8_top2_local1", 8, 4, 32, true, 32, 8, 2, 1, 256, 200},
                      AttnCase{"sparse_gqa8_hd128_bs8_top16_local2", 16, 2, 128, true, 64, 8, 16, 2, 2048, 700},
                      AttnCase{"sparse_gqa8_hd128_bs64_top2_local1", 8, 1, 128, true, 128, 64, 2, 1, 2048, 900},
                      // 4 key groups of 4 heads of 64, 8 splits at batch 1
                      AttnCase{"sparse_gqa4_hd64_bs8_top16_local2", 8, 2, 64, true, 64, 8, 16, 2, 2048, 700},
                      // contexts past 16 blocks of 64: the top-16 selection matters in decode
                      AttnCase{"sparse_gqa16_hd64_bs64_top16_local2", 16, 1, 64, true, 128, 64, 16, 2, 4096, 1500},
                      AttnCase{"sparse_gqa1_hd32_bs8_top2_local2", 4, 4, 32, true, 32, 8, 2, 2, 512, 300},
                      // block selection's two rankings at up to 313 blocks of 8 (more than the 256
                      // threads, so a thread owns two): 32 kept, the most the warps' ranking takes,
                      // and 40, past it (repeated block-wide argmax)
                      AttnCase{"sparse_gqa4_hd64_bs8_top32_local2", 8, 2, 64, true, 64, 8, 32, 2, 4096, 2500},
                      AttnCase{"sparse_gqa4_hd64_bs8_top40_local2", 8, 2, 64, true, 64, 8, 40, 2, 4096, 2500},
                      // index heads of 256 dims: block selection's general scoring loop (the 4-step
                      // one takes up to 128)
                      AttnCase{"sparse_gqa4_hd64_ihd256_bs16_top4_local1", 8, 2, 64, true, 256, 16, 4, 1, 1024, 500},
                      // a tp-8 rank of MiniMax-M3 at contexts below 1024 (CudaOps' bound there): 16 blocks
                      // of 64 kept out of at most 16, so no selection launch; decode reaches position 1001
                      AttnCase{"sparse_gqa8_hd128_bs64_top16_local2_bound1024", 8, 1, 128, true, 128, 64, 16, 2, 2048,
                               1000, 1024}),
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

// ---- CudaOps::rotate_and_attend ------------------------------------------------------------------
// The model's path: one launch norms and rotates q, k, index q and index k and also stores k, v and
// index k into the layer's cache, then attention runs without its cache-write launch. Held to exactly
// the bits of the unfused ops (head_norm_rope, then attention, whose first launch writes the cache)
// on a second CudaOps fed the same inputs: the output, the rotated tensors and the whole cache pool
// (poisoned first, so a row stored in the wrong place, or not at all, differs). A prefill step of two
// sequences, then decode steps of 1 and 3 tokens that read what the earlier steps stored, over a
// shuffled page table. Steps run as recorded graphs (run_step, the production decode path), and the
// fused recording must hold exactly one launch fewer.

struct RotateCase {
  const char* name;
  int nq, nkv, hd, rd;
  bool sparse;
  int ihd, bs, topk, local;  // indexer (sparse only)
};

std::ostream& operator<<(std::ostream& os, const RotateCase& c) { return os << c.name; }

constexpr int kRotateSlots = 4, kRotateMaxLen = 256, kRotateMaxTokens = 64;

std::vector<uint16_t> device_bits(const void* p, size_t n) {
  std::vector<uint16_t> host(n);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(host.data(), p, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  return host;
}

// The norm weights of one layer (fp32 on the device), shared by both runs.
struct RotateWeights {
  DeviceBuffer<float> q, k, iq, ik;
  explicit RotateWeights(const RotateCase& c)
      : q(random_floats(size_t(c.hd), 0.1f, 11)),
        k(random_floats(size_t(c.hd), 0.1f, 12)),
        iq(random_floats(size_t(std::max(c.ihd, 1)), 0.1f, 13)),
        ik(random_floats(size_t(std::max(c.ihd, 1)), 0.1f, 14)) {}
};

// One step's inputs: the projections' outputs, bf16.
struct RotateInputs {
  std::vector<bf16> q, k, v, iq, ik;
};

// What a step left behind: bits of the output and of the (rotated) inputs, the launches recorded.
struct RotateResult {
  std::vector<uint16_t> out, q, k, v, iq, ik;
  int launches = 0;
};

// One CudaOps with one cache layer, running steps fused or unfused.
class RotateRun {
 public:
  RotateRun(const RotateCase& c, bool fused, const std::vector<int32_t>& page_table)
      : c_(c), fused_(fused), page_table_(page_table), ops_(reserve(c)) {
    shape_ = paged_shape(c.sparse, c.nkv, c.hd, c.ihd, kRotateSlots, kRotateMaxLen);
    ops_.init_cache(shape_);
    const cuda::KvCacheLayer& layer = ops_.cache_layer(0);
    CUDA_CHECK(cudaMemset(layer.k, 0xFF, kv_elems() * sizeof(bf16)));
    CUDA_CHECK(cudaMemset(layer.v, 0xFF, kv_elems() * sizeof(bf16)));
    if (c.sparse) CUDA_CHECK(cudaMemset(layer.index_k, 0xFF, index_elems() * sizeof(bf16)));
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  static cuda::CudaReserve reserve(const RotateCase& c) {
    cuda::CudaReserve r;
    r.max_tokens = kRotateMaxTokens;
    r.arena_bytes = 8 << 20;
    r.num_q_heads = c.nq;
    r.num_index_heads = c.sparse ? c.nkv : 0;
    r.head_dim = c.hd;
    r.block_size = c.sparse ? c.bs : 1;
    r.topk_blocks = c.sparse ? c.topk : 1;
    return r;
  }

  size_t kv_elems() const { return size_t(shape_.num_pages) * shape_.page_size * c_.nkv * c_.hd; }
  size_t index_elems() const { return c_.sparse ? size_t(shape_.num_pages) * shape_.page_size * c_.ihd : 0; }
  const CacheShape& shape() const { return shape_; }
  cuda::CudaOps& ops() { return ops_; }

  // The layer's tensors for a step of T tokens, uploaded; `rotate` as Model::attention builds it.
  struct Layer {
    Tensor q, k, v, iq, ik, out;
    std::vector<HeadNormRope> rotate;
    AttentionParams p;
  };
  Layer upload(int T, const RotateInputs& in, const RotateWeights& w) {
    Layer l;
    const RopeParams rope{c_.hd, c_.rd, 5e6f, 1e-6f}, index_rope{c_.ihd, c_.rd, 5e6f, 1e-6f};
    auto make = [&](const std::vector<bf16>& host, int64_t cols) {
      Tensor t = ops_.alloc(T, cols);
      CUDA_CHECK(cudaMemcpy(t.data, host.data(), t.nbytes(), cudaMemcpyHostToDevice));
      return t;
    };
    l.q = make(in.q, int64_t(c_.nq) * c_.hd);
    l.k = make(in.k, int64_t(c_.nkv) * c_.hd);
    l.v = make(in.v, int64_t(c_.nkv) * c_.hd);
    l.out = ops_.alloc(T, int64_t(c_.nq) * c_.hd);
    CUDA_CHECK(cudaMemset(l.out.data, 0xFF, l.out.nbytes()));  // NaN until written
    l.rotate = {{l.q, c_.nq, Tensor::make(w.q.get(), DType::kF32, c_.hd), rope},
                {l.k, c_.nkv, Tensor::make(w.k.get(), DType::kF32, c_.hd), rope}};
    l.p.layer = 0;
    l.p.num_q_heads = c_.nq;
    l.p.num_kv_heads = c_.nkv;
    l.p.head_dim = c_.hd;
    l.p.scale = 1.f / std::sqrt(float(c_.hd));
    if (c_.sparse) {
      l.iq = make(in.iq, int64_t(c_.nkv) * c_.ihd);
      l.ik = make(in.ik, c_.ihd);
      l.rotate.push_back({l.iq, c_.nkv, Tensor::make(w.iq.get(), DType::kF32, c_.ihd), index_rope});
      l.rotate.push_back({l.ik, 1, Tensor::make(w.ik.get(), DType::kF32, c_.ihd), index_rope});
      l.p.num_index_heads = c_.nkv;
      l.p.index_head_dim = c_.ihd;
      l.p.block_size = c_.bs;
      l.p.topk_blocks = c_.topk;
      l.p.local_blocks = c_.local;
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    return l;
  }

  RotateResult step(const std::vector<int32_t>& slots, const std::vector<int32_t>& positions, const RotateInputs& in,
                    const RotateWeights& w, int key) {
    const int T = int(slots.size());
    StepTokens st;
    st.token_ids.assign(size_t(T), 0);
    st.positions = positions;
    st.seq_slots = slots;
    st.page_table = page_table_;
    ops_.begin_step(st);
    const Layer l = upload(T, in, w);
    ops_.run_step(key, [&] {
      if (fused_) {
        ops_.rotate_and_attend(l.rotate, l.q, l.k, l.v, l.iq, l.ik, l.p, l.out);
      } else {
        ops_.head_norm_rope(l.rotate);
        ops_.attention(l.q, l.k, l.v, l.iq, l.ik, l.p, l.out);
      }
      return l.out;
    });
    RotateResult r;
    r.out = device_bits(l.out.data, size_t(l.out.numel()));
    r.q = device_bits(l.q.data, size_t(l.q.numel()));
    r.k = device_bits(l.k.data, size_t(l.k.numel()));
    r.v = device_bits(l.v.data, size_t(l.v.numel()));
    if (c_.sparse) {
      r.iq = device_bits(l.iq.data, size_t(l.iq.numel()));
      r.ik = device_bits(l.ik.data, size_t(l.ik.numel()));
    }
    r.launches = ops_.last_step_launches();
    return r;
  }

  std::vector<uint16_t> k_pool() const { return device_bits(ops_.cache_layer(0).k, kv_elems()); }
  std::vector<uint16_t> v_pool() const { return device_bits(ops_.cache_layer(0).v, kv_elems()); }
  std::vector<uint16_t> index_pool() const {
    return c_.sparse ? device_bits(ops_.cache_layer(0).index_k, index_elems()) : std::vector<uint16_t>{};
  }

 private:
  RotateCase c_;
  bool fused_;
  std::vector<int32_t> page_table_;
  CacheShape shape_;
  cuda::CudaOps ops_;
};

size_t count_differences(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

class CudaRotateAndAttend : public ::testing::TestWithParam<RotateCase> {};

TEST_P(CudaRotateAndAttend, BitwiseTheUnfusedOpsWithOneLaunchFewer) {
  TPMOE_REQUIRE_GPU();
  const RotateCase& c = GetParam();
  const RotateWeights w(c);
  CacheShape shape;  // for the page table's size only
  shape.max_len = kRotateMaxLen;
  shape.page_size = 1 << kPageShift;
  shape.num_pages = kRotateSlots * shape.pages_per_seq();
  const std::vector<int32_t> table = shuffled_page_table(shape, 91);
  RotateRun fused(c, true, table), unfused(c, false, table);

  struct Step {
    std::string what;
    std::vector<int32_t> slots, positions;
  };
  std::vector<Step> steps(3);
  steps[0].what = "prefill: slot 2 positions 0..36, slot 0 positions 0..19";
  for (const auto& [slot, length] : {std::pair{2, 37}, std::pair{0, 20}})
    for (int pos = 0; pos < length; ++pos) {
      steps[0].slots.push_back(slot);
      steps[0].positions.push_back(pos);
    }
  steps[1] = {"decode, T=1", {2}, {37}};
  steps[2] = {"decode, T=3", {2, 0, 3}, {38, 20, 0}};
  uint64_t seed = 4000;
  for (size_t s = 0; s < steps.size(); ++s) {
    SCOPED_TRACE(steps[s].what);
    const int T = int(steps[s].slots.size());
    RotateInputs in;
    in.q = to_bf16(random_floats(size_t(T) * c.nq * c.hd, 1.f, seed++));
    in.k = to_bf16(random_floats(size_t(T) * c.nkv * c.hd, 1.f, seed++));
    in.v = to_bf16(random_floats(size_t(T) * c.nkv * c.hd, 1.f, seed++));
    if (c.sparse) {
      in.iq = to_bf16(random_floats(size_t(T) * c.nkv * c.ihd, 1.f, seed++));
      in.ik = to_bf16(random_floats(size_t(T) * c.ihd, 1.f, seed++));
    }
    const RotateResult a = fused.step(steps[s].slots, steps[s].positions, in, w, int(s));
    const RotateResult b = unfused.step(steps[s].slots, steps[s].positions, in, w, int(s));

    // bf16 is finite iff its exponent bits are not all ones (the 0xFFFF poison is a NaN).
    EXPECT_EQ(std::count_if(a.out.begin(), a.out.end(), [](uint16_t x) { return (x & 0x7F80) == 0x7F80; }), 0)
        << "output elements left unwritten (NaN poison) or non-finite";
    EXPECT_EQ(count_differences(a.out, b.out), 0u) << "attention output";
    EXPECT_EQ(count_differences(a.q, b.q), 0u) << "q after norm + RoPE";
    EXPECT_EQ(count_differences(a.k, b.k), 0u) << "k after norm + RoPE";
    EXPECT_EQ(count_differences(a.v, b.v), 0u) << "v";
    EXPECT_EQ(count_differences(a.iq, b.iq), 0u) << "index q after norm + RoPE";
    EXPECT_EQ(count_differences(a.ik, b.ik), 0u) << "index k after norm + RoPE";
    EXPECT_EQ(count_differences(fused.k_pool(), unfused.k_pool()), 0u) << "K cache pool";
    EXPECT_EQ(count_differences(fused.v_pool(), unfused.v_pool()), 0u) << "V cache pool";
    EXPECT_EQ(count_differences(fused.index_pool(), unfused.index_pool()), 0u) << "index-key cache pool";
    // Not a vacuous equality: the step's rows hold its rotated k (both pools started as poison).
    const std::vector<uint16_t> pool = fused.k_pool();
    const size_t kv_row = size_t(c.nkv) * c.hd;
    size_t stored = 0;
    for (int t = 0; t < T; ++t) {
      const size_t row = size_t(fused.shape().row(table, steps[s].slots[t], steps[s].positions[t]));
      stored += std::equal(a.k.begin() + t * kv_row, a.k.begin() + (t + 1) * kv_row, pool.begin() + row * kv_row);
    }
    EXPECT_EQ(stored, size_t(T)) << "tokens whose cache row holds their rotated k";
    EXPECT_EQ(b.launches - a.launches, 1) << "launches recorded: fused " << a.launches << ", unfused " << b.launches;
  }
}

// name, nq, nkv, hd, rd, sparse, ihd, bs, topk, local
INSTANTIATE_TEST_SUITE_P(Cases, CudaRotateAndAttend,
                         ::testing::Values(RotateCase{"full_gqa4_hd128", 8, 2, 128, 64, false, 0, 0, 0, 0},
                                           RotateCase{"sparse_gqa4_hd64_bs8_top2_local1", 8, 2, 64, 32, true, 128, 8, 2,
                                                      1}),
                         [](const ::testing::TestParamInfo<RotateCase>& info) { return std::string(info.param.name); });

// k normalised with heads that are not the cache's (the same row width, split otherwise): the fused
// store would put head h at the wrong place in the row, so the op refuses.
TEST(CudaRotateAndAttendErrors, KeysWithOtherHeadsThanTheCacheThrow) {
  TPMOE_REQUIRE_GPU();
  const RotateCase c{"full", 8, 2, 128, 64, false, 0, 0, 0, 0};
  const RotateWeights w(c);
  CacheShape shape;
  shape.max_len = kRotateMaxLen;
  shape.page_size = 1 << kPageShift;
  shape.num_pages = kRotateSlots * shape.pages_per_seq();
  RotateRun run(c, true, shuffled_page_table(shape, 5));
  StepTokens st;
  st.token_ids = {0};
  st.positions = {3};
  st.seq_slots = {1};
  run.ops().begin_step(st);
  RotateInputs in;
  in.q = to_bf16(random_floats(size_t(c.nq) * c.hd, 1.f, 1));
  in.k = to_bf16(random_floats(size_t(c.nkv) * c.hd, 1.f, 2));
  in.v = to_bf16(random_floats(size_t(c.nkv) * c.hd, 1.f, 3));
  RotateRun::Layer l = run.upload(1, in, w);
  l.rotate[1].num_heads = 2 * c.nkv;
  l.rotate[1].rope.head_dim = c.hd / 2;
  l.rotate[1].rope.rotary_dim = c.rd / 2;
  try {
    run.ops().rotate_and_attend(l.rotate, l.q, l.k, l.v, l.iq, l.ik, l.p, l.out);
    FAIL() << "rotate_and_attend accepted k split into 4 heads of 64 for a cache of 2 heads of 128";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit layer 0's KV cache"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tpmoe::test
