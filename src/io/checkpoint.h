// A MiniMax-M3 checkpoint directory seen through one canonical set of tensors, whatever its layout
// (SPEC §3): layout A (transformers save_pretrained: "model." prefix, stacked expert tensors, fused
// gate_up) or layout B (original hub files: "language_model." prefix, per-expert w1/w3/w2, separate
// gate and up projections). Every accessor checks the shape against the config and names the file
// and tensor when it is missing or wrong. Views point into the mapped files: nothing is copied here.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/config.h"

namespace tpmoe::io {

enum class CheckpointLayout { kTransformers, kHub };  // layout A, layout B
const char* layout_name(CheckpointLayout l);

// The three matrices of one SwiGLU MLP: gate [n, H], up [n, H], down [H, n].
struct MlpViews {
  TensorView gate, up, down;
};

class Checkpoint {
 public:
  // Reads config.json and the safetensors (single file or index + shards) of `dir`.
  static Checkpoint open(const std::filesystem::path& dir);
  // A checkpoint held in memory (layout A names), e.g. a preset generated on the fly.
  static Checkpoint from_memory(const ModelConfig& config, std::map<std::string, OwnedTensor> tensors);

  const ModelConfig& config() const { return config_; }
  CheckpointLayout layout() const { return layout_; }

  // Tensors named alike in both layouts, by their name under the model prefix
  // ("embed_tokens.weight", "layers.3.self_attn.q_proj.weight", "norm.weight").
  TensorView common(const std::string& name, const std::vector<int64_t>& shape) const;
  TensorView lm_head() const;  // falls back to embed_tokens when tie_word_embeddings
  MlpViews dense_mlp(int layer) const;
  // All shared experts of a layer as one MLP of width n * Is (expert c owns rows [c*Is, (c+1)*Is)).
  MlpViews shared_experts(int layer) const;
  MlpViews routed_expert(int layer, int expert) const;
  TensorView router(int layer) const;       // [E, H]
  TensorView router_bias(int layer) const;  // [E]
  // Indexer projections and norms: which = "q_proj" [nih*ihd, H], "k_proj" [ihd, H], "q_norm", "k_norm" [ihd].
  TensorView indexer(int layer, const std::string& which) const;

  // Tensors no accessor asked for so far, minus vision and "mtp." tensors (which are ignored).
  std::vector<std::string> unused_tensors() const;

 private:
  TensorView get(const std::string& full_name, const std::vector<int64_t>& shape) const;
  std::string prefix() const;  // "model." or "language_model.model."

  ModelConfig config_;
  CheckpointLayout layout_ = CheckpointLayout::kTransformers;
  std::shared_ptr<const void> owner_;  // the mapped files or the in-memory tensors
  std::map<std::string, TensorView> views_;
  std::string dir_;
  mutable std::set<std::string> used_;
};

// Writes `tensors` (named as layout A names them) and `config` as a checkpoint in `layout`, split
// into `num_shards` files with an index when num_shards > 1. Layout B gets the multimodal config
// form with legacy keys, layout A the text form.
void write_checkpoint(const std::filesystem::path& dir, const ModelConfig& config,
                      const std::map<std::string, OwnedTensor>& tensors, CheckpointLayout layout, int num_shards = 1);

}  // namespace tpmoe::io
