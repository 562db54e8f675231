// The one table of a rank's weights: for every tensor the forward reads (ModelWeights), its shape on
// the rank and the blocks of checkpoint tensors it is made of. Everything that needs to know how
// the model is laid out across ranks reads this table instead of repeating it:
//   - the checkpoint loader (weights.cpp) copies each block out of the checkpoint;
//   - the preset generators (random_weights on the host, and the device generator of the CUDA
//     backend) compute each block's values from its canonical name and element index, so a rank's
//     shard can be made directly where it will live, without the full model anywhere;
//   - the byte reports (report.cpp) add up what a rank holds and what a decode step reads.
// The TP slicing itself comes from RankShard (parallel.h); the table turns it into blocks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/fusion_plan.h"
#include "model/parallel.h"
#include "model/weights.h"

namespace tpmoe {

// A checkpoint matrix (or vector), named by what it is rather than by a file layout: the loader
// resolves it through io::Checkpoint (layout A or B), the generators through canonical_location().
enum class Piece {
  kEmbed,
  kFinalNorm,
  kLmHead,
  kInputNorm,
  kPostAttentionNorm,
  kQProj,
  kKProj,
  kVProj,
  kOProj,
  kQNorm,
  kKNorm,
  kIndexQProj,
  kIndexKProj,
  kIndexQNorm,
  kIndexKNorm,
  kDenseGate,
  kDenseUp,
  kDenseDown,
  kRouter,
  kRouterBias,
  kExpertGate,
  kExpertUp,
  kExpertDown,  // routed expert `expert`: [I, H], [I, H], [H, I]
  kSharedGate,
  kSharedUp,
  kSharedDown,  // all shared experts as one MLP of width n * Is
};

struct PieceRef {
  Piece piece;
  int layer = -1;
  int expert = -1;
};

// Rows [row_begin, row_begin + rows) x columns [col_begin, col_begin + cols) of a [N, K] piece
// (a vector piece is [N] with cols == 1).
struct Block {
  PieceRef source;
  int64_t row_begin = 0, rows = 0, col_begin = 0, cols = 0;
};

// What one decode step reads of a tensor (for the bandwidth floor).
enum class StepRead {
  kWhole,       // every byte, every step
  kTokenRows,   // one row per token (the embedding)
  kExpertRows,  // the rows of the experts the step routes to (dim 0 is the physical expert row)
};

struct WeightEntry {
  std::string name;  // where it sits in ModelWeights, for messages ("layers.3.attn.q_proj")
  std::function<Tensor&(ModelWeights&)> slot;
  std::vector<int64_t> shape;  // on this rank
  bool vector = false;         // a norm or bias: stored fp32 on every backend
  // Blocks fill the tensor in order, each contributing rows x cols elements row-major; with
  // concat_columns each block instead contributes columns to every row (a row-parallel slice
  // gathered from several shared experts).
  bool concat_columns = false;
  std::vector<Block> blocks;
  StepRead read = StepRead::kWhole;
  int routed_rows = 0;  // kExpertRows: rows [0, routed_rows) are routed; the rest (fused shared) always read
};

// Every tensor of rank `shard` under `plan`, in a fixed order.
std::vector<WeightEntry> rank_weight_table(const ModelConfig& config, const RankShard& shard, const FusionPlan& plan);

// Full shape of a piece: {N, K} for matrices, {N} for vectors.
std::vector<int64_t> piece_shape(const ModelConfig& config, const PieceRef& ref);

// Where a piece lives among the canonical (layout A) tensors the presets generate: element
// `offset + r * row_stride + c` of tensor `name` is element (r, c) of the piece.
struct CanonicalLocation {
  std::string name;
  int64_t offset = 0;
  int64_t row_stride = 0;  // K of the piece
};
CanonicalLocation canonical_location(const ModelConfig& config, const PieceRef& ref);

// The canonical tensors of a model (layout A names, as `save_pretrained` writes them), with the
// spread of the presets' random values: what random_weights generates.
struct CanonicalTensor {
  std::string name;
  std::vector<int64_t> shape;
  float stddev = 0;
  bool always_f32 = false;       // kept fp32 whatever the checkpoint dtype (the router bias)
  bool mxfp8_quantized = false;  // an MXFP8 checkpoint stores it as FP8 + scales (SPEC §3)
};
std::vector<CanonicalTensor> canonical_tensors(const ModelConfig& config);
// The preset spread of the canonical tensor a piece lives in.
float preset_stddev(const ModelConfig& config, const PieceRef& ref);
bool preset_always_f32(const PieceRef& ref);
// The linears an MXFP8 checkpoint quantizes (SPEC §3): attention and indexer projections, dense
// MLPs, routed and shared experts; the router, norms, embeddings and lm_head stay as they are.
bool preset_mxfp8_quantized(const PieceRef& ref);

}  // namespace tpmoe
