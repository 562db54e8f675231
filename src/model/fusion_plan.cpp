#include "model/fusion_plan.h"

#include <fmt/format.h>

#include "core/error.h"

namespace tpmoe {

const char* reduce_name(Reduce r) {
  switch (r) {
    case Reduce::kNone: return "none";
    case Reduce::kImmediate: return "immediate";
    case Reduce::kFusedIntoNorm: return "fused-into-norm";
    case Reduce::kDeferred: return "deferred";
  }
  return "?";
}

int default_shared_fusion_max_tokens(const ModelConfig& config) {
  return config.quantization.method == QuantMethod::kMxfp8 ? 0 : kSharedExpertMaxFusedTokens;
}

namespace {

SharedExpertPlan plan_shared_expert(const ModelConfig& c, const ParallelLayout& layout, const FusionOptions& o,
                                    bool format_matches) {
  SharedExpertPlan p;
  p.physical_rows = c.num_experts;
  if (!c.any_moe() || c.num_shared_experts == 0) {
    p.reason = "no MoE layer has a shared expert";
  } else if (!o.shared_expert_fusion) {
    p.reason = "turned off (--shared-expert-fusion off): the shared expert runs as its own MLP";
  } else if (c.shared_intermediate_size != c.moe_intermediate_size) {
    p.reason = fmt::format(
        "refused: shared_intermediate_size {} != intermediate_size {}, so the shared expert "
        "is not an expert-shaped row",
        c.shared_intermediate_size, c.moe_intermediate_size);
  } else if (!format_matches) {
    p.reason = "refused: shared and routed expert weights are stored in different formats";
  } else if (layout.expert_parallel) {
    p.reason = "refused: under expert parallelism the shared expert is replicated, not an expert row";
  } else {
    p.fused = true;
    p.physical_rows = c.num_experts + c.num_shared_experts;
    p.max_fused_tokens =
        o.shared_expert_max_fused_tokens < 0 ? default_shared_fusion_max_tokens(c) : o.shared_expert_max_fused_tokens;
    p.reason = fmt::format("fused: shared experts are rows {}..{} of the routed weights, weight 1/rsf = {}; {}",
                           c.num_experts, p.physical_rows - 1, 1.0f / c.routed_scaling_factor,
                           p.max_fused_tokens == 0
                               ? "every step appends them to each token's slots"
                               : fmt::format("steps of up to {} token{} append them to each token's slots, larger "
                                             "ones run those rows as the shared MLP",
                                             p.max_fused_tokens, p.max_fused_tokens == 1 ? "" : "s"));
  }
  return p;
}

// Why an MLP/MoE output must be reduced immediately even with fusion on, or "" when deferral is fine.
std::string why_not_defer(const ModelConfig& c, const ParallelLayout& layout, int layer) {
  // The model's last layer ends the last stage, but its consumer (the final norm) is in that stage:
  // it may defer unless one of the rules below applies to it too.
  if (layout.is_stage_end(layer, c.num_layers) && layer != c.num_layers - 1)
    return "last layer of a pipeline stage: its output leaves the stage";
  if (layout.sequence_parallel) return "sequence-parallel layout: the output is reduce-scattered, not deferred";
  if (c.mlp_layer_types[layer] == MlpType::kMoe) {
    if (layout.expert_parallel) return "expert-parallel MoE: the all-to-all combine already reduced it";
    if (c.num_experts == 0) return "MoE with zero experts: no partial sum to defer";
  }
  return "";
}

}  // namespace

FusionPlan build_fusion_plan(const ModelConfig& c, const ParallelLayout& layout, const FusionOptions& o,
                             bool shared_format_matches) {
  FusionPlan plan;
  plan.tp = layout.tp;
  plan.shared_expert = plan_shared_expert(c, layout, o, shared_format_matches);
  plan.layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerPlan& lp = plan.layers[l];
    lp.stage_end = layout.is_stage_end(l, c.num_layers);
    if (layout.tp == 1) {
      lp.attention_reason = lp.mlp_reason = "tp=1: outputs are complete, nothing to reduce";
      continue;
    }
    if (!o.allreduce_fusion) {
      lp.attention = lp.mlp = Reduce::kImmediate;
      lp.attention_reason = lp.mlp_reason = "all-reduce fusion off";
    } else {
      lp.attention = Reduce::kFusedIntoNorm;
      lp.attention_reason = "reduced inside post_attention_layernorm";
      const std::string why = why_not_defer(c, layout, l);
      if (why.empty()) {
        lp.mlp = Reduce::kDeferred;
        lp.mlp_reason = l == c.num_layers - 1 ? "deferred to the final norm" : "deferred to the next input_layernorm";
      } else {
        lp.mlp = Reduce::kImmediate;
        lp.mlp_reason = why;
      }
    }
    if (l > 0) lp.fuse_input_allreduce = plan.layers[l - 1].mlp == Reduce::kDeferred;
  }
  plan.final_norm_fused = c.num_layers > 0 && plan.layers.back().mlp == Reduce::kDeferred;
  plan.final_norm_reason = plan.final_norm_fused ? "reduces the last layer's deferred partial"
                           : layout.tp == 1      ? "tp=1: plain norm"
                                                 : "last layer reduced immediately: plain add + norm";
  return plan;
}

void check_plan_consistent(const FusionPlan& plan) {
  const size_t n = plan.layers.size();
  for (size_t l = 0; l < n; ++l) {
    const bool deferred = plan.layers[l].mlp == Reduce::kDeferred;
    const bool consumed = l + 1 < n ? plan.layers[l + 1].fuse_input_allreduce : plan.final_norm_fused;
    TPMOE_CHECK(deferred == consumed, "fusion plan: layer {} {} its MLP reduction but {} fuses an all-reduce", l,
                deferred ? "defers" : "does not defer", l + 1 < n ? fmt::format("layer {}", l + 1) : "the final norm");
    TPMOE_CHECK(plan.tp > 1 || (plan.layers[l].mlp == Reduce::kNone && plan.layers[l].attention == Reduce::kNone),
                "fusion plan: tp=1 but layer {} reduces", l);
  }
}

std::string FusionPlan::to_string() const {
  std::string s = fmt::format("fusion plan (tp={})\n  shared expert: {}\n", tp, shared_expert.reason);
  s += fmt::format("  {:>5}  {:<15} {:<15} {:<11} {}\n", "layer", "input norm", "attention", "mlp", "why");
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerPlan& lp = layers[l];
    s += fmt::format("  {:>5}  {:<15} {:<15} {:<11} attn: {}; mlp: {}{}\n", l,
                     lp.fuse_input_allreduce ? "allreduce+norm" : "add+norm", reduce_name(lp.attention),
                     reduce_name(lp.mlp), lp.attention_reason, lp.mlp_reason, lp.stage_end ? " [stage end]" : "");
  }
  s += fmt::format("  final norm: {} ({})\n", final_norm_fused ? "allreduce+norm" : "add+norm", final_norm_reason);
  return s;
}

}  // namespace tpmoe
