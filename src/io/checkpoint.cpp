#include "io/checkpoint.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace tpmoe::io {

namespace fs = std::filesystem;

const char* layout_name(CheckpointLayout l) {
  return l == CheckpointLayout::kTransformers ? "transformers (layout A)" : "hub (layout B)";
}

namespace {

constexpr const char* kHubPrefix = "language_model.";

std::string shape_str(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ",")); }

// Vision tower / projector tensors of the multimodal checkpoint and the unused multi-token-prediction
// head: present in real checkpoints, never read by the text model.
bool is_ignored(const std::string& name, CheckpointLayout layout) {
  if (name.find("mtp.") != std::string::npos) return true;
  if (layout == CheckpointLayout::kHub && name.rfind(kHubPrefix, 0) != 0) return true;
  for (const char* v : {"vision", "visual", "multi_modal_projector", "image_newline"})
    if (name.find(v) != std::string::npos) return true;
  return false;
}

}  // namespace

Checkpoint Checkpoint::open(const fs::path& dir) {
  TPMOE_CHECK(fs::is_directory(dir), "{}: not a checkpoint directory", dir.string());
  Checkpoint c;
  c.dir_ = dir.string();
  c.config_ = ModelConfig::from_file(dir / "config.json");
  auto files = std::make_shared<SafetensorsSet>(SafetensorsSet::open_dir(dir));
  for (const auto& name : files->names()) c.views_[name] = *files->find(name);
  c.owner_ = files;
  const bool hub =
      std::any_of(c.views_.begin(), c.views_.end(), [](const auto& kv) { return kv.first.rfind(kHubPrefix, 0) == 0; });
  c.layout_ = hub ? CheckpointLayout::kHub : CheckpointLayout::kTransformers;
  return c;
}

Checkpoint Checkpoint::from_memory(const ModelConfig& config, std::map<std::string, OwnedTensor> tensors) {
  Checkpoint c;
  c.dir_ = "(in-memory model)";
  c.config_ = config;
  auto owned = std::make_shared<std::map<std::string, OwnedTensor>>(std::move(tensors));
  for (const auto& [name, t] : *owned) {
    TensorView v;
    v.name = name;
    v.file = c.dir_;
    v.dtype = t.dtype;
    v.shape = t.shape;
    v.data = t.bytes.data();
    c.views_[name] = v;
  }
  c.owner_ = owned;
  return c;
}

std::string Checkpoint::prefix() const {
  return layout_ == CheckpointLayout::kHub ? "language_model.model." : "model.";
}

TensorView Checkpoint::get(const std::string& name, const std::vector<int64_t>& shape, bool quantizable) const {
  const auto it = views_.find(name);
  const TensorView* v = it == views_.end() ? nullptr : &it->second;
  TPMOE_CHECK(v != nullptr, "{}: tensor '{}' is missing from the checkpoint ({})", dir_, name, layout_name(layout_));
  TPMOE_CHECK(v->shape == shape, "{}: tensor '{}' has shape {}, expected {}", v->file, name, v->shape_str(),
              shape_str(shape));
  if (v->dtype == DType::kF8E4M3) {
    TensorView q = *v;
    attach_scale(q, quantizable);
    used_.insert(name);
    return q;
  }
  TPMOE_CHECK(v->dtype == DType::kBF16 || v->dtype == DType::kF16 || v->dtype == DType::kF32,
              "{}: tensor '{}' has dtype {}; tpmoe reads BF16, F16 and F32 weights (and F8_E4M3 for MXFP8 linears)",
              v->file, name, dtype_name(v->dtype));
  used_.insert(name);
  return *v;
}

void Checkpoint::attach_scale(TensorView& q, bool quantizable) const {
  const std::string& name = q.name;
  TPMOE_CHECK(quantizable,
              "{}: tensor '{}' is F8_E4M3, but it is never quantized in MXFP8 checkpoints (the router, its bias, "
              "norms, embeddings and lm_head stay bf16/fp32)",
              q.file, name);
  TPMOE_CHECK(config_.quantization.method == QuantMethod::kMxfp8,
              "{}: tensor '{}' is F8_E4M3 but config.json has no quantization_config with quant_method \"mxfp8\"",
              q.file, name);
  const int64_t K = q.shape.back();
  TPMOE_CHECK(K % kMxfp8BlockSize == 0,
              "{}: MXFP8 tensor '{}' {} has {} input columns, not a multiple of the scale block {}", q.file, name,
              q.shape_str(), K, kMxfp8BlockSize);
  const std::string scale_name = mxfp8_scale_name(name);
  const auto it = views_.find(scale_name);
  TPMOE_CHECK(it != views_.end(), "{}: MXFP8 tensor '{}' has no scale tensor '{}' in the checkpoint", q.file, name,
              scale_name);
  const TensorView& s = it->second;
  TPMOE_CHECK(s.dtype == DType::kU8 || s.dtype == DType::kF8E8M0,
              "{}: MXFP8 scale '{}' has dtype {}, expected U8 (biased E8M0 exponents) or F8_E8M0", s.file, scale_name,
              dtype_name(s.dtype));
  std::vector<int64_t> scale_shape = q.shape;
  scale_shape.back() = K / kMxfp8BlockSize;
  TPMOE_CHECK(s.shape == scale_shape, "{}: MXFP8 scale '{}' has shape {}, expected {} (one per 32 inputs of '{}' {})",
              s.file, scale_name, s.shape_str(), shape_str(scale_shape), name, q.shape_str());
  used_.insert(scale_name);
  q.scale = s.data;
}

std::string mxfp8_scale_name(const std::string& weight_name) { return weight_name + "_scale_inv"; }

TensorView Checkpoint::common(const std::string& name, const std::vector<int64_t>& shape) const {
  return get(prefix() + name, shape);
}

TensorView Checkpoint::linear(const std::string& name, const std::vector<int64_t>& shape) const {
  return get(prefix() + name, shape, true);
}

TensorView Checkpoint::lm_head() const {
  const std::vector<int64_t> shape{config_.vocab_size, config_.hidden_size};
  const std::string name = layout_ == CheckpointLayout::kHub ? "language_model.lm_head.weight" : "lm_head.weight";
  if (config_.tie_word_embeddings && !views_.count(name)) return common("embed_tokens.weight", shape);
  return get(name, shape);
}

MlpViews Checkpoint::dense_mlp(int l) const {
  const int64_t H = config_.hidden_size, n = config_.dense_intermediate_size;
  const std::string p = prefix() + fmt::format("layers.{}.mlp.", l);
  if (layout_ == CheckpointLayout::kHub)
    return {get(p + "gate_proj.weight", {n, H}, true), get(p + "up_proj.weight", {n, H}, true),
            get(p + "down_proj.weight", {H, n}, true)};
  const TensorView gu = get(p + "gate_up_proj.weight", {2 * n, H}, true);
  return {gu.rows(0, n), gu.rows(n, n), get(p + "down_proj.weight", {H, n}, true)};
}

MlpViews Checkpoint::shared_experts(int l) const {
  const int64_t H = config_.hidden_size, n = int64_t(config_.num_shared_experts) * config_.shared_intermediate_size;
  if (layout_ == CheckpointLayout::kHub) {
    const std::string p = prefix() + fmt::format("layers.{}.block_sparse_moe.shared_experts.", l);
    return {get(p + "gate_proj.weight", {n, H}, true), get(p + "up_proj.weight", {n, H}, true),
            get(p + "down_proj.weight", {H, n}, true)};
  }
  const std::string p = prefix() + fmt::format("layers.{}.mlp.shared_experts.", l);
  const TensorView gu = get(p + "gate_up_proj.weight", {2 * n, H}, true);
  return {gu.rows(0, n), gu.rows(n, n), get(p + "down_proj.weight", {H, n}, true)};
}

MlpViews Checkpoint::routed_expert(int l, int e) const {
  const int64_t H = config_.hidden_size, I = config_.moe_intermediate_size, E = config_.num_experts;
  if (layout_ == CheckpointLayout::kHub) {
    const std::string p = prefix() + fmt::format("layers.{}.block_sparse_moe.experts.{}.", l, e);
    return {get(p + "w1.weight", {I, H}, true), get(p + "w3.weight", {I, H}, true), get(p + "w2.weight", {H, I}, true)};
  }
  const std::string p = prefix() + fmt::format("layers.{}.mlp.experts.", l);
  const TensorView gu = get(p + "gate_up_proj", {E, 2 * I, H}, true).index(e);
  return {gu.rows(0, I), gu.rows(I, I), get(p + "down_proj", {E, H, I}, true).index(e)};
}

TensorView Checkpoint::router(int l) const {
  const std::string p = prefix() + fmt::format("layers.{}.", l);
  const std::vector<int64_t> shape{config_.num_experts, config_.hidden_size};
  return get(p + (layout_ == CheckpointLayout::kHub ? "block_sparse_moe.gate.weight" : "mlp.gate.weight"), shape);
}

TensorView Checkpoint::router_bias(int l) const {
  const std::string p = prefix() + fmt::format("layers.{}.", l);
  return get(p + (layout_ == CheckpointLayout::kHub ? "block_sparse_moe.e_score_correction_bias"
                                                    : "mlp.gate.e_score_correction_bias"),
             {config_.num_experts});
}

TensorView Checkpoint::indexer(int l, const std::string& which) const {
  const ModelConfig& c = config_;
  std::vector<int64_t> shape;
  if (which == "q_proj")
    shape = {int64_t(c.index_n_heads) * c.index_head_dim, c.hidden_size};
  else if (which == "k_proj")
    shape = {c.index_head_dim, c.hidden_size};
  else
    shape = {c.index_head_dim};
  const std::string p = prefix() + fmt::format("layers.{}.self_attn.", l);
  return get(p + (layout_ == CheckpointLayout::kHub ? "index_" + which : "indexer." + which) + ".weight", shape,
             which == "q_proj" || which == "k_proj");
}

std::vector<std::string> Checkpoint::unused_tensors() const {
  std::vector<std::string> out;
  for (const auto& [name, view] : views_)
    if (!used_.count(name) && !is_ignored(name, layout_)) out.push_back(name);
  return out;
}

// ---- writing ---------------------------------------------------------------------------------

namespace {

OwnedTensor slice_rows(const OwnedTensor& t, int64_t begin, int64_t count) {
  const int64_t row = t.numel() / t.shape[0];
  OwnedTensor out{t.dtype, t.shape, {}};
  out.shape[0] = count;
  const size_t es = dtype_size(t.dtype);
  out.bytes.assign(t.bytes.begin() + begin * row * es, t.bytes.begin() + (begin + count) * row * es);
  return out;
}

// Layout-A tensors renamed and split as the hub files store them.
std::map<std::string, OwnedTensor> to_hub_layout(const ModelConfig& c, const std::map<std::string, OwnedTensor>& a) {
  std::map<std::string, OwnedTensor> b;
  for (const auto& [full_name, t] : a) {
    // An MXFP8 scale is renamed and split exactly as its weight: "X_scale_inv" follows "X".
    constexpr std::string_view kScale = "_scale_inv";
    std::string name = full_name, suffix;
    if (name.size() > kScale.size() && name.compare(name.size() - kScale.size(), kScale.size(), kScale) == 0) {
      name.resize(name.size() - kScale.size());
      suffix = kScale;
    }
    auto put = [&](const std::string& key, OwnedTensor v) { b[key + suffix] = std::move(v); };
    if (name == "lm_head.weight") {
      put("language_model.lm_head.weight", t);
      continue;
    }
    TPMOE_CHECK(name.rfind("model.", 0) == 0, "write_checkpoint: tensor '{}' is not a layout-A name", full_name);
    std::string rest = name.substr(6);
    const std::string out_prefix = "language_model.model.";
    auto ends_with = [&](const std::string& s) {
      return rest.size() >= s.size() && rest.compare(rest.size() - s.size(), s.size(), s) == 0;
    };
    auto stem = [&](const std::string& s) { return rest.substr(0, rest.size() - s.size()); };
    if (ends_with("mlp.experts.gate_up_proj")) {
      const std::string p = out_prefix + stem("mlp.experts.gate_up_proj") + "block_sparse_moe.experts.";
      const int64_t I = t.shape[1] / 2;
      for (int64_t e = 0; e < t.shape[0]; ++e) {
        OwnedTensor ex = slice_rows(t, e, 1);
        ex.shape = {2 * I, t.shape[2]};
        put(p + fmt::format("{}.w1.weight", e), slice_rows(ex, 0, I));
        put(p + fmt::format("{}.w3.weight", e), slice_rows(ex, I, I));
      }
    } else if (ends_with("mlp.experts.down_proj")) {
      const std::string p = out_prefix + stem("mlp.experts.down_proj") + "block_sparse_moe.experts.";
      for (int64_t e = 0; e < t.shape[0]; ++e) {
        OwnedTensor ex = slice_rows(t, e, 1);
        ex.shape = {t.shape[1], t.shape[2]};
        put(p + fmt::format("{}.w2.weight", e), ex);
      }
    } else if (ends_with("mlp.gate.weight")) {
      put(out_prefix + stem("mlp.gate.weight") + "block_sparse_moe.gate.weight", t);
    } else if (ends_with("mlp.gate.e_score_correction_bias")) {
      put(out_prefix + stem("mlp.gate.e_score_correction_bias") + "block_sparse_moe.e_score_correction_bias", t);
    } else if (ends_with("gate_up_proj.weight")) {  // dense MLP or shared experts
      std::string p = stem("gate_up_proj.weight");
      if (p.size() >= 19 && p.compare(p.size() - 19, 19, "mlp.shared_experts.") == 0)
        p = p.substr(0, p.size() - 19) + "block_sparse_moe.shared_experts.";
      const int64_t n = t.shape[0] / 2;
      put(out_prefix + p + "gate_proj.weight", slice_rows(t, 0, n));
      put(out_prefix + p + "up_proj.weight", slice_rows(t, n, n));
    } else if (ends_with("shared_experts.down_proj.weight")) {
      put(out_prefix + stem("mlp.shared_experts.down_proj.weight") + "block_sparse_moe.shared_experts.down_proj.weight",
          t);
    } else if (const auto pos = rest.find("self_attn.indexer."); pos != std::string::npos) {
      put(out_prefix + rest.substr(0, pos) + "self_attn.index_" + rest.substr(pos + 18), t);
    } else {
      put(out_prefix + rest, t);
    }
  }
  (void)c;
  return b;
}

}  // namespace

void write_checkpoint(const fs::path& dir, const ModelConfig& config, const std::map<std::string, OwnedTensor>& tensors,
                      CheckpointLayout layout, int num_shards) {
  fs::create_directories(dir);
  const auto form =
      layout == CheckpointLayout::kHub ? ModelConfig::JsonForm::kMultimodalLegacy : ModelConfig::JsonForm::kText;
  {
    std::ofstream f(dir / "config.json");
    TPMOE_CHECK(f.good(), "{}: cannot write config.json", dir.string());
    f << config.to_json(form).dump(2) << "\n";
  }
  const auto named = layout == CheckpointLayout::kHub ? to_hub_layout(config, tensors) : tensors;
  if (num_shards <= 1) {
    write_safetensors(dir / "model.safetensors", named);
    return;
  }
  // Shards of roughly equal byte size, tensors in name order.
  size_t total = 0;
  for (const auto& [name, t] : named) total += t.bytes.size();
  std::vector<std::map<std::string, OwnedTensor>> shards(static_cast<size_t>(num_shards));
  nlohmann::json weight_map = nlohmann::json::object();
  size_t acc = 0;
  for (const auto& [name, t] : named) {
    const int s = std::min(num_shards - 1, int(acc * num_shards / std::max<size_t>(total, 1)));
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, num_shards);
    shards[s][name] = t;
    weight_map[name] = file;
    acc += t.bytes.size();
  }
  for (int s = 0; s < num_shards; ++s)
    write_safetensors(dir / fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, num_shards), shards[s]);
  std::ofstream f(dir / "model.safetensors.index.json");
  f << nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) << "\n";
}

}  // namespace tpmoe::io
