// tpmoe's public API: load a MiniMax-M3 checkpoint (or a built-in preset), generate tokens.
//
//   auto engine = tpmoe::Engine::from_checkpoint("/models/m3", {.tp = 2});
//   auto result = engine->generate({.prompts = {{1, 2, 3}}, .max_new_tokens = 16});
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tpmoe/sampling.h"
#include "tpmoe/serving.h"

namespace tpmoe {

struct EngineOptions {
  int tp = 1;                        // tensor-parallel ranks (threads on the CPU)
  std::string device = "cpu";        // "cpu" (the reference backend) or "cuda"; the CLI's default is default_device()
  bool allreduce_fusion = true;      // deferred all-reduce fused with the next RMSNorm
  bool shared_expert_fusion = true;  // shared experts as extra routed-expert rows
  // Fused: steps of more tokens run those rows as the shared MLP (faster there). -1: the measured
  // default (32 for bf16 experts, none for MXFP8); 0: every step appends the shared slots.
  int shared_fusion_max_tokens = -1;
  std::vector<int> pp_stage_ends;  // pipeline stage boundaries the fusion plan honours
  int threads = 0;                 // CPU threads in all (0: every core)
  // Diagnostics and measurement knobs (filled by main from flags; the library reads no environment).
  bool profile_ops = false;             // cuda: GPU time per op, printed at the end (steps run eagerly)
  bool kernel_timeline = false;         // cuda: every replayed step's kernels timed (CUPTI), printed at the end
  std::string allreduce_path = "auto";  // cuda, tp > 1: auto, push, oneshot, twoshot or nccl for every size
  bool nccl_at_tp1 = false;             // cuda: tp 1 through the NCCL communicator (tests)
  bool pdl = true;                      // cuda: programmatic dependent launch between a step's kernels
  bool decode_gemv = true;              // cuda: GEMVs for linears of <= 8 tokens and a 1-token MoE
  // > 0: run only rank 0 of a tp-`emulate_tp` group on one device (its shard and fusion plan; the
  // collectives replaced by a local stand-in), to measure a rank of a deployment larger than the
  // machine. Its logits are not the model's.
  int emulate_tp = 0;
  // Presets only: "bf16", or "mxfp8" (the linears MXFP8 quantizes as FP8 + E8M0 scales, SPEC §3).
  std::string preset_dtype = "bf16";
};

struct GenerateRequest {
  std::vector<std::vector<int32_t>> prompts;  // one per sequence; lengths may differ
  int max_new_tokens = 16;                    // G: greedy steps per sequence
  // Teacher forcing: when non-empty, decode step i >= 1 feeds forced_tokens[b][i-1] instead of the
  // argmax of step i-1 (each row needs at least max_new_tokens - 1 tokens).
  std::vector<std::vector<int32_t>> forced_tokens;
  bool return_prefill_logits = false;  // logits at every prompt position
  bool return_step_logits = true;      // logits of every step (off for benchmarks)
  // How each next token is chosen (greedy by default) and which strings or ids end a sequence.
  // The request's length is max_new_tokens (sampling.max_tokens is not read here). A teacher-forced
  // request runs its full length whatever it generates.
  SamplingParams sampling;
  std::vector<int32_t> eos_token_ids;  // the model's EOS ids: a sequence ends there unless ignore_eos
  // Text, for stop strings and streaming (optional): detokenize(b, id) returns the text id adds to
  // sequence b (a streaming decoder's output; called in order), on_text(b, text) receives text as
  // soon as it is final (after any tail that may still become a stop string). Both run on the
  // primary rank's thread only.
  std::function<std::string(int sequence, int32_t token)> detokenize;
  std::function<void(int sequence, const std::string& text)> on_text;
  // Count the distinct routed experts each decode step chose in each MoE layer (benchmarks: the
  // bandwidth floor counts the experts a step actually reads).
  bool record_routing = false;
  // Decode step i + 1 is queued before the host has read step i's ids (the ids reach it on the
  // device), where nothing the host decides depends on them: no penalties, stop strings, forced
  // tokens, step logits or routing records. The same tokens either way; off: one step at a time.
  bool overlap_decode = true;
};

struct GenerateResult {
  int vocab_size = 0;
  std::vector<std::vector<float>> prefill_logits;  // [b][P_b * V] when asked for
  // [i][b * V]: step 0 is the last prompt position, step i >= 1 the token fed at position P_b + i - 1.
  std::vector<std::vector<float>> step_logits;
  std::vector<std::vector<int32_t>> generated;  // [b][G]: argmax of each step
  double prefill_seconds = 0, decode_seconds = 0;
  // [G-1]: wall time of each decode step (step 1 onward), host-synchronised by its argmax. With
  // overlap_decode, the time since the step before's ids reached the host: a step's time where the
  // backend queues work (CUDA), the next step's on one that runs each op as it is called (the CPU).
  // prefill_seconds is the time to the first token.
  std::vector<double> step_seconds;
  // [G-1][layer] with record_routing: distinct routed experts decode step i (from 1) chose in each
  // layer, over the real sequences (padding rows excluded); 0 for dense layers.
  std::vector<std::vector<int>> step_routed_experts;
  int launches_per_step = 0;       // kernel launches of the last decode step (CUDA graphs; 0 on the CPU)
  bool overlapped_decode = false;  // the decode steps overlapped the host (GenerateRequest::overlap_decode)
  // Per sequence: why it ended ("stop": EOS, a stop token or string; "length": max_new_tokens) and,
  // with detokenize, its text (stop strings cut off). generated[b] ends at the stopping token.
  std::vector<std::string> finish_reasons;
  std::vector<std::string> texts;
};

// "cuda" when this build has the CUDA backend and a GPU is visible, "cpu" otherwise: what a run
// uses when no device is named.
std::string default_device();

// Read bandwidth of the device's memory in bytes/s, measured now with a read-only stream far larger
// than the caches: the ceiling decode is held to (a step only reads its weights).
double measure_read_bandwidth(const std::string& device);
// Copy bandwidth (bytes read + bytes written per second) of a large device-to-device copy (host
// memcpy for "cpu"): printed for reference.
double measure_copy_bandwidth(const std::string& device);

class Engine {
 public:
  static std::unique_ptr<Engine> from_checkpoint(const std::filesystem::path& dir, const EngineOptions& options);
  // A built-in preset ("tiny", "m3") with random weights, generated in memory.
  static std::unique_ptr<Engine> from_preset(const std::string& preset, std::optional<int> layers, uint64_t seed,
                                             const EngineOptions& options);
  virtual ~Engine() = default;

  virtual GenerateResult generate(const GenerateRequest& request) = 0;
  // Serves requests (tpmoe/serving.h) until `front` returns. `front` runs on its own thread in the
  // primary process (an HTTP server, a test) and submits through the Scheduler; the ranks step the
  // running batch meanwhile. Under mpirun the other processes follow rank 0's steps and return when
  // it stops.
  virtual void serve(const ServeOptions& options, const std::function<void(Scheduler& scheduler)>& front) = 0;
  // Config summary and the fusion plan, as `tpmoe inspect` prints them.
  virtual std::string describe() const = 0;
  // What the fusion plan does with the shared experts, and why (describe()'s "shared expert:" line).
  virtual std::string shared_expert_plan() const = 0;
  // Checkpoint tensors the model did not read (vision and mtp. tensors excluded): reported, not fatal.
  virtual const std::vector<std::string>& unknown_tensors() const = 0;
  // True in the process that holds rank 0: the one that returns results, prints and writes files
  // (under mpirun, every other process gets empty results).
  virtual bool is_primary() const = 0;
  // The model's end-of-sequence ids (config.json `eos_token_id`): pass them as
  // GenerateRequest::eos_token_ids to stop there.
  virtual std::vector<int32_t> eos_token_ids() const = 0;
  virtual int vocab_size() const = 0;
  // Bytes of weights each rank holds.
  virtual size_t weight_bytes_per_rank() const = 0;
  // Weight bytes one decode step of `batch` sequences reads on a rank: the numerator of the
  // bandwidth floor. Routed experts: `routed_experts_per_layer[l]` distinct ones in layer l when
  // given (GenerateResult::step_routed_experts: what the router chose), else the expectation under
  // uniform routing.
  virtual double decode_weight_bytes(int batch, const std::vector<int>* routed_experts_per_layer = nullptr) const = 0;
};

}  // namespace tpmoe
