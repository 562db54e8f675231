// One rank's weights (SPEC §4 layout): `tpmoe inspect` sizes them without loading (rank_weight_bytes)
// and must agree with what load_rank_weights really allocates; the slices must be the right rows,
// and shared-expert fusion must put the shared expert, sliced like a routed one, at row E.
#include "model/weights.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>

#include "engine/report.h"
#include "model/presets.h"

namespace tpmoe {
namespace {

constexpr uint64_t kSeed = 5;

io::Checkpoint tiny_checkpoint(const ModelConfig& config) {
  return io::Checkpoint::from_memory(config, random_weights(config, kSeed));
}

struct RankSetup {
  ParallelLayout layout;
  FusionPlan plan;
};

RankSetup setup(const io::Checkpoint& ckpt, int tp, bool shared_fusion) {
  RankSetup s;
  s.layout.tp = tp;
  s.layout.validate(ckpt.config());
  s.plan = build_fusion_plan(ckpt.config(), s.layout, {.allreduce_fusion = true, .shared_expert_fusion = shared_fusion},
                             shared_expert_format_matches(ckpt));
  return s;
}

// `bytes` bytes at `a` and `b` are equal.
bool same_bytes(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

ModelConfig tiny_with_two_kv_heads() {
  ModelConfig c = preset_config("tiny");
  c.num_kv_heads = c.index_n_heads = 2;  // tp 4 replicates KV and index heads
  return c;
}

// The estimate must count what the loader stores, for split and replicated KV heads, fused and
// unfused shared experts, and a shared expert too wide to fuse.
TEST(Weights, RankWeightBytesMatchesLoadedBytes) {
  ModelConfig wide = preset_config("tiny");
  wide.shared_intermediate_size = 128;  // Is != I: fusion is refused
  for (const ModelConfig& config : {preset_config("tiny"), tiny_with_two_kv_heads(), wide}) {
    const io::Checkpoint ckpt = tiny_checkpoint(config);
    for (int tp : {1, 2, 4})
      for (bool shared_fusion : {true, false}) {
        const RankSetup s = setup(ckpt, tp, shared_fusion);
        for (int r = 0; r < tp; ++r) {
          SCOPED_TRACE(fmt::format("kv heads {}, Is {}, tp {}, rank {}, shared fusion {}", config.num_kv_heads,
                                   config.shared_intermediate_size, tp, r, shared_fusion));
          const RankShard shard = RankShard::make(config, s.layout, r);
          EXPECT_EQ(rank_weight_bytes(config, shard, s.plan, DType::kBF16),
                    load_rank_weights(ckpt, shard, s.plan).bytes);
        }
      }
  }
}

// With fusion, row E of each rank's expert stack is the shared expert's slice for that rank: gate
// rows then up rows of [shared_inter_begin, +I_local), and the same columns of down.
TEST(Weights, FusedSharedExpertIsRowE) {
  const ModelConfig config = preset_config("tiny");
  const io::Checkpoint ckpt = tiny_checkpoint(config);
  const int64_t E = config.num_experts, H = config.hidden_size;
  for (int tp : {1, 2, 4}) {
    const RankSetup s = setup(ckpt, tp, true);
    ASSERT_TRUE(s.plan.shared_expert.fused);
    for (int r = 0; r < tp; ++r) {
      const RankShard shard = RankShard::make(config, s.layout, r);
      const ModelWeights w = load_rank_weights(ckpt, shard, s.plan);
      const int64_t I = shard.moe_inter;
      ASSERT_EQ(shard.shared_inter, I);
      for (int l = 0; l < config.num_layers; ++l) {
        if (config.mlp_layer_types[l] != MlpType::kMoe) continue;
        SCOPED_TRACE(fmt::format("tp {}, rank {}, layer {}", tp, r, l));
        const MoeWeights& m = w.layers[l].moe;
        ASSERT_EQ(m.experts_gate_up.dim(0), E + 1);
        ASSERT_EQ(m.experts_gate_up.dim(1), 2 * I);
        ASSERT_EQ(m.experts_down.dim(0), E + 1);
        EXPECT_TRUE(m.shared.gate_up.empty());  // not also run as its own MLP

        const io::MlpViews sh = ckpt.shared_experts(l);
        const size_t es = dtype_size(m.experts_gate_up.dtype), row_bytes = size_t(H) * es;
        ASSERT_EQ(es, dtype_size(sh.gate.dtype));
        const auto* row_e = static_cast<const std::byte*>(m.experts_gate_up.data) + E * 2 * I * row_bytes;
        EXPECT_TRUE(same_bytes(row_e, sh.gate.rows(shard.shared_inter_begin, I).data, I * row_bytes));
        EXPECT_TRUE(same_bytes(row_e + I * row_bytes, sh.up.rows(shard.shared_inter_begin, I).data, I * row_bytes));

        const auto* down_e = static_cast<const std::byte*>(m.experts_down.data) + E * H * I * es;
        for (int64_t h = 0; h < H; ++h)
          ASSERT_TRUE(same_bytes(down_e + h * I * es,
                                 sh.down.data + (h * sh.down.shape[1] + shard.shared_inter_begin) * es, I * es))
              << "down row " << h;
      }
    }
  }
}

// Column-parallel q_proj: the ranks' slices, in rank order, are the full matrix exactly once. Under
// KV replication each rank's k_proj is the one KV head its q heads read.
TEST(Weights, RankSlicesCoverTheFullMatrices) {
  const ModelConfig config = tiny_with_two_kv_heads();
  const io::Checkpoint ckpt = tiny_checkpoint(config);
  const int64_t H = config.hidden_size, hd = config.head_dim;
  for (int tp : {2, 4}) {
    const RankSetup s = setup(ckpt, tp, true);
    std::vector<std::vector<std::byte>> q_union(size_t(config.num_layers));
    for (int r = 0; r < tp; ++r) {
      const RankShard shard = RankShard::make(config, s.layout, r);
      const ModelWeights w = load_rank_weights(ckpt, shard, s.plan);
      for (int l = 0; l < config.num_layers; ++l) {
        const Tensor& q = w.layers[l].attn.q_proj;
        const auto* p = static_cast<const std::byte*>(q.data);
        q_union[l].insert(q_union[l].end(), p, p + q.nbytes());

        const auto k = ckpt.common(fmt::format("layers.{}.self_attn.k_proj.weight", l), {config.num_kv_heads * hd, H});
        const int kv_head = r * config.num_kv_heads / tp;  // the head of rank r's first q head's group
        const Tensor& k_local = w.layers[l].attn.k_proj;
        ASSERT_EQ(k_local.dim(0), (tp > config.num_kv_heads ? 1 : config.num_kv_heads / tp) * hd);
        EXPECT_TRUE(same_bytes(k_local.data, k.rows(kv_head * hd, k_local.dim(0)).data, k_local.nbytes()))
            << fmt::format("tp {}, rank {}, layer {}", tp, r, l);
      }
    }
    for (int l = 0; l < config.num_layers; ++l) {
      const auto q = ckpt.common(fmt::format("layers.{}.self_attn.q_proj.weight", l), {config.num_heads * hd, H});
      ASSERT_EQ(q_union[l].size(), q.nbytes());
      EXPECT_TRUE(same_bytes(q_union[l].data(), q.data, q.nbytes())) << fmt::format("tp {}, layer {}", tp, l);
    }
  }
}

// Tensor::row views row r of the first dimension in place: the fused shared expert's rows of the
// stacked expert weights (3-D, with MXFP8 scales) run as its MLP through these views.
TEST(Weights, TensorRowViewsInPlace) {
  float data[2 * 3 * 64];
  uint8_t scales[2 * 3 * 2];
  Tensor stacked = Tensor::make(data, DType::kF32, 2, 3, 64);
  stacked.scale = scales;
  const Tensor r1 = stacked.row(1);
  EXPECT_EQ(r1.ndim, 2);
  EXPECT_EQ(r1.dim(0), 3);
  EXPECT_EQ(r1.dim(1), 64);
  EXPECT_EQ(r1.numel(), 3 * 64);
  EXPECT_EQ(r1.as<float>(), data + 3 * 64);
  EXPECT_EQ(static_cast<uint8_t*>(r1.scale), scales + 3 * 64 / 32);
  const Tensor r12 = r1.row(2);  // and of a 2-D one: a vector
  EXPECT_EQ(r12.ndim, 1);
  EXPECT_EQ(r12.dim(0), 64);
  EXPECT_EQ(r12.as<float>(), data + 5 * 64);
  EXPECT_EQ(static_cast<uint8_t*>(r12.scale), scales + 5 * 64 / 32);
  EXPECT_EQ(Tensor::make(data, DType::kF32, 2, 3, 64).row(0).scale, nullptr);
}

}  // namespace
}  // namespace tpmoe
