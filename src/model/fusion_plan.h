// The fusion plan (SPEC §4): where each tensor-parallel partial sum is reduced, and whether the
// shared expert rides in the routed experts' weights. A pure function of the config, the parallel
// layout and the user's switches, fixed when the model is built (what a step does depends on its
// token count only, never on measurements at run time) and printable, so `tpmoe inspect` shows
// exactly what a run will do.
#pragma once

#include <string>
#include <vector>

#include "model/config.h"
#include "model/parallel.h"

namespace tpmoe {

// bf16 experts: steps of at most this many tokens run a fused shared expert inside the routed
// experts' kernels; larger ones run the same weight rows as the shared MLP, which measured faster
// there (the grouped GEMM's tiles, sized for routed experts, lose to a dense GEMM on a row every
// token reads). MXFP8 experts: every step fused (the shared MLP measured slower at 64 and 128
// tokens). docs/PERF.md, "The shared expert's layout per batch".
constexpr int kSharedExpertMaxFusedTokens = 32;
int default_shared_fusion_max_tokens(const ModelConfig& config);  // 0: no limit

struct FusionOptions {
  bool allreduce_fusion = true;      // --allreduce-fusion on|off
  bool shared_expert_fusion = true;  // --shared-expert-fusion on|off
  // --shared-fusion-max-tokens: -1 = default_shared_fusion_max_tokens, 0 = no limit (every step fused).
  int shared_expert_max_fused_tokens = -1;
};

// Where one partial sum gets reduced.
enum class Reduce {
  kNone,           // tp == 1: there is nothing to reduce
  kImmediate,      // all_reduce right after the projection, then a plain add + RMSNorm
  kFusedIntoNorm,  // attention: reduced inside this layer's post_attention_layernorm
  kDeferred,       // MLP/MoE: left partial, reduced inside the next norm (next layer's input or final)
};

struct LayerPlan {
  Reduce attention = Reduce::kNone;
  std::string attention_reason;
  Reduce mlp = Reduce::kNone;  // kDeferred means reduce_results = false
  std::string mlp_reason;
  // This layer's input_layernorm does all-reduce + residual add + RMSNorm of the previous layer's
  // deferred partial (fuse_input_allreduce[l] == deferred[l-1]).
  bool fuse_input_allreduce = false;
  bool stage_end = false;

  bool mlp_reduce_results() const { return mlp != Reduce::kDeferred; }
};

struct SharedExpertPlan {
  bool fused = false;        // shared experts are expert rows E..E+n-1 of the routed weights
  int physical_rows = 0;     // rows every expert-binned structure is sized by: E + n when fused, E otherwise
  int max_fused_tokens = 0;  // fused: steps of more tokens run rows E.. as the shared MLP (0: none do)
  std::string reason;

  // Whether a step of `tokens` tokens appends the shared slots to the routed ones (else, when fused,
  // it runs the shared rows as their own MLP). A function of the token count only, fixed at build.
  bool slots_at(int tokens) const { return fused && (max_fused_tokens == 0 || tokens <= max_fused_tokens); }
};

struct FusionPlan {
  int tp = 1;
  std::vector<LayerPlan> layers;
  bool final_norm_fused = false;  // the final norm reduces the last layer's deferred partial
  std::string final_norm_reason;
  SharedExpertPlan shared_expert;

  std::string to_string() const;
};

// `shared_format_matches`: routed and shared expert weights have the same storage dtype in the
// checkpoint (fusion stacks them into one tensor). Pass true when planning without a checkpoint.
FusionPlan build_fusion_plan(const ModelConfig& config, const ParallelLayout& layout, const FusionOptions& options,
                             bool shared_format_matches = true);

// Throws unless every deferred partial has exactly one consumer: layer l defers iff layer l+1 fuses
// its input all-reduce (or, for the last layer, the final norm fuses). A deferral with no consumer
// would silently leave partial-rank garbage in the residual stream.
void check_plan_consistent(const FusionPlan& plan);

const char* reduce_name(Reduce r);

}  // namespace tpmoe
