// The MiniMax-M3 text model configuration (SPEC §2): parsed from config.json in either form (the
// text config at top level, or the multimodal config with the text part under "text_config"),
// legacy aliases accepted, and validated when built, with the offending field named.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace tpmoe {

enum class AttentionType { kFull, kSparse };  // "full_attention" / "minimax_m3_sparse"
enum class MlpType { kDense, kMoe };          // "dense" / "sparse"

// config.json's `quantization_config` (SPEC §3, MXFP8 variant). Only quant_method "mxfp8" with
// weight_block_size [1, 32] is accepted; which tensors are quantized is read from their dtypes (an
// F8_E4M3 weight with its uint8 `weight_scale_inv`), checked against where quantization may occur.
enum class QuantMethod { kNone, kMxfp8 };
struct QuantizationConfig {
  QuantMethod method = QuantMethod::kNone;
  std::vector<std::string> ignored_layers;  // as written; informational (the tensors' dtypes decide)
};

struct ModelConfig {
  int hidden_size = 0;          // H
  int num_layers = 0;           // num_hidden_layers
  int num_heads = 0;            // nh: num_attention_heads
  int num_kv_heads = 0;         // nkv: num_key_value_heads
  int head_dim = 0;             // hd (default hidden_size / num_heads)
  int rotary_dim = 0;           // rd: rotary_dim, or partial_rotary_factor * head_dim
  double rope_theta = 10000.0;  // rope_parameters.rope_theta, or top-level rope_theta
  int vocab_size = 0;
  float rms_norm_eps = 1e-6f;

  int num_experts = 0;                 // E: num_local_experts
  int num_experts_per_tok = 0;         // k
  int moe_intermediate_size = 0;       // I: intermediate_size
  int num_shared_experts = 0;          // n: n_shared_experts (1 when absent and Is is set; 0 if Is absent)
  int shared_intermediate_size = 0;    // Is: per shared expert
  int dense_intermediate_size = 0;     // Id
  float routed_scaling_factor = 1.0f;  // rsf
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;

  // Lightning indexer (used only by sparse-attention layers).
  int index_n_heads = 0;     // nih (must equal nkv when any layer is sparse)
  int index_head_dim = 0;    // ihd
  int index_block_size = 0;  // bs
  int index_topk_blocks = 0;
  int index_local_blocks = 0;

  bool tie_word_embeddings = false;
  std::vector<int32_t> eos_token_ids;      // `eos_token_id` (one id or a list): where generation may end
  std::vector<AttentionType> layer_types;  // size num_layers
  std::vector<MlpType> mlp_layer_types;    // size num_layers
  QuantizationConfig quantization;         // top level or inside text_config

  bool any_sparse_attention() const;
  bool any_moe() const;

  // Parses either form; throws tpmoe::Error naming `origin` and the field.
  static ModelConfig from_json(const nlohmann::json& j, const std::string& origin = "config.json");
  static ModelConfig from_file(const std::filesystem::path& path);
  // Checks every invariant (positive sizes, nh % nkv == 0, list lengths == num_layers,
  // index_n_heads == num_kv_heads when sparse layers exist, rotary_dim even and <= head_dim, k <= E,
  // ...). from_json calls it; call it again after editing a config by hand.
  void validate(const std::string& origin = "config") const;

  enum class JsonForm {
    kText,             // top-level text config, current names (what save_pretrained writes)
    kMultimodalLegacy  // {"text_config": {...}} with the original hub names and aliases
  };
  nlohmann::json to_json(JsonForm form = JsonForm::kText) const;
};

}  // namespace tpmoe
