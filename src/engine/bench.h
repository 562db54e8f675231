// `tpmoe bench`: the decode benchmark. Each fusion setting builds its own Engine (the fusion plan is
// fixed at build), runs a warm-up generate and a measured generate per batch, and reports TTFT, TPOT
// (mean/p50/p99), tokens/s and the bandwidth floor; with four settings, the gain of each fusion.
//
// Protocol (one, for every device):
//   - every sequence of a batch has the same prompt length and generates the same number of tokens;
//   - `warmup` generates of the same request run first, so first-call costs (cuBLASLt planning,
//     allocations, page faults) are excluded;
//   - TTFT = the prefill of the whole batch (its argmax is the first token);
//   - TPOT = the wall time of each decode step from the second on: the first decode step of every
//     generate records the CUDA graph on cuda, so it is reported apart (step1 ms), not averaged in;
//   - tokens/s = batch / mean TPOT (decode throughput);
//   - floor = the weight bytes each timed step had to read (decode_weight_bytes with the distinct
//     experts its router chose), averaged, / the measured read-only bandwidth; ratio = mean TPOT /
//     floor, which is >= 1 by construction up to measurement noise.
#pragma once

#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace tpmoe {

struct FusionSetting {
  bool shared_expert_fusion = true;
  bool allreduce_fusion = true;
  // "on/on": shared-expert fusion / all-reduce fusion.
  std::string label() const;
};

struct BenchOptions {
  std::string model_dir;        // a checkpoint; empty: the preset
  std::string preset = "tiny";  // built-in random model when model_dir is empty
  std::optional<int> layers;    // layers of the preset
  uint64_t seed = 0;
  std::string device = "cpu";
  int tp = 1;
  int emulate_tp = 0;                 // > 0: rank 0 of a tp-N group on one device (EngineOptions::emulate_tp)
  std::string preset_dtype = "bf16";  // bf16 or mxfp8 (EngineOptions::preset_dtype)
  int threads = 0;
  bool profile_ops = false;             // EngineOptions::profile_ops (steps then run eagerly)
  bool kernel_timeline = false;         // EngineOptions::kernel_timeline
  std::string allreduce_path = "auto";  // EngineOptions::allreduce_path
  bool pdl = true, decode_gemv = true;  // EngineOptions::pdl, decode_gemv
  int shared_fusion_max_tokens = -1;    // EngineOptions::shared_fusion_max_tokens
  std::vector<int> batches;             // empty: default_batches(device)
  int prompt_len = 32;
  int new_tokens = 32;         // G >= 3: G - 1 decode steps, G - 2 of them timed as TPOT
  int warmup = 1;              // warm-up generates per (setting, batch)
  bool overlap_decode = true;  // GenerateRequest::overlap_decode of the timed generates (cuda only)
  std::vector<FusionSetting> settings = {FusionSetting{}};
  std::FILE* progress = stderr;  // progress lines; nullptr: quiet
};

std::vector<int> default_batches(const std::string& device);
// Percentile with linear interpolation between order statistics (numpy's default), q in [0, 100]:
// the one every benchmark reports (v non-empty).
double percentile(std::vector<double> v, double q);
// The four combinations --compare-fusions runs: on/on, off/on, on/off, off/off.
std::vector<FusionSetting> all_fusion_settings();

struct BenchRow {
  std::string setting;  // FusionSetting::label()
  bool shared_expert_fusion = true, allreduce_fusion = true;
  int batch = 0;
  double ttft_ms = 0;
  double first_step_ms = 0;  // the first decode step (records the CUDA graph on cuda)
  double tpot_mean_ms = 0, tpot_p50_ms = 0, tpot_p99_ms = 0;
  int timed_steps = 0;
  int launches_per_step = 0;  // kernel launches one decode step replays (cuda)
  double tokens_per_s = 0;
  double gb_per_step = 0;  // weight bytes one step reads on a rank (decode_weight_bytes), 1e9
  double floor_ms = 0;
  double ratio = 0;                         // tpot_mean / floor
  std::optional<double> tokens_per_s_full;  // extrapolated to the full model (--preset m3 --layers N)
};

// Gain of one fusion at one batch, the other fusion held at `other_on`:
// tokens/s(fusion on) / tokens/s(fusion off) - 1; empty with `note` when it means nothing (the
// all-reduce fusion at tp 1: there is no all-reduce).
struct FusionGain {
  std::string fusion;  // "shared_expert" or "allreduce"
  bool other_on = true;
  int batch = 0;
  std::optional<double> gain;
  std::string note;
};

struct BenchReport {
  std::string model;  // "preset m3, 4 layers" or the checkpoint directory
  std::string device;
  int tp = 1, prompt_len = 0, new_tokens = 0, warmup = 0;
  bool overlap_decode = true;                // the timed generates overlapped their decode steps with the host
  int emulate_tp = 0;                        // > 0: the rows time rank 0 of a tp-N group alone (no communication)
  std::string shared_expert_plan;            // the fusion plan's shared-expert decision with the fusion on
  double read_bandwidth_gbs = 0;             // measured read-only stream: the floor's ceiling
  double copy_bandwidth_gbs = 0;             // measured copy, bytes read + written (for reference)
  std::vector<double> weights_gib_per_rank;  // one per setting, in settings order
  int full_layers = 0;                       // > 0: rows carry tokens_per_s_full for this many layers
  std::string extrapolation;                 // the formula, when full_layers > 0
  std::vector<BenchRow> rows;
  std::vector<FusionGain> gains;  // with all four settings
  bool primary = true;            // false in the processes of ranks other than 0 (mpirun): no rows
};

// Runs every (setting, batch), one engine at a time (an engine is destroyed before the next is built,
// so four m3 engines never share the GPU).
BenchReport run_bench(const BenchOptions& options);

// Gains from the rows (every pair of settings that differs in one fusion, at each batch). The
// all-reduce fusion has none at tp 1 (no all-reduce) nor under emulation (--emulate-tp: with it
// off, the stand-in all-reduce of one rank does nothing, so the rows compare the fused kernel on one
// rank's partial with no all-reduce at all).
std::vector<FusionGain> fusion_gains(const std::vector<BenchRow>& rows, int tp, bool emulated);

// The printed report: a header stating the protocol and formulas, the table, and the gains.
std::string format_bench(const BenchReport& report);
// The table's columns at full precision (the printed table rounds them).
nlohmann::json bench_json(const BenchReport& report);

}  // namespace tpmoe
