#include "engine/bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>

#include "core/error.h"
#include "engine/report.h"
#include "model/fusion_plan.h"
#include "model/parallel.h"
#include "model/presets.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {

double percentile(std::vector<double> v, double q) {
  TPMOE_CHECK(!v.empty(), "percentile of no values");
  std::sort(v.begin(), v.end());
  const double pos = q / 100.0 * double(v.size() - 1);
  const size_t lo = size_t(std::floor(pos)), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - double(lo)) * (v[hi] - v[lo]);
}

namespace {

GenerateRequest bench_request(int batch, int prompt_len, int new_tokens, bool overlap_decode) {
  GenerateRequest req;
  for (int b = 0; b < batch; ++b) {
    std::vector<int32_t> p;
    for (int i = 0; i < prompt_len; ++i) p.push_back(int32_t(1 + (b * 31 + i * 7) % 500));
    req.prompts.push_back(std::move(p));
  }
  req.max_new_tokens = new_tokens;
  req.return_step_logits = false;
  req.overlap_decode = overlap_decode;
  return req;
}

// Weight bytes one decode step reads on rank 0 of a preset with `layers` layers (bf16 matrices):
// the numerator of the extrapolation to the full model.
double preset_step_bytes(const std::string& preset, std::optional<int> layers, int tp, const FusionSetting& s,
                         int batch) {
  const ModelConfig config = preset_config(preset, layers);
  ParallelLayout layout;
  layout.tp = tp;
  const FusionPlan plan = build_fusion_plan(config, layout, {s.allreduce_fusion, s.shared_expert_fusion});
  return decode_weight_bytes(config, RankShard::make(config, layout, 0), plan, batch, DType::kBF16);
}

std::string on_off(bool on) { return on ? "on" : "off"; }

std::string format_gain(const FusionGain& g) {
  if (!g.gain) return g.note;
  return fmt::format("{:+.1f}%", *g.gain * 100.0);
}

}  // namespace

std::string FusionSetting::label() const { return on_off(shared_expert_fusion) + "/" + on_off(allreduce_fusion); }

std::vector<int> default_batches(const std::string& device) {
  return device == "cuda" ? std::vector<int>{1, 16, 64} : std::vector<int>{1, 4, 16};
}

std::vector<FusionSetting> all_fusion_settings() {
  return {{true, true}, {false, true}, {true, false}, {false, false}};
}

std::vector<FusionGain> fusion_gains(const std::vector<BenchRow>& rows, int tp, bool emulated) {
  auto find = [&](bool se, bool ar, int batch) -> const BenchRow* {
    for (const auto& r : rows)
      if (r.shared_expert_fusion == se && r.allreduce_fusion == ar && r.batch == batch) return &r;
    return nullptr;
  };
  std::vector<int> batches;
  for (const auto& r : rows)
    if (std::find(batches.begin(), batches.end(), r.batch) == batches.end()) batches.push_back(r.batch);
  std::vector<FusionGain> gains;
  for (int batch : batches) {
    for (bool ar : {true, false}) {
      const BenchRow *on = find(true, ar, batch), *off = find(false, ar, batch);
      if (on && off) gains.push_back({"shared_expert", ar, batch, on->tokens_per_s / off->tokens_per_s - 1.0, ""});
    }
    for (bool se : {true, false}) {
      const BenchRow *on = find(se, true, batch), *off = find(se, false, batch);
      if (!on || !off) continue;
      // At tp 1 there is no all-reduce: both plans are the same, and a difference is noise. Under
      // emulation the unfused side's all-reduce does nothing (bench.h): not the fusion's gain.
      if (tp == 1)
        gains.push_back({"allreduce", se, batch, std::nullopt, "n/a at tp 1"});
      else if (emulated)
        gains.push_back({"allreduce", se, batch, std::nullopt, "n/a emulated (no peers)"});
      else
        gains.push_back({"allreduce", se, batch, on->tokens_per_s / off->tokens_per_s - 1.0, ""});
    }
  }
  return gains;
}

BenchReport run_bench(const BenchOptions& o) {
  TPMOE_CHECK(o.new_tokens >= 3, "bench: --new-tokens must be at least 3 (the first decode step is not timed), got {}",
              o.new_tokens);
  TPMOE_CHECK(o.prompt_len >= 1, "bench: --prompt-len must be at least 1, got {}", o.prompt_len);
  TPMOE_CHECK(o.warmup >= 0, "bench: --warmup must be 0 or more, got {}", o.warmup);
  TPMOE_CHECK(!o.settings.empty(), "bench: no fusion setting to run");
  const std::vector<int> batches = o.batches.empty() ? default_batches(o.device) : o.batches;
  for (int b : batches) TPMOE_CHECK(b >= 1, "bench: --batch sizes must be positive, got {}", b);

  BenchReport report;
  report.device = o.device;
  report.tp = o.tp;
  report.emulate_tp = o.emulate_tp;
  report.prompt_len = o.prompt_len;
  report.new_tokens = o.new_tokens;
  report.warmup = o.warmup;
  // On the CPU every op has run when it returns: nothing to overlap, and the time between two steps'
  // ids would be the work of the step queued behind them.
  report.overlap_decode = o.overlap_decode && o.device == "cuda";
  if (o.model_dir.empty()) {
    const ModelConfig config = preset_config(o.preset, o.layers);
    report.model = fmt::format("preset {}, {} layers{}", o.preset, config.num_layers,
                               o.preset_dtype == "mxfp8" ? ", MXFP8 linears" : "");
    // --preset m3 --layers N: full-width layers, N of the real 60; extrapolate to the full model.
    const int full = preset_config(o.preset).num_layers;
    if (o.preset == "m3" && config.num_layers != full) {
      report.full_layers = full;
      report.extrapolation = fmt::format(
          "tok/s @{0}L (extrapolated) = batch / (TPOT mean * B{0}/B{1}), B = weight bytes a step reads "
          "(decode_weight_bytes) with {0} and {1} layers: assumes the {1}-layer ratio to the floor holds at {0}",
          full, config.num_layers);
    }
  } else {
    report.model = o.model_dir;
  }

  auto progress = [&](const std::string& line) {
    if (!o.progress) return;
    fmt::print(o.progress, "{}\n", line);
    std::fflush(o.progress);
  };

  progress(fmt::format("measuring {} read and copy bandwidth ...", o.device));
  const double bandwidth = measure_read_bandwidth(o.device);
  report.read_bandwidth_gbs = bandwidth / 1e9;
  report.copy_bandwidth_gbs = measure_copy_bandwidth(o.device) / 1e9;

  const int total = int(o.settings.size() * batches.size());
  int done = 0;
  for (const FusionSetting& s : o.settings) {
    EngineOptions eo;
    eo.tp = o.tp;
    eo.emulate_tp = o.emulate_tp;
    eo.preset_dtype = o.preset_dtype;
    eo.device = o.device;
    eo.threads = o.threads;
    eo.profile_ops = o.profile_ops;
    eo.kernel_timeline = o.kernel_timeline;
    eo.allreduce_path = o.allreduce_path;
    eo.pdl = o.pdl;
    eo.decode_gemv = o.decode_gemv;
    eo.shared_expert_fusion = s.shared_expert_fusion;
    eo.shared_fusion_max_tokens = o.shared_fusion_max_tokens;
    eo.allreduce_fusion = s.allreduce_fusion;
    progress(fmt::format("[{}/{}] fusions {}: building the engine ({}) ...", done + 1, total, s.label(), report.model));
    std::unique_ptr<Engine> engine = o.model_dir.empty() ? Engine::from_preset(o.preset, o.layers, o.seed, eo)
                                                         : Engine::from_checkpoint(o.model_dir, eo);
    report.weights_gib_per_rank.push_back(double(engine->weight_bytes_per_rank()) / double(1ull << 30));
    if (s.shared_expert_fusion && report.shared_expert_plan.empty())
      report.shared_expert_plan = engine->shared_expert_plan();
    for (int batch : batches) {
      ++done;
      progress(fmt::format("[{}/{}] fusions {} batch {}: {} warm-up + 1 measured generate ...", done, total, s.label(),
                           batch, o.warmup));
      const GenerateRequest req = bench_request(batch, o.prompt_len, o.new_tokens, report.overlap_decode);
      for (int w = 0; w < o.warmup; ++w) engine->generate(req);
      const GenerateResult r = engine->generate(req);
      // The experts each step read: recorded in a run of its own, since the record waits for the
      // device after every step (the timed run's steps overlap the host). The same tokens, so the
      // same experts.
      GenerateRequest routed_req = req;
      routed_req.record_routing = true;
      const GenerateResult routed = engine->generate(routed_req);
      report.primary = engine->is_primary();
      if (!report.primary) continue;  // under mpirun, rank 0's process measures and reports
      TPMOE_CHECK(int(r.step_seconds.size()) == o.new_tokens - 1, "bench: {} decode step times for {} steps",
                  r.step_seconds.size(), o.new_tokens - 1);
      TPMOE_CHECK(r.overlapped_decode == report.overlap_decode, "bench: the timed run's decode steps {} the host",
                  r.overlapped_decode ? "overlapped" : "did not overlap");
      TPMOE_CHECK(routed.generated == r.generated,
                  "bench: the run that records routing generated other tokens than the timed run");
      const std::vector<double> tpot(r.step_seconds.begin() + 1, r.step_seconds.end());

      BenchRow row;
      row.setting = s.label();
      row.shared_expert_fusion = s.shared_expert_fusion;
      row.allreduce_fusion = s.allreduce_fusion;
      row.batch = batch;
      row.ttft_ms = r.prefill_seconds * 1e3;
      row.first_step_ms = r.step_seconds.front() * 1e3;
      const double mean_s = std::accumulate(tpot.begin(), tpot.end(), 0.0) / double(tpot.size());
      row.tpot_mean_ms = mean_s * 1e3;
      row.tpot_p50_ms = percentile(tpot, 50) * 1e3;
      row.tpot_p99_ms = percentile(tpot, 99) * 1e3;
      row.timed_steps = int(tpot.size());
      row.launches_per_step = r.launches_per_step;
      row.tokens_per_s = batch / mean_s;
      // The bytes each timed step had to read: the experts its router actually chose.
      TPMOE_CHECK(routed.step_routed_experts.size() == r.step_seconds.size(), "bench: routing of {} steps for {} steps",
                  routed.step_routed_experts.size(), r.step_seconds.size());
      double bytes = 0;
      for (size_t i = 1; i < routed.step_routed_experts.size(); ++i)
        bytes += engine->decode_weight_bytes(batch, &routed.step_routed_experts[i]);
      bytes /= double(routed.step_routed_experts.size() - 1);
      row.gb_per_step = bytes / 1e9;
      row.floor_ms = bytes / bandwidth * 1e3;
      row.ratio = row.tpot_mean_ms / row.floor_ms;
      if (report.full_layers > 0) {
        const double scale = preset_step_bytes(o.preset, std::nullopt, o.tp, s, batch) /
                             preset_step_bytes(o.preset, o.layers, o.tp, s, batch);
        row.tokens_per_s_full = batch / (mean_s * scale);
      }
      progress(fmt::format("[{}/{}] fusions {} batch {}: {:.1f} tokens/s, TPOT {:.3f} ms", done, total, s.label(),
                           batch, row.tokens_per_s, row.tpot_mean_ms));
      report.rows.push_back(row);
    }
    engine.reset();  // before the next setting's engine is built
  }
  if (o.settings.size() > 1)
    report.gains = fusion_gains(report.rows, o.emulate_tp > 0 ? o.emulate_tp : o.tp, o.emulate_tp > 0);
  return report;
}

std::string format_bench(const BenchReport& rep) {
  std::string s;
  s += fmt::format("decode benchmark: {}, device {}, tp {}, prompt {} tokens, {} new tokens per sequence\n", rep.model,
                   rep.device, rep.emulate_tp > 0 ? rep.emulate_tp : rep.tp, rep.prompt_len, rep.new_tokens);
  if (rep.emulate_tp > 0)
    s += fmt::format(
        "emulated: rank 0 of tp {} alone on one device (its shard and fusion plan); every collective replaced by a "
        "local stand-in that runs the fused add + RMSNorm on this rank's partial, without communication: the rows "
        "are one rank's compute and memory time, not a deployment's (all-reduce latency not included)\n",
        rep.emulate_tp);
  s +=
      fmt::format("weights per rank: {:.4g} GiB", rep.weights_gib_per_rank.empty() ? 0.0 : rep.weights_gib_per_rank[0]);
  const auto& w = rep.weights_gib_per_rank;
  if (std::adjacent_find(w.begin(), w.end(), std::not_equal_to<>()) != w.end())  // fusion changes what is stored
    s += fmt::format(" ({:.4g} GiB per setting)", fmt::join(w, ", "));
  s += fmt::format("; measured read bandwidth {:.0f} GB/s (read-only stream; a copy: {:.0f} GB/s read + write)\n",
                   rep.read_bandwidth_gbs, rep.copy_bandwidth_gbs);
  s += fmt::format(
      "protocol: {} warm-up generate(s) per row, then one measured generate; TTFT = prefill of the batch; "
      "step1 = first decode step (records the CUDA graph on cuda), not in TPOT; TPOT over the {} steps after it; "
      "tokens/s = batch / TPOT mean; decode steps {}; the experts each step read are recorded in one more generate "
      "of the same tokens\n",
      rep.warmup, rep.new_tokens - 2,
      rep.overlap_decode ? "overlap the host (step i + 1 queued before step i's ids reach it)" : "one at a time");
  s += "floor = weight bytes a step must read (the routed experts each timed step's router chose, the shared ones, "
       "every dense weight, the batch's embedding rows; mean over the timed steps) / read bandwidth; ratio = TPOT "
       "mean / floor, >= 1 up to measurement noise\n";
  s += "setting = shared-expert fusion / all-reduce fusion\n";
  if (!rep.shared_expert_plan.empty()) s += "shared-expert fusion on: " + rep.shared_expert_plan + "\n";
  if (rep.full_layers > 0) s += rep.extrapolation + "\n";

  const std::string full_col = rep.full_layers > 0 ? fmt::format("tok/s @{}L (extrapolated)", rep.full_layers) : "";
  s += fmt::format("{:>7} {:>6} {:>10} {:>9} {:>10} {:>9} {:>9} {:>11} {:>9} {:>9} {:>7} {:>9}", "setting", "batch",
                   "TTFT ms", "step1 ms", "TPOT mean", "TPOT p50", "TPOT p99", "tokens/s", "GB/step", "floor ms",
                   "ratio", "launches");
  if (!full_col.empty()) s += fmt::format(" {:>26}", full_col);
  s += "\n";
  for (const BenchRow& r : rep.rows) {
    s += fmt::format(
        "{:>7} {:>6} {:>10.2f} {:>9.3f} {:>10.3f} {:>9.3f} {:>9.3f} {:>11.1f} {:>9.3f} {:>9.3f} {:>7.2f} {:>9}",
        r.setting, r.batch, r.ttft_ms, r.first_step_ms, r.tpot_mean_ms, r.tpot_p50_ms, r.tpot_p99_ms, r.tokens_per_s,
        r.gb_per_step, r.floor_ms, r.ratio, r.launches_per_step);
    if (r.tokens_per_s_full) s += fmt::format(" {:>26.1f}", *r.tokens_per_s_full);
    s += "\n";
  }
  if (rep.gains.empty()) return s;

  // One row per batch; a column per (fusion, other fusion held at).
  s += "fusion gains: tokens/s with the fusion on / with it off - 1, the other fusion held as named\n";
  const std::vector<std::pair<std::string, bool>> cols = {
      {"shared_expert", true}, {"shared_expert", false}, {"allreduce", true}, {"allreduce", false}};
  auto col_name = [](const std::string& f, bool other) {
    return f == "shared_expert" ? fmt::format("shared-expert (all-reduce {})", on_off(other))
                                : fmt::format("all-reduce (shared-expert {})", on_off(other));
  };
  std::vector<std::pair<std::string, bool>> present;
  for (const auto& c : cols)
    for (const auto& g : rep.gains)
      if (g.fusion == c.first && g.other_on == c.second) {
        present.push_back(c);
        break;
      }
  s += fmt::format("{:>6}", "batch");
  for (const auto& c : present) s += fmt::format(" {:>31}", col_name(c.first, c.second));
  s += "\n";
  std::vector<int> batches;
  for (const auto& g : rep.gains)
    if (std::find(batches.begin(), batches.end(), g.batch) == batches.end()) batches.push_back(g.batch);
  for (int batch : batches) {
    s += fmt::format("{:>6}", batch);
    for (const auto& c : present) {
      std::string cell = "-";
      for (const auto& g : rep.gains)
        if (g.batch == batch && g.fusion == c.first && g.other_on == c.second) cell = format_gain(g);
      s += fmt::format(" {:>31}", cell);
    }
    s += "\n";
  }
  return s;
}

nlohmann::json bench_json(const BenchReport& rep) {
  using nlohmann::json;
  json j;
  j["tool"] = "tpmoe bench";
  j["model"] = rep.model;
  j["device"] = rep.device;
  j["tp"] = rep.tp;
  j["emulate_tp"] = rep.emulate_tp;
  j["shared_expert_plan"] = rep.shared_expert_plan;
  j["prompt_len"] = rep.prompt_len;
  j["new_tokens"] = rep.new_tokens;
  j["warmup"] = rep.warmup;
  j["overlap_decode"] = rep.overlap_decode;
  j["copy_bandwidth_gbs"] = rep.copy_bandwidth_gbs;
  j["read_bandwidth_gbs"] = rep.read_bandwidth_gbs;
  j["weights_gib_per_rank"] = rep.weights_gib_per_rank;
  j["protocol"] =
      "TTFT = prefill of the batch; step1 = first decode step (records the CUDA graph on cuda); TPOT over the "
      "decode steps after it; tokens/s = batch / TPOT mean; floor = decode_weight_bytes (the experts each timed step "
      "routed to) / read bandwidth (a read-only stream; read_bandwidth_gbs)";
  if (rep.full_layers > 0) {
    j["extrapolated_layers"] = rep.full_layers;
    j["extrapolation"] = rep.extrapolation;
  }
  j["rows"] = json::array();
  for (const BenchRow& r : rep.rows) {
    json row = {{"setting", r.setting},
                {"shared_expert_fusion", r.shared_expert_fusion},
                {"allreduce_fusion", r.allreduce_fusion},
                {"batch", r.batch},
                {"ttft_ms", r.ttft_ms},
                {"first_step_ms", r.first_step_ms},
                {"tpot_mean_ms", r.tpot_mean_ms},
                {"tpot_p50_ms", r.tpot_p50_ms},
                {"tpot_p99_ms", r.tpot_p99_ms},
                {"timed_steps", r.timed_steps},
                {"launches_per_step", r.launches_per_step},
                {"tokens_per_s", r.tokens_per_s},
                {"gb_per_step", r.gb_per_step},
                {"floor_ms", r.floor_ms},
                {"ratio", r.ratio}};
    if (r.tokens_per_s_full) row["tokens_per_s_extrapolated"] = *r.tokens_per_s_full;
    j["rows"].push_back(row);
  }
  j["gains"] = json::array();
  for (const FusionGain& g : rep.gains) {
    json e = {{"fusion", g.fusion},
              {g.fusion == "shared_expert" ? "allreduce_fusion" : "shared_expert_fusion", g.other_on},
              {"batch", g.batch}};
    e["gain"] = g.gain ? json(*g.gain) : json(nullptr);
    if (!g.note.empty()) e["note"] = g.note;
    j["gains"].push_back(e);
  }
  return j;
}

}  // namespace tpmoe
