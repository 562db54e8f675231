#include "serve/metrics.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace tpmoe::serve {

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)), bucket_counts_(upper_bounds_.size(), 0) {
  TPMOE_CHECK(std::is_sorted(upper_bounds_.begin(), upper_bounds_.end()) &&
                  std::adjacent_find(upper_bounds_.begin(), upper_bounds_.end()) == upper_bounds_.end(),
              "histogram bucket bounds must increase strictly");
}

void Histogram::observe(double value) {
  const auto at = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value);  // first bound >= value
  if (at != upper_bounds_.end()) ++bucket_counts_[size_t(at - upper_bounds_.begin())];
  ++count_;
  sum_ += value;
}

std::vector<uint64_t> Histogram::counts() const {
  std::vector<uint64_t> cumulative(bucket_counts_.size());
  uint64_t running = 0;
  for (size_t i = 0; i < bucket_counts_.size(); ++i) cumulative[i] = running += bucket_counts_[i];
  return cumulative;
}

namespace {

// Bounds reach from a fast GPU step (a few ms per token) to a long queue on the CPU (minutes).
std::vector<double> ttft_buckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}
std::vector<double> tpot_buckets() {
  return {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
          0.2,   0.3,    0.4,   0.5,    0.75, 1.0,   2.5,  5.0,   7.5,  10.0, 20.0, 40.0,  80.0};
}
std::vector<double> e2e_buckets() {
  return {0.1,  0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,
          20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

void write_metric(std::string& out, const char* name, const char* type, const char* help, double value) {
  out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n{0} {3}\n", name, help, type, value);
}

void write_histogram(std::string& out, const char* name, const char* help, const Histogram& h) {
  out += fmt::format("# HELP {0} {1}\n# TYPE {0} histogram\n", name, help);
  const std::vector<uint64_t> counts = h.counts();
  for (size_t i = 0; i < counts.size(); ++i)
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, h.upper_bounds()[i], counts[i]);
  out += fmt::format("{0}_bucket{{le=\"+Inf\"}} {1}\n{0}_sum {2}\n{0}_count {1}\n", name, h.count(), h.sum());
}

}  // namespace

ServerMetrics::ServerMetrics() : ttft_(ttft_buckets()), tpot_(tpot_buckets()), e2e_(e2e_buckets()) {}

void ServerMetrics::record_first_token(double seconds) {
  std::lock_guard lock(mutex_);
  ttft_.observe(seconds);
}

void ServerMetrics::record_finished(const RequestTimings& t) {
  std::lock_guard lock(mutex_);
  if (t.completion_tokens > 1 && t.first_token >= 0)
    tpot_.observe((t.last_token - t.first_token) / double(t.completion_tokens - 1));
  if (t.last_token >= 0) e2e_.observe(t.last_token);
}

void ServerMetrics::record_response(int status) {
  std::lock_guard lock(mutex_);
  ++responses_[status];
}

std::string ServerMetrics::render(const ServeStats& s) const {
  std::string out;
  write_metric(out, "tpmoe_requests_running", "gauge", "Requests in the running batch (prefilling or decoding).",
               s.running);
  write_metric(out, "tpmoe_requests_waiting", "gauge", "Requests queued for KV-cache pages or a batch slot.",
               s.waiting);
  write_metric(out, "tpmoe_kv_pages_used", "gauge", "KV-cache pages held by requests.", s.kv_pages_used);
  write_metric(out, "tpmoe_kv_pages_total", "gauge", "KV-cache pages in the pool.", s.kv_pages_total);
  write_metric(out, "tpmoe_kv_page_size", "gauge", "Token positions per KV-cache page.", s.page_size);
  write_metric(out, "tpmoe_kv_cache_usage_ratio", "gauge", "Fraction of the KV-cache pages in use (0 to 1).",
               s.kv_pages_total > 0 ? double(s.kv_pages_used) / double(s.kv_pages_total) : 0.0);
  write_metric(out, "tpmoe_scheduler_steps_total", "counter", "Steps the scheduler has run.", double(s.steps));
  write_metric(out, "tpmoe_prompt_tokens_total", "counter", "Prompt tokens prefilled.", double(s.prompt_tokens));
  write_metric(out, "tpmoe_generation_tokens_total", "counter", "Tokens generated.", double(s.generated_tokens));
  write_metric(out, "tpmoe_requests_finished_total", "counter", "Requests that ended with stop or length.",
               double(s.finished));
  write_metric(out, "tpmoe_requests_aborted_total", "counter", "Requests cancelled before they ended (client gone).",
               double(s.aborted));
  write_metric(out, "tpmoe_preemptions_total", "counter",
               "Running requests sent back to the queue for want of KV-cache pages (recomputed when readmitted).",
               double(s.preemptions));
  std::lock_guard lock(mutex_);
  write_histogram(out, "tpmoe_time_to_first_token_seconds", "Time from a request's arrival to its first token.", ttft_);
  write_histogram(out, "tpmoe_time_per_output_token_seconds",
                  "Per finished request: time from its first to its last token over the tokens after the first.",
                  tpot_);
  write_histogram(out, "tpmoe_e2e_request_latency_seconds", "Time from a request's arrival to its last token.", e2e_);
  out +=
      "# HELP tpmoe_http_responses_total HTTP responses by status code.\n"
      "# TYPE tpmoe_http_responses_total counter\n";
  for (const auto& [status, n] : responses_)
    out += fmt::format("tpmoe_http_responses_total{{code=\"{}\"}} {}\n", status, n);
  return out;
}

}  // namespace tpmoe::serve
