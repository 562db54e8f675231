// The `tpmoe` command: generate, chat, serve, make-model, inspect, bench (and bench serve), tokenize. Errors
// print one line and exit 1.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cli/text_stream.h"
#include "core/error.h"
#include "engine/bench.h"
#include "engine/launch.h"
#include "engine/op_bench.h"
#include "engine/report.h"
#include "io/checkpoint.h"
#include "model/presets.h"
#include "model/weights.h"
#include "serve/bench_serve.h"
#include "serve/server.h"
#include "text/text_model.h"
#include "text/tokenizer.h"
#include "tpmoe/tpmoe.h"

namespace {

using namespace tpmoe;

constexpr const char* kDefaultPreset = "tiny";  // the embedded default model

std::vector<int> parse_int_list(const std::string& s, const std::string& flag) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TPMOE_CHECK(used == item.size() && !item.empty(), "{}: '{}' is not a comma-separated list of integers", flag, s);
    out.push_back(v);
  }
  return out;
}

// Flags shared by generate, inspect and bench.
struct ModelFlags {
  std::string model_dir;
  std::string preset;
  std::optional<int> layers;
  uint64_t seed = 0;
  int tp = 1;
  std::string device;  // empty: default_device()
  std::string shared_fusion = "on", allreduce_fusion = "on";
  int shared_fusion_max_tokens = -1;
  int threads = 0;
  bool profile_ops = false, kernel_timeline = false;
  std::string allreduce_path = "auto";
  int emulate_tp = 0;
  std::string preset_dtype = "bf16";
  std::string pdl = "on", decode_gemv = "on";

  void add_to(CLI::App* app, bool with_device = true) {
    app->add_option("--model", model_dir, "checkpoint directory (config.json + safetensors)");
    app->add_option("--preset", preset, "built-in random model instead of --model: tiny, m3");
    app->add_option("--layers", layers, "layers of the preset");
    app->add_option("--seed", seed, "seed of the preset's random weights");
    app->add_option("--tp", tp, "tensor-parallel ranks")->check(CLI::PositiveNumber);
    if (with_device)
      app->add_option("--device", device, "cpu or cuda (default: cuda when a GPU is visible, else cpu)")
          ->check(CLI::IsMember({"cpu", "cuda"}));
    app->add_option("--shared-expert-fusion", shared_fusion, "on|off")->check(CLI::IsMember({"on", "off"}));
    app->add_option("--shared-fusion-max-tokens", shared_fusion_max_tokens,
                    "fused shared expert: steps of more tokens run its rows as the shared MLP (default: "
                    "measured: 32 for bf16 experts, none for MXFP8; 0: every step fused)")
        ->check(CLI::NonNegativeNumber);
    app->add_option("--allreduce-fusion", allreduce_fusion, "on|off")->check(CLI::IsMember({"on", "off"}));
    app->add_option("--threads", threads, "CPU threads in all (default: every core)");
    app->add_flag("--profile-ops", profile_ops, "cuda: print the GPU time of every op (steps then run without graphs)");
    app->add_flag("--kernel-timeline", kernel_timeline,
                  "cuda: record every replayed step's kernels (CUPTI) and print where each step's time went; "
                  "times measured with it on are not the step's own");
    app->add_option("--emulate-tp", emulate_tp,
                    "run only rank 0 of a tp-N group on one device (its shard and plan, collectives replaced by a "
                    "local stand-in): one rank's step time of a deployment larger than this machine")
        ->check(CLI::PositiveNumber);
    app->add_option("--dtype", preset_dtype, "weights of a --preset: bf16, or mxfp8 (weight-only FP8 linears)")
        ->check(CLI::IsMember({"bf16", "mxfp8"}));
    app->add_option("--allreduce-path", allreduce_path, "cuda, tp > 1: force one all-reduce path for every size")
        ->check(CLI::IsMember({"auto", "push", "oneshot", "twoshot", "nccl"}));
    app->add_option("--pdl", pdl, "cuda: programmatic dependent launch between a step's kernels, on|off")
        ->check(CLI::IsMember({"on", "off"}));
    app->add_option("--decode-gemv", decode_gemv,
                    "cuda: linears of <= 8 tokens and the MoE of one token on tpmoe's GEMVs, bf16 linears of "
                    "9-16 tokens on its skinny linear (off: cuBLASLt and the grouped GEMM), on|off")
        ->check(CLI::IsMember({"on", "off"}));
  }
  std::string resolved_device() const { return device.empty() ? default_device() : device; }
  EngineOptions options() const {
    EngineOptions o;
    o.tp = tp;
    o.device = resolved_device();
    o.shared_expert_fusion = shared_fusion == "on";
    o.shared_fusion_max_tokens = shared_fusion_max_tokens;
    o.allreduce_fusion = allreduce_fusion == "on";
    o.threads = threads;
    o.profile_ops = profile_ops;
    o.kernel_timeline = kernel_timeline;
    o.allreduce_path = allreduce_path;
    o.emulate_tp = emulate_tp;
    o.preset_dtype = preset_dtype;
    o.pdl = pdl == "on";
    o.decode_gemv = decode_gemv == "on";
    return o;
  }
  std::unique_ptr<Engine> load(const EngineOptions& o) const {
    TPMOE_CHECK(model_dir.empty() || preset.empty(), "give --model or --preset, not both");
    if (!model_dir.empty()) return Engine::from_checkpoint(model_dir, o);
    return Engine::from_preset(preset.empty() ? kDefaultPreset : preset, layers, seed, o);
  }
};

void warn_unknown(const Engine& engine) {
  const auto& unknown = engine.unknown_tensors();
  if (!unknown.empty())
    fmt::print(stderr, "warning: {} checkpoint tensor(s) not used by the model: {}\n", unknown.size(),
               fmt::join(unknown.begin(), unknown.begin() + std::min<size_t>(unknown.size(), 8), ", "));
}

// ---- generate ----------------------------------------------------------------------------------

// How the next token is chosen, as flags (SamplingParams, include/tpmoe/sampling.h).
struct SamplingFlags {
  SamplingParams params;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::string stop_token_ids;

  void add_to(CLI::App* app) {
    app->add_option("--temperature", params.temperature, "0: greedy (the default)");
    app->add_option("--top-k", params.top_k, "keep the k most likely tokens (0: off)");
    app->add_option("--top-p", params.top_p, "keep the most likely tokens holding this much probability (1: off)");
    app->add_option("--min-p", params.min_p, "keep tokens at least this times the most likely one's probability");
    app->add_option("--repetition-penalty", params.repetition_penalty, "over prompt and output tokens (1: off)");
    app->add_option("--presence-penalty", params.presence_penalty, "over output tokens (0: off)");
    app->add_option("--frequency-penalty", params.frequency_penalty, "over output tokens (0: off)");
    app->add_option("--sampling-seed", seed, "the same request and seed give the same tokens (default: random)");
    app->add_option("--stop", stop, "stop before this text (repeatable; needs text: --prompt or --chat)");
    app->add_option("--stop-token-ids", stop_token_ids, "comma-separated ids that end a sequence");
    app->add_flag("--ignore-eos", params.ignore_eos, "keep generating past the model's end-of-sequence tokens");
  }
  SamplingParams resolved() const {
    SamplingParams p = params;
    p.seed = seed;
    p.stop = stop;
    if (!stop_token_ids.empty()) {
      const auto ids = parse_int_list(stop_token_ids, "--stop-token-ids");
      p.stop_token_ids.assign(ids.begin(), ids.end());
    }
    return p;
  }
};

struct GenerateFlags {
  ModelFlags model;
  SamplingFlags sampling;
  std::string input, prompt_ids, prompt, dump;
  bool chat = false;
  std::optional<int> max_new_tokens;
  bool teacher_force = false;
};

// Reads a conversation (a JSON list of messages, or {"messages": [...], "tools": ...}) from stdin.
text::ChatRequest read_chat_request() {
  const std::string input{std::istreambuf_iterator<char>(std::cin), {}};
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(input);
  } catch (const std::exception& e) {
    TPMOE_FAIL("--chat: stdin is not JSON: {}", e.what());
  }
  return text::parse_chat_request(j);
}

void run_generate(const GenerateFlags& f) {
  GenerateRequest req;
  std::vector<std::vector<int32_t>> file_generated;
  TPMOE_CHECK(int(!f.input.empty()) + int(!f.prompt_ids.empty()) + int(!f.prompt.empty()) + int(f.chat) <= 1,
              "give one of --input, --prompt-ids, --prompt and --chat");
  const bool text_mode = !f.prompt.empty() || f.chat;
  auto engine = f.model.load(f.model.options());
  warn_unknown(*engine);
  std::optional<text::TextModel> text_model;
  if (text_mode) {
    text_model = text::load_text_model(f.model.model_dir, engine->vocab_size(), engine->eos_token_ids());
    const std::string prompt = f.chat ? text_model->render_chat(read_chat_request()) : f.prompt;
    const auto ids = text_model->tokenizer.encode(prompt);
    TPMOE_CHECK(!ids.empty(), "the prompt encodes to no tokens");
    req.prompts.push_back(ids);
  } else if (!f.input.empty()) {
    const auto file = io::SafetensorsSet::open_file(f.input);
    const io::TensorView* ids = file.find("input_ids");
    TPMOE_CHECK(ids && ids->shape.size() == 2, "{}: needs an 'input_ids' tensor of shape [B, P]", f.input);
    const auto values = io::to_i64(*ids);
    const int64_t B = ids->shape[0], P = ids->shape[1];
    for (int64_t b = 0; b < B; ++b) req.prompts.emplace_back(values.begin() + b * P, values.begin() + (b + 1) * P);
    if (const io::TensorView* gen = file.find("generated_ids")) {
      TPMOE_CHECK(gen->shape.size() == 2 && gen->shape[0] == B, "{}: 'generated_ids' must be [B={}, G], is {}", f.input,
                  B, gen->shape_str());
      const auto g = io::to_i64(*gen);
      for (int64_t b = 0; b < B; ++b)
        file_generated.emplace_back(g.begin() + b * gen->shape[1], g.begin() + (b + 1) * gen->shape[1]);
    }
  } else if (!f.prompt_ids.empty()) {
    const auto ids = parse_int_list(f.prompt_ids, "--prompt-ids");
    req.prompts.emplace_back(ids.begin(), ids.end());
  } else {
    TPMOE_CHECK(f.model.model_dir.empty(), "generate: give --prompt TEXT, --chat, --input FILE or --prompt-ids 1,2,3");
    req.prompts.push_back({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16});
    fmt::print("embedded default: preset '{}', prompt ids 1..16\n",
               f.model.preset.empty() ? kDefaultPreset : f.model.preset);
  }
  if (f.teacher_force) {
    TPMOE_CHECK(!file_generated.empty(), "--teacher-force needs --input with a 'generated_ids' tensor");
    req.forced_tokens = file_generated;
  }
  req.max_new_tokens = f.max_new_tokens.value_or(f.teacher_force ? int(file_generated[0].size()) : 16);
  req.return_prefill_logits = !f.dump.empty();
  req.sampling = f.sampling.resolved();
  if (text_mode) {
    if (!req.sampling.ignore_eos) req.eos_token_ids = text_model->eos_ids;
    // The reply, streamed as it is produced (only the primary rank's process prints).
    cli::attach_text_stream(req, text_model->tokenizer, [](int, const std::string& text) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    });
  }

  const GenerateResult r = engine->generate(req);
  if (!engine->is_primary()) return;  // under mpirun, rank 0's process reports and writes
  const int B = int(req.prompts.size()),
            G = int(r.step_logits.empty() ? r.step_seconds.size() + 1 : r.step_logits.size()), V = r.vocab_size;
  if (text_mode) fmt::print("\n[{}]\n", r.finish_reasons[0]);
  size_t decoded = 0;
  for (int b = 0; b < B; ++b) {
    fmt::print("sequence {}: {}\n", b, fmt::join(r.generated[b], " "));
    decoded += r.generated[b].size() - 1;
  }
  fmt::print("prefill {:.1f} ms; decode {} steps x {} sequences in {:.1f} ms ({:.1f} tokens/s)\n",
             r.prefill_seconds * 1e3, r.step_seconds.size(), B, r.decode_seconds * 1e3,
             r.decode_seconds > 0 ? double(decoded) / r.decode_seconds : 0.0);
  if (f.dump.empty()) return;
  for (const auto& g : r.generated)
    TPMOE_CHECK(int(g.size()) == G, "--dump: a sequence stopped early ({} of {} tokens); dump without stop conditions",
                g.size(), G);

  std::map<std::string, io::OwnedTensor> out;
  const size_t P = req.prompts[0].size();
  const bool same_length =
      std::all_of(req.prompts.begin(), req.prompts.end(), [&](const auto& p) { return p.size() == P; });
  if (same_length) {
    std::vector<float> prefill;
    for (const auto& p : r.prefill_logits) prefill.insert(prefill.end(), p.begin(), p.end());
    out["prefill_logits"] = io::OwnedTensor::from_f32({B, int64_t(P), V}, prefill, DType::kF32);
  }
  std::vector<float> steps;
  for (const auto& s : r.step_logits) steps.insert(steps.end(), s.begin(), s.end());
  out["step_logits"] = io::OwnedTensor::from_f32({G, B, V}, steps, DType::kF32);
  std::vector<int64_t> gen;
  for (const auto& g : r.generated) gen.insert(gen.end(), g.begin(), g.end());
  out["generated_ids"] = io::OwnedTensor::from_i64({B, G}, gen);
  std::vector<int64_t> inputs;
  if (same_length) {
    for (const auto& p : req.prompts) inputs.insert(inputs.end(), p.begin(), p.end());
    out["input_ids"] = io::OwnedTensor::from_i64({B, int64_t(P)}, inputs);
  }
  io::write_safetensors(f.dump, out);
  fmt::print("wrote {}\n", f.dump);
}

// ---- chat --------------------------------------------------------------------------------------

struct ChatFlags {
  ModelFlags model;
  SamplingFlags sampling;
  int max_new_tokens = 512;
  std::string system;
};

// An interactive chat in the terminal: each line typed is a user message; the reply streams back
// and joins the conversation. An empty line, /exit or the end of input ends it.
void run_chat(const ChatFlags& f) {
  TPMOE_CHECK(!launched_by_mpi(), "chat reads the terminal in one process: start it without mpirun (--tp N works)");
  auto engine = f.model.load(f.model.options());
  warn_unknown(*engine);
  const text::TextModel tm = text::load_text_model(f.model.model_dir, engine->vocab_size(), engine->eos_token_ids());
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  if (!f.system.empty()) messages.push_back({{"role", "system"}, {"content", f.system}});
  fmt::print("chat with {} (an empty line or /exit ends it)\n",
             f.model.model_dir.empty()
                 ? fmt::format("the '{}' preset", f.model.preset.empty() ? kDefaultPreset : f.model.preset)
                 : f.model.model_dir);
  for (std::string line;;) {
    fmt::print("> ");
    std::fflush(stdout);
    if (!std::getline(std::cin, line) || line.empty() || line == "/exit") break;
    messages.push_back({{"role", "user"}, {"content", line}});
    text::ChatRequest chat;
    chat.messages = messages;
    GenerateRequest req;
    req.prompts.push_back(tm.tokenizer.encode(tm.render_chat(chat)));
    req.max_new_tokens = f.max_new_tokens;
    req.return_step_logits = false;
    req.sampling = f.sampling.resolved();
    if (!req.sampling.ignore_eos) req.eos_token_ids = tm.eos_ids;
    cli::attach_text_stream(req, tm.tokenizer, [](int, const std::string& text) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    });
    const GenerateResult r = engine->generate(req);
    fmt::print("\n");
    messages.push_back({{"role", "assistant"}, {"content", r.texts[0]}});
  }
}

// ---- serve -------------------------------------------------------------------------------------

struct ServeFlags {
  ModelFlags model;
  ServeOptions serving;
  serve::ServerOptions server;
};

// SIGINT / SIGTERM ask the server to stop; the handler only sets a flag (all it may do), a thread
// of the serving front polls it. SA_RESETHAND: a second Ctrl-C kills at once should stopping hang.
std::atomic<bool> g_stop_requested{false};

void request_stop(int) { g_stop_requested = true; }

void install_stop_signals() {
  struct sigaction action {};
  action.sa_handler = request_stop;
  action.sa_flags = SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

// The preset's name, or the model folder's ("/models/m3/" -> "m3").
std::string default_served_name(const ModelFlags& m) {
  if (m.model_dir.empty()) return m.preset.empty() ? kDefaultPreset : m.preset;
  std::filesystem::path dir = std::filesystem::absolute(m.model_dir).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();
  return dir.filename().string();
}

void run_serve(ServeFlags f) {
  auto engine = f.model.load(f.model.options());
  warn_unknown(*engine);
  const text::TextModel tm = text::load_text_model(f.model.model_dir, engine->vocab_size(), engine->eos_token_ids());
  if (f.server.served_model_name.empty()) f.server.served_model_name = default_served_name(f.model);
  // Under mpirun every process ignores the signals mpirun forwards: the other ranks follow rank 0's
  // steps and return when its server stops.
  install_stop_signals();
  engine->serve(f.serving, [&](Scheduler& scheduler) {
    serve::OpenAIServer server(scheduler, tm, f.server);
    const int port = server.bind();
    fmt::print("tpmoe serve: listening on http://{}:{} model '{}' (Ctrl-C stops)\n", f.server.host, port,
               f.server.served_model_name);
    fmt::print("tpmoe serve: replies: {}\n", serve::describe(server.reply_format()));
    std::fflush(stdout);
    std::atomic<bool> stopped{false};
    std::thread watcher([&] {
      while (!stopped && !g_stop_requested) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      server.stop();
    });
    try {
      server.run();
    } catch (...) {
      stopped = true;
      watcher.join();
      throw;
    }
    stopped = true;
    watcher.join();
  });
  if (engine->is_primary()) fmt::print("tpmoe serve: stopped\n");
}

struct BenchServeFlags {
  serve::ServeBenchOptions options;
  std::string concurrency = "1,16,64";
  std::string json;
};

void run_bench_serve(BenchServeFlags f) {
  f.options.concurrencies = parse_int_list(f.concurrency, "--concurrency");
  const serve::ServeBenchReport report = serve::run_serve_bench(f.options);
  fmt::print("{}", serve::format_serve_bench(report));
  if (!f.json.empty()) {
    const std::string text = serve::serve_bench_json(report).dump(2) + "\n";
    std::FILE* out = std::fopen(f.json.c_str(), "w");
    TPMOE_CHECK(out, "--json: cannot write {}", f.json);
    const bool written = std::fwrite(text.data(), 1, text.size(), out) == text.size();
    TPMOE_CHECK(std::fclose(out) == 0 && written, "--json: writing {} failed", f.json);
    fmt::print("wrote {}\n", f.json);
  }
  int requests = 0;
  for (const auto& row : report.rows) requests += row.requests;
  TPMOE_CHECK(report.failed() == 0, "bench serve: {} of {} requests failed", report.failed(), requests);
}

// ---- make-model --------------------------------------------------------------------------------

struct MakeModelFlags {
  std::string preset, out, layout = "hf", dtype = "bf16";
  std::optional<int> layers;
  uint64_t seed = 0;
  int shards = 1;
};

void run_make_model(const MakeModelFlags& f) {
  ModelConfig config = preset_config(f.preset, f.layers);
  const auto layout = f.layout == "hub" ? io::CheckpointLayout::kHub : io::CheckpointLayout::kTransformers;
  const DType dtype = f.dtype == "f32" ? DType::kF32 : f.dtype == "mxfp8" ? DType::kF8E4M3 : DType::kBF16;
  if (dtype == DType::kF8E4M3) set_mxfp8(config);  // quantized linears + quantization_config
  config.eos_token_ids = text::preset_eos_ids(config.vocab_size);
  io::write_checkpoint(f.out, config, random_weights(config, f.seed, dtype), layout, f.shards);
  text::write_preset_text_files(f.out, config.vocab_size);  // tokenizer.json, chat_template.jinja
  fmt::print("wrote {} ({}, {} layers, {} shard(s), with a tokenizer and chat template)\n", f.out,
             io::layout_name(layout), config.num_layers, f.shards);
}

// ---- inspect -----------------------------------------------------------------------------------

struct InspectFlags {
  ModelFlags model;
  std::string pp_stages;
};

void run_inspect(const InspectFlags& f) {
  ModelConfig config;
  DType matrix_dtype = DType::kBF16;
  bool shared_format_matches = true;
  std::string unknown;
  if (!f.model.model_dir.empty()) {
    const auto ckpt = io::Checkpoint::open(f.model.model_dir);
    config = ckpt.config();
    matrix_dtype = ckpt.common("embed_tokens.weight", {config.vocab_size, config.hidden_size}).dtype;
    matrix_dtype = matrix_dtype == DType::kBF16 ? DType::kBF16 : DType::kF32;
    shared_format_matches = shared_expert_format_matches(ckpt);  // the engine refuses fusion otherwise
    fmt::print("checkpoint: {} ({})\n", f.model.model_dir, io::layout_name(ckpt.layout()));
  } else {
    config = preset_config(f.model.preset.empty() ? kDefaultPreset : f.model.preset, f.model.layers);
  }
  ParallelLayout layout;
  layout.tp = f.model.tp;
  if (!f.pp_stages.empty()) layout.pp_stage_ends = parse_int_list(f.pp_stages, "--pp-stages");
  layout.validate(config);
  const EngineOptions o = f.model.options();
  const FusionPlan plan = build_fusion_plan(
      config, layout, {o.allreduce_fusion, o.shared_expert_fusion, o.shared_fusion_max_tokens}, shared_format_matches);
  fmt::print("{}{}", describe_config(config), plan.to_string());
  const RankShard shard0 = RankShard::make(config, layout, 0);
  fmt::print("lm_head: {}\n",
             shard0.vocab_parallel()
                 ? fmt::format("vocab-parallel, {} rows per rank; greedy argmax distributed", shard0.vocab_size)
             : layout.tp == 1
                 ? std::string("whole (tp=1)")
                 : fmt::format("replicated (tp {} does not divide vocab {})", layout.tp, config.vocab_size));
  fmt::print("memory per rank (tp={}):\n", layout.tp);
  for (int r = 0; r < layout.tp; ++r) {
    const RankShard s = RankShard::make(config, layout, r);
    fmt::print("  rank {}: weights {:.3f} GiB ({}), KV cache {} bytes/token (fp32 on cpu), {} bytes/token (bf16)\n", r,
               double(rank_weight_bytes(config, s, plan, matrix_dtype)) / (1ull << 30), dtype_name(matrix_dtype),
               rank_kv_bytes_per_token(config, s, DType::kF32), rank_kv_bytes_per_token(config, s, DType::kBF16));
  }
}

// ---- bench -------------------------------------------------------------------------------------

struct BenchFlags {
  ModelFlags model;
  std::string batches;  // default: 1,16,64 on cuda, 1,4,16 on cpu
  std::optional<int> prompt_len, new_tokens;
  int warmup = 1;
  bool compare_fusions = false;
  std::string overlap = "on";
  std::string json;
};

void run_bench(const BenchFlags& f) {
  TPMOE_CHECK(f.model.model_dir.empty() || f.model.preset.empty(), "give --model or --preset, not both");
  BenchOptions o;
  o.model_dir = f.model.model_dir;
  o.preset = f.model.preset.empty() ? std::string(kDefaultPreset) : f.model.preset;
  o.layers = f.model.layers;
  o.seed = f.model.seed;
  o.device = f.model.resolved_device();
  o.tp = f.model.tp;
  o.emulate_tp = f.model.emulate_tp;
  o.preset_dtype = f.model.preset_dtype;
  o.threads = f.model.threads;
  o.profile_ops = f.model.profile_ops;
  o.kernel_timeline = f.model.kernel_timeline;
  o.allreduce_path = f.model.allreduce_path;
  o.pdl = f.model.pdl == "on";
  o.decode_gemv = f.model.decode_gemv == "on";
  o.shared_fusion_max_tokens = f.model.shared_fusion_max_tokens;
  if (!f.batches.empty()) o.batches = parse_int_list(f.batches, "--batch");
  const bool cuda = o.device == "cuda";
  o.prompt_len = f.prompt_len.value_or(cuda ? 128 : 32);
  o.new_tokens = f.new_tokens.value_or(cuda ? 64 : 32);
  o.warmup = f.warmup;
  o.overlap_decode = f.overlap == "on";
  const EngineOptions eo = f.model.options();
  o.settings = f.compare_fusions ? all_fusion_settings()
                                 : std::vector<FusionSetting>{{eo.shared_expert_fusion, eo.allreduce_fusion}};
  if (o.model_dir.empty() && f.model.preset.empty() && !f.model.layers)
    fmt::print("embedded default: preset '{}'\n", kDefaultPreset);
  const BenchReport report = tpmoe::run_bench(o);
  if (!report.primary) return;
  fmt::print("{}", format_bench(report));
  if (f.json.empty()) return;
  const std::string text = bench_json(report).dump(2) + "\n";
  std::FILE* out = std::fopen(f.json.c_str(), "w");
  TPMOE_CHECK(out, "--json: cannot write {}", f.json);
  const bool written = std::fwrite(text.data(), 1, text.size(), out) == text.size();
  TPMOE_CHECK(std::fclose(out) == 0 && written, "--json: writing {} failed", f.json);
  fmt::print("wrote {}\n", f.json);
}

// ---- tokenize ----------------------------------------------------------------------------------

struct TokenizeFlags {
  std::string tokenizer;
  bool decode = false, bench = false;
};

// Encode throughput on stdin's text: the first pass (cold word cache) and the best of later passes, in
// CPU time of this thread (on a shared machine wall time mostly measures the neighbours).
void run_tokenize_bench(const text::Tokenizer& tok) {
  const std::string input{std::istreambuf_iterator<char>(std::cin), {}};
  TPMOE_CHECK(!input.empty(), "tokenize --bench: stdin is empty (give it text to encode)");
  auto cpu_seconds = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  double t0 = cpu_seconds();
  size_t tokens = tok.encode(input).size();
  const double cold = cpu_seconds() - t0;
  double best = cold;
  for (int pass = 0; pass < 5; ++pass) {
    t0 = cpu_seconds();
    tokens = tok.encode(input).size();
    best = std::min(best, cpu_seconds() - t0);
  }
  const double mb = double(input.size()) / 1e6;
  fmt::print("{:.2f} MB, {} tokens: first pass {:.1f} MB/s, warm cache {:.1f} MB/s (one thread, CPU time)\n", mb,
             tokens, mb / cold, mb / best);
}

// JSON lines in, JSON lines out: a string -> its ids (no special tokens added); with --decode an array
// of ids -> its text.
void run_tokenize(const TokenizeFlags& f) {
  const auto tok = text::Tokenizer::from_file(f.tokenizer);
  if (f.bench) return run_tokenize_bench(tok);
  std::string line, out;
  for (size_t n = 1; std::getline(std::cin, line); ++n) {
    try {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (f.decode) {
        TPMOE_CHECK(j.is_array(), "expected a JSON array of token ids");
        std::vector<int32_t> ids;
        for (const auto& v : j) {
          TPMOE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < INT32_MAX,
                      "{} is not a token id", v.dump());
          ids.push_back(v.get<int32_t>());
        }
        out += nlohmann::json(tok.decode(ids)).dump();
      } else {
        TPMOE_CHECK(j.is_string(), "expected a JSON string");
        out += nlohmann::json(tok.encode(j.get<std::string>())).dump();
      }
      out += '\n';
    } catch (const std::exception& e) {
      TPMOE_FAIL("stdin line {}: {}", n, e.what());
    }
    if (out.size() > (1 << 16)) {
      std::fwrite(out.data(), 1, out.size(), stdout);
      out.clear();
    }
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tpmoe: MiniMax-M3 mixture-of-experts decoding, tensor-parallel, CPU reference and CUDA"};
  app.require_subcommand(1);

  GenerateFlags gen;
  auto* g = app.add_subcommand("generate", "generate text or tokens (embedded default model without --model)");
  gen.model.add_to(g);
  g->add_option("--input", gen.input,
                "safetensors file with input_ids i64 [B,P] (and generated_ids for teacher forcing)");
  g->add_option("--prompt-ids", gen.prompt_ids, "one prompt as comma-separated token ids");
  g->add_option("--prompt", gen.prompt, "one prompt as text (the reply is printed as it is produced)");
  g->add_flag("--chat", gen.chat, "a conversation as JSON on stdin, rendered with the model's chat template");
  gen.sampling.add_to(g);
  g->add_option("--max-new-tokens", gen.max_new_tokens, "tokens to generate per sequence (G)")
      ->check(CLI::PositiveNumber);
  g->add_flag("--teacher-force", gen.teacher_force, "feed the input file's generated_ids at each decode step");
  g->add_option("--dump", gen.dump, "write prefill_logits, step_logits and generated_ids to this safetensors file");

  MakeModelFlags mk;
  auto* m = app.add_subcommand("make-model", "write a random checkpoint of a preset's shapes");
  m->add_option("--preset", mk.preset, "tiny or m3")->required()->check(CLI::IsMember({"tiny", "m3"}));
  m->add_option("--out", mk.out, "output directory")->required();
  m->add_option("--layers", mk.layers, "number of layers")->check(CLI::PositiveNumber);
  m->add_option("--layout", mk.layout, "hf (transformers, layout A) or hub (original files, layout B)")
      ->check(CLI::IsMember({"hf", "hub"}));
  m->add_option("--seed", mk.seed, "random seed");
  m->add_option("--dtype", mk.dtype, "bf16, f32 or mxfp8")->check(CLI::IsMember({"bf16", "f32", "mxfp8"}));
  m->add_option("--shards", mk.shards, "number of safetensors shards (an index is written when > 1)")
      ->check(CLI::PositiveNumber);

  InspectFlags in;
  auto* i = app.add_subcommand("inspect", "config summary, per-layer fusion plan, memory per rank");
  in.model.add_to(i, false);
  i->add_option("--pp-stages", in.pp_stages, "last layer of each pipeline stage, comma-separated");

  BenchFlags bf;
  auto* b = app.add_subcommand("bench", "decode tokens/s (embedded default model without --model)");
  bf.model.add_to(b);
  b->add_option("--batch", bf.batches, "comma-separated batch sizes (default: 1,16,64 on cuda, 1,4,16 on cpu)");
  b->add_option("--prompt-len", bf.prompt_len, "prompt tokens per sequence (default: 128 on cuda, 32 on cpu)")
      ->check(CLI::PositiveNumber);
  b->add_option("--new-tokens", bf.new_tokens, "generated tokens per sequence (default: 64 on cuda, 32 on cpu)")
      ->check(CLI::Range(3, 1 << 20));
  b->add_option("--warmup", bf.warmup, "warm-up generates per setting and batch, not timed")
      ->check(CLI::NonNegativeNumber);
  b->add_flag("--compare-fusions", bf.compare_fusions, "run all four fusion settings and print each fusion's gain")
      ->excludes(b->get_option("--shared-expert-fusion"))
      ->excludes(b->get_option("--allreduce-fusion"));
  b->add_option("--overlap", bf.overlap,
                "queue each decode step before the host reads the last step's ids (the ids stay on the device), "
                "on|off")
      ->check(CLI::IsMember({"on", "off"}));
  b->add_option("--json", bf.json, "also write the table (full precision) to this JSON file");

  BenchServeFlags bsf;
  auto* bs = b->add_subcommand("serve", "load an OpenAI-compatible server: TTFT, TPOT, tokens/s per concurrency");
  bs->add_option("--url", bsf.options.url, "the server, e.g. http://127.0.0.1:8000")->required();
  bs->add_option("--concurrency", bsf.concurrency, "comma-separated requests in flight at most")->capture_default_str();
  bs->add_option("--num-prompts", bsf.options.num_prompts, "requests per concurrency (default: max(4 x it, 16))")
      ->check(CLI::PositiveNumber);
  bs->add_option("--input-len", bsf.options.input_len, "prompt tokens per request (random ids)")

      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  bs->add_option("--output-len", bsf.options.output_len, "generated tokens per request")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  bs->add_option("--model", bsf.options.model, "model name to request (default: the one the server lists)");
  bs->add_option("--vocab-size", bsf.options.vocab_size, "draw prompt ids below this (default: the server's)")
      ->check(CLI::PositiveNumber);
  bs->add_option("--seed", bsf.options.seed, "seed of the random prompts")->capture_default_str();
  bs->add_option("--timeout", bsf.options.timeout_s, "seconds one request may take")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  bs->add_option("--json", bsf.json, "also write the table (full precision) to this JSON file");

  ServeFlags sv;
  auto* s = app.add_subcommand("serve", "an OpenAI-compatible HTTP server (embedded default model without --model)");
  sv.model.add_to(s);
  s->add_option("--host", sv.server.host, "address to listen on")->capture_default_str();
  s->add_option("--port", sv.server.port, "port to listen on (0: a free one, printed)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  s->add_option("--served-model-name", sv.server.served_model_name,
                "the model name requests give (default: the preset's name or the model folder's)");
  s->add_option("--max-batch", sv.serving.max_batch, "sequences in the running batch at most")

      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  s->add_option("--max-context", sv.serving.max_context, "positions per sequence: prompt + reply")

      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  s->add_option("--max-step-tokens", sv.serving.max_step_tokens, "tokens one step holds (decode + prefill chunks)")

      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  s->add_option("--page-size", sv.serving.page_size, "positions per KV-cache page")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  s->add_option("--kv-pages", sv.serving.kv_pages, "KV-cache pages in the pool (0: enough for max-batch full contexts)")

      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  s->add_flag("--access-log", sv.server.access_log, "print one line per HTTP response on stderr");

  std::string bench_op;
  int bench_op_tp = 1;
  auto* bo = app.add_subcommand("bench-op", "microseconds of one op on the GPU per size: allreduce");
  bo->add_option("op", bench_op, "allreduce")->required()->check(CLI::IsMember({"allreduce"}));
  bo->add_option("--tp", bench_op_tp, "ranks, one GPU each (under mpirun: the processes)")->check(CLI::PositiveNumber);

  ChatFlags ch;
  auto* c = app.add_subcommand("chat", "an interactive chat in the terminal (embedded default model without --model)");
  ch.model.add_to(c);
  ch.sampling.add_to(c);
  c->add_option("--max-new-tokens", ch.max_new_tokens, "tokens per reply at most")->check(CLI::PositiveNumber);
  c->add_option("--system", ch.system, "a system message to start the conversation with");

  TokenizeFlags tk;
  auto* t = app.add_subcommand("tokenize", "JSON lines on stdin: strings -> token ids, or ids -> text (--decode)");
  t->add_option("--tokenizer", tk.tokenizer, "a tokenizer.json, or a model folder holding one")->required();
  t->add_flag("--decode", tk.decode, "read arrays of ids, write strings");
  t->add_flag("--bench", tk.bench, "encode all of stdin (plain text) and print MB/s")->excludes("--decode");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*g)
      run_generate(gen);
    else if (*m)
      run_make_model(mk);
    else if (*i)
      run_inspect(in);
    else if (*bs)
      run_bench_serve(bsf);
    else if (*b)
      run_bench(bf);
    else if (*s)
      run_serve(sv);
    else if (*t)
      run_tokenize(tk);
    else if (*c)
      run_chat(ch);
    else if (*bo)
      run_allreduce_bench(bench_op_tp);
  } catch (const Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
