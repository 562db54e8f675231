// `tpmoe bench serve` (src/serve/bench_serve.h) against the HTTP server on a scripted scheduler:
// every request counted and timed, the token counts checked, failures counted with their messages,
// and a server that refuses everything stops it at the warm-up with the server's own message.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <thread>

#include "core/error.h"
#include "fake_scheduler.h"
#include "serve/bench_serve.h"
#include "serve/server.h"
#include "text/text_model.h"

namespace tpmoe::serve {
namespace {

using namespace std::chrono_literals;

class ServeBench : public ::testing::Test {
 protected:
  ServeBench() : text_(text::load_text_model("", 1024, {})) {
    ServeOptions options;
    options.max_context = 128;
    scheduler_ = std::make_unique<test::FakeScheduler>(
        options, 1024, [this](const std::vector<int32_t>&) { return text_.tokenizer.encode("abc"); }, 1ms);
    ServerOptions server_options;
    server_options.port = 0;
    server_options.served_model_name = "tiny";
    server_ = std::make_unique<OpenAIServer>(*scheduler_, text_, server_options);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->run(); });
  }
  ~ServeBench() override {
    server_->stop();
    thread_.join();
  }
  ServeBenchOptions options() const {
    ServeBenchOptions o;
    o.url = fmt::format("http://127.0.0.1:{}/v1/", port_);
    o.concurrencies = {1, 4};
    o.num_prompts = 8;
    o.input_len = 6;
    o.output_len = 5;
    o.progress = nullptr;
    return o;
  }

  text::TextModel text_;
  std::unique_ptr<test::FakeScheduler> scheduler_;
  std::unique_ptr<OpenAIServer> server_;
  int port_ = 0;
  std::thread thread_;
};

TEST_F(ServeBench, EveryRequestCountedAndTimed) {
  ServeBenchOptions o = options();
  o.output_len = 20;  // past the 3-token script: ignore_eos keeps it going
  const ServeBenchReport report = run_serve_bench(o);
  EXPECT_EQ(report.model, "tiny");
  EXPECT_EQ(report.vocab_size, 1024);
  ASSERT_EQ(report.rows.size(), 2u);
  for (const ServeBenchRow& row : report.rows) {
    EXPECT_EQ(row.requests, 8);
    EXPECT_EQ(row.completed, 8) << (row.errors.empty() ? "" : row.errors[0]);
    EXPECT_EQ(row.failed, 0);
    EXPECT_EQ(row.output_tokens, 8 * 20);
    EXPECT_EQ(row.input_tokens, 8 * 6);
    EXPECT_GT(row.duration_s, 0);
    EXPECT_NEAR(row.output_tokens_per_s, 160 / row.duration_s, 1e-9);
    EXPECT_GT(row.ttft_mean_ms, 0);
    EXPECT_GT(row.tpot_mean_ms, 0);
    EXPECT_LE(row.ttft_median_ms, row.ttft_p99_ms);
    EXPECT_LE(row.tpot_median_ms, row.tpot_p99_ms);
    // A scripted step is at least 1 ms, so tokens cannot come faster; a client that saw them much
    // faster got its first chunk late (a stream held back, as Nagle's algorithm did). The margin
    // is for a late first chunk on a busy machine, spread over 19 intervals.
    EXPECT_GE(row.tpot_mean_ms, 0.6);
  }
  EXPECT_EQ(report.failed(), 0);
  const std::string table = format_serve_bench(report);
  EXPECT_NE(table.find("TTFT p99"), std::string::npos) << table;
  const auto j = serve_bench_json(report);
  EXPECT_EQ(j["rows"].size(), 2u);
  EXPECT_EQ(j["rows"][1]["concurrency"], 4);
  EXPECT_EQ(j["rows"][1]["output_tokens"], 160);
}

TEST_F(ServeBench, FailuresAreCountedWithTheirMessages) {
  // Prompt ids below 8 hold the id the fake refuses in about half of the 6-token prompts; a seed
  // whose warm-up prompt happens to be clean runs the rest.
  ServeBenchOptions o = options();
  o.vocab_size = 8;
  o.concurrencies = {2};
  o.num_prompts = 16;
  for (o.seed = 0; o.seed < 50; ++o.seed) {
    ServeBenchReport report;
    try {
      report = run_serve_bench(o);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("warm-up"), std::string::npos) << e.what();
      continue;
    }
    const ServeBenchRow& row = report.rows.at(0);
    EXPECT_GT(row.failed, 0);
    EXPECT_EQ(row.failed + row.completed, 16);
    ASSERT_FALSE(row.errors.empty());
    EXPECT_NE(row.errors[0].find("HTTP 400"), std::string::npos) << row.errors[0];
    EXPECT_NE(row.errors[0].find("refuses"), std::string::npos) << row.errors[0];
    return;
  }
  FAIL() << "no seed gave a clean warm-up prompt";
}

TEST_F(ServeBench, WarmUpFailureStopsWithTheServersMessage) {
  ServeBenchOptions o = options();
  o.model = "not-served";
  try {
    run_serve_bench(o);
    FAIL() << "a bench against a model the server does not serve ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("404"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not-served"), std::string::npos) << e.what();
  }
  o = options();
  o.url = "127.0.0.1:1";
  EXPECT_THROW(run_serve_bench(o), Error);  // no scheme
}

}  // namespace
}  // namespace tpmoe::serve
