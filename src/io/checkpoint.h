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
  // ("embed_tokens.weight", "layers.3.self_attn.q_proj.weight", "norm.weight"). common() is for
  // tensors that are never quantized (norms, embeddings); linear() for the attention projections,
  // which an MXFP8 checkpoint may store as F8_E4M3 with a scale.
  TensorView common(const std::string& name, const std::vector<int64_t>& shape) const;
  TensorView linear(const std::string& name, const std::vector<int64_t>& shape) const;
  TensorView lm_head() const;  // falls back to embed_tokens when tie_word_embeddings
  MlpViews dense_mlp(int layer) const;
  // All shared experts of a layer as one MLP of width n * Is (expert c owns rows [c*Is, (c+1)*Is)).
  MlpViews shared_experts(int layer) const;
  MlpViews routed_expert(int layer, int expert) const;
  TensorView router(int layer) const;       // [E, H]
  TensorView router_bias(int layer) const;  // [E]
  // Indexer projections and norms: which = "q_proj" [nih*ihd, H], "k_proj" [ihd, H], "q_norm", "k_norm" [ihd].
  TensorView indexer(int layer, const std::string& which) const;

  // MXFP8 (SPEC §3): the accessors of quantizable weights (linear, dense_mlp, shared_experts,
  // routed_expert, indexer q/k projections) accept an F8_E4M3 tensor [.., N, K] and attach its sibling
  // scale (uint8 or F8_E8M0, [.., N, K/32]) as TensorView::scale. The sibling of "X.weight" is
  // "X.weight_scale_inv"; of layout A's stacked "mlp.experts.gate_up_proj" / "down_proj" (named as
  // transformers' fine-grained FP8 experts name them) "mlp.experts.gate_up_proj_scale_inv" /
  // "down_proj_scale_inv". Errors: F8 where quantization never occurs (router, bias, norms,
  // embeddings, lm_head), F8 without an mxfp8 quantization_config, K not a multiple of 32, a missing
  // scale, a scale of the wrong shape or dtype. (Scale values of 255, NaN, are rejected when loaded.)

  // Tensors no accessor asked for so far, minus vision and "mtp." tensors (which are ignored).
  std::vector<std::string> unused_tensors() const;

 private:
  TensorView get(const std::string& full_name, const std::vector<int64_t>& shape, bool quantizable = false) const;
  void attach_scale(TensorView& q, bool quantizable) const;
  std::string prefix() const;  // "model." or "language_model.model."

  ModelConfig config_;
  CheckpointLayout layout_ = CheckpointLayout::kTransformers;
  std::shared_ptr<const void> owner_;  // the mapped files or the in-memory tensors
  std::map<std::string, TensorView> views_;
  std::string dir_;
  mutable std::set<std::string> used_;
};

// The scale tensor of an MXFP8 weight: "X.weight" -> "X.weight_scale_inv", layout A's stacked
// "mlp.experts.gate_up_proj" -> "mlp.experts.gate_up_proj_scale_inv".
std::string mxfp8_scale_name(const std::string& weight_name);

// Writes `tensors` (named as layout A names them) and `config` as a checkpoint in `layout`, split
// into `num_shards` files with an index when num_shards > 1. Layout B gets the multimodal config
// form with legacy keys, layout A the text form.
void write_checkpoint(const std::filesystem::path& dir, const ModelConfig& config,
                      const std::map<std::string, OwnedTensor>& tensors, CheckpointLayout layout, int num_shards = 1);

}  // namespace tpmoe::io
