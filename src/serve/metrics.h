// What /metrics reports, in Prometheus' text exposition format (version 0.0.4): the scheduler's
// state and totals (ServeStats) and the latencies the server measures per request.
//
// Latency histograms, per request that finished (not aborted):
//   tpmoe_time_to_first_token_seconds     arrival of the request -> its first token
//   tpmoe_time_per_output_token_seconds   (last token - first token) / (tokens - 1), tokens > 1
//   tpmoe_e2e_request_latency_seconds     arrival -> last token
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tpmoe/serving.h"

namespace tpmoe::serve {

// A cumulative histogram with fixed upper bounds (Prometheus buckets; +Inf implied).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  const std::vector<double>& upper_bounds() const { return upper_bounds_; }
  // counts()[i]: observations <= upper_bounds()[i] (cumulative); count() holds all, +Inf's bucket.
  std::vector<uint64_t> counts() const;
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> upper_bounds_;
  std::vector<uint64_t> bucket_counts_;  // per bucket, not cumulative
  uint64_t count_ = 0;
  double sum_ = 0;
};

// One request's timings, in seconds from its arrival.
struct RequestTimings {
  double first_token = -1;  // < 0: no token came
  double last_token = -1;
  int completion_tokens = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();
  // A request that got its first token (TTFT is recorded as soon as it is known).
  void record_first_token(double seconds);
  // A request that ended normally (stop or length): TPOT and end-to-end latency.
  void record_finished(const RequestTimings& timings);
  // Every HTTP response, by status code (errors included).
  void record_response(int status);

  // The exposition text: `stats` from the scheduler, the rest from what was recorded here.
  std::string render(const ServeStats& stats) const;

 private:
  mutable std::mutex mutex_;
  Histogram ttft_, tpot_, e2e_;
  std::map<int, uint64_t> responses_;
};

}  // namespace tpmoe::serve
