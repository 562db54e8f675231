// /metrics (src/serve/metrics.h): histograms count into the right cumulative buckets, and the
// exposition is well-formed Prometheus text carrying the scheduler's numbers.
#include <gtest/gtest.h>

#include "core/error.h"
#include "prometheus_check.h"
#include "serve/metrics.h"

namespace tpmoe::serve {
namespace {

TEST(ServeMetrics, HistogramBucketsAreCumulative) {
  Histogram h({0.1, 1, 10});
  for (double v : {0.05, 0.1, 0.5, 2.0, 20.0, 30.0}) h.observe(v);
  EXPECT_EQ(h.counts(), (std::vector<uint64_t>{2, 3, 4}));  // le is inclusive: 0.1 counts in le=0.1
  EXPECT_EQ(h.count(), 6u);
  EXPECT_NEAR(h.sum(), 52.65, 1e-12);
  EXPECT_THROW(Histogram({1, 1}), Error);
  EXPECT_THROW(Histogram({2, 1}), Error);
}

TEST(ServeMetrics, ExpositionIsWellFormed) {
  ServerMetrics m;
  m.record_first_token(0.02);
  m.record_first_token(3.0);
  m.record_finished({0.02, 0.52, 11});  // TPOT 0.05
  m.record_finished({0.5, 0.5, 1});     // one token: no TPOT
  m.record_response(200);
  m.record_response(200);
  m.record_response(400);
  ServeStats s;
  s.running = 3, s.waiting = 2, s.kv_pages_used = 10, s.kv_pages_total = 40, s.page_size = 16;
  s.steps = 99, s.prompt_tokens = 1000, s.generated_tokens = 500, s.finished = 7, s.aborted = 1, s.preemptions = 4;

  const test::PromExposition e = test::parse_prometheus(m.render(s));
  EXPECT_EQ(e.value("tpmoe_requests_running"), 3);
  EXPECT_EQ(e.value("tpmoe_requests_waiting"), 2);
  EXPECT_EQ(e.value("tpmoe_kv_pages_used"), 10);
  EXPECT_EQ(e.value("tpmoe_kv_pages_total"), 40);
  EXPECT_EQ(e.value("tpmoe_kv_cache_usage_ratio"), 0.25);
  EXPECT_EQ(e.value("tpmoe_prompt_tokens_total"), 1000);
  EXPECT_EQ(e.value("tpmoe_generation_tokens_total"), 500);
  EXPECT_EQ(e.value("tpmoe_requests_finished_total"), 7);
  EXPECT_EQ(e.value("tpmoe_requests_aborted_total"), 1);
  EXPECT_EQ(e.value("tpmoe_preemptions_total"), 4);
  EXPECT_EQ(e.type.at("tpmoe_requests_aborted_total"), "counter");
  EXPECT_EQ(e.type.at("tpmoe_kv_pages_used"), "gauge");
  EXPECT_EQ(e.value("tpmoe_time_to_first_token_seconds_count"), 2);
  EXPECT_EQ(e.value("tpmoe_time_to_first_token_seconds_bucket", {{"le", "0.02"}}), 1);
  EXPECT_EQ(e.value("tpmoe_time_per_output_token_seconds_count"), 1);
  EXPECT_NEAR(*e.value("tpmoe_time_per_output_token_seconds_sum"), 0.05, 1e-12);
  EXPECT_EQ(e.value("tpmoe_e2e_request_latency_seconds_count"), 2);
  EXPECT_EQ(e.value("tpmoe_http_responses_total", {{"code", "200"}}), 2);
  EXPECT_EQ(e.value("tpmoe_http_responses_total", {{"code", "400"}}), 1);
}

TEST(ServeMetrics, EmptyPoolHasZeroUsage) {
  const test::PromExposition e = test::parse_prometheus(ServerMetrics().render(ServeStats{}));
  EXPECT_EQ(e.value("tpmoe_kv_cache_usage_ratio"), 0);
  EXPECT_EQ(e.value("tpmoe_e2e_request_latency_seconds_count"), 0);
}

}  // namespace
}  // namespace tpmoe::serve
