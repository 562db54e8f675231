// `tpmoe bench serve`: a load generator for an OpenAI-compatible server, shaped like vLLM's
// `bench serve` with its random dataset, so the numbers read the same way.
//
// Protocol, per concurrency C:
//   - N requests (default max(4 C, 16)), at most C in flight (C client threads, each sending its
//     next request when the last one ends: a closed loop, no request-rate schedule);
//   - each: POST /v1/completions with a prompt of input_len random token ids (drawn from the
//     server's vocabulary, seeded), max_tokens = output_len, ignore_eos (every reply has exactly
//     output_len tokens), stream with include_usage;
//   - TTFT = send -> first streamed chunk (the server sends one per step that adds tokens);
//     TPOT = (e2e - TTFT) / (tokens - 1), per request; e2e = send -> the last chunk;
//   - duration = the first send -> the last reply; request rate = completed / duration; output
//     tokens/s = output tokens / duration;
//   - a request fails on a transport error, a status other than 200, an error event, or a reply
//     whose usage is not output_len tokens; failures are counted and reported, not timed.
// One untimed request runs first (a warm-up, and a check that the server answers at all).
#pragma once

#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace tpmoe::serve {

struct ServeBenchOptions {
  std::string url;  // http://host:port (a trailing /v1 is allowed)
  std::vector<int> concurrencies = {1, 16, 64};
  std::optional<int> num_prompts;  // per concurrency; unset: max(4 * concurrency, 16)
  int input_len = 128;
  int output_len = 64;
  std::string model;              // empty: the one the server lists (GET /v1/models)
  std::optional<int> vocab_size;  // prompt ids are drawn below it; unset: the server's (/v1/models)
  uint64_t seed = 0;              // of the prompts
  double timeout_s = 3600;        // per request
  std::FILE* progress = stderr;   // progress lines; nullptr: quiet
};

struct ServeBenchRow {
  int concurrency = 0;
  int requests = 0, completed = 0, failed = 0;
  double duration_s = 0;
  int64_t input_tokens = 0, output_tokens = 0;
  double request_rate = 0;  // completed requests per second
  double output_tokens_per_s = 0;
  double total_tokens_per_s = 0;  // input + output tokens per second
  double ttft_mean_ms = 0, ttft_median_ms = 0, ttft_p99_ms = 0;
  double tpot_mean_ms = 0, tpot_median_ms = 0, tpot_p99_ms = 0;
  double e2e_mean_ms = 0;
  std::vector<std::string> errors;  // the first few failures' messages
};

struct ServeBenchReport {
  std::string url, model;
  int input_len = 0, output_len = 0, vocab_size = 0;
  std::vector<ServeBenchRow> rows;
  int failed() const;
};

ServeBenchReport run_serve_bench(const ServeBenchOptions& options);
std::string format_serve_bench(const ServeBenchReport& report);
nlohmann::json serve_bench_json(const ServeBenchReport& report);

}  // namespace tpmoe::serve
