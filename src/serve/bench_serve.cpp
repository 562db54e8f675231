#include "serve/bench_serve.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "core/error.h"
#include "engine/bench.h"

namespace tpmoe::serve {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr size_t kErrorsKept = 5;

// "http://host:port", from a URL that may end in "/" or "/v1".
std::string base_url(std::string url) {
  while (!url.empty() && url.back() == '/') url.pop_back();
  if (url.ends_with("/v1")) url.resize(url.size() - 3);
  TPMOE_CHECK(url.starts_with("http://") || url.starts_with("https://"),
              "bench serve: --url must start with http:// or https://, got '{}'", url);
  return url;
}

std::unique_ptr<httplib::Client> make_client(const std::string& url, double timeout_s) {
  auto client = std::make_unique<httplib::Client>(url);
  TPMOE_CHECK(client->is_valid(), "bench serve: cannot make a client for '{}'", url);
  client->set_connection_timeout(10);
  const auto timeout = std::chrono::duration<double>(timeout_s);
  client->set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  client->set_write_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  client->set_keep_alive(true);
  client->set_tcp_nodelay(true);
  return client;
}

struct ServerInfo {
  std::string model;
  int vocab_size = 0;  // 0: the server does not say
};

ServerInfo query_server(const std::string& url, double timeout_s) {
  auto client = make_client(url, timeout_s);
  const httplib::Result r = client->Get("/v1/models");
  TPMOE_CHECK(r, "bench serve: GET {}/v1/models failed: {}", url, httplib::to_string(r.error()));
  TPMOE_CHECK(r->status == 200, "bench serve: GET {}/v1/models answered {}: {}", url, r->status, r->body);
  ServerInfo info;
  try {
    const json j = json::parse(r->body);
    const json& first = j.at("data").at(0);
    info.model = first.at("id").get<std::string>();
    if (first.contains("vocab_size") && first["vocab_size"].is_number_integer())
      info.vocab_size = first["vocab_size"].get<int>();
  } catch (const std::exception& e) {
    TPMOE_FAIL("bench serve: {}/v1/models does not list a model: {}", url, e.what());
  }
  return info;
}

struct Outcome {
  bool ok = false;
  std::string error;
  double ttft_s = 0, e2e_s = 0;
  int output_tokens = 0;
};

// Reads a server-sent event stream as it arrives: events end at a blank line; each "data:" line's
// payload is handed on.
class SseReader {
 public:
  template <typename OnData>
  void feed(const char* data, size_t size, OnData&& on_data) {
    buffer_.append(data, size);
    for (;;) {
      size_t end = buffer_.find("\n\n");
      size_t skip = 2;
      const size_t crlf = buffer_.find("\r\n\r\n");
      if (crlf != std::string::npos && (end == std::string::npos || crlf < end)) end = crlf, skip = 4;
      if (end == std::string::npos) return;
      const std::string event = buffer_.substr(0, end);
      buffer_.erase(0, end + skip);
      size_t line_start = 0;
      while (line_start <= event.size()) {
        size_t line_end = event.find('\n', line_start);
        if (line_end == std::string::npos) line_end = event.size();
        std::string line = event.substr(line_start, line_end - line_start);
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.starts_with("data:")) {
          std::string payload = line.substr(5);
          if (!payload.empty() && payload[0] == ' ') payload.erase(0, 1);
          on_data(payload);
        }
        line_start = line_end + 1;
      }
    }
  }
  const std::string& unread() const { return buffer_; }

 private:
  std::string buffer_;
};

Outcome send_request(httplib::Client& client, const std::string& body, int expected_tokens) {
  Outcome out;
  int status = 0;
  std::string error_body;
  bool done = false, first = true;
  int usage_tokens = -1;
  SseReader sse;
  const Clock::time_point start = Clock::now();

  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
  req.body = body;
  req.response_handler = [&](const httplib::Response& r) {
    status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    if (status != 200) {
      error_body.append(data, size);
      return true;
    }
    sse.feed(data, size, [&](const std::string& payload) {
      if (payload == "[DONE]") {
        done = true;
        return;
      }
      json j;
      try {
        j = json::parse(payload);
      } catch (const std::exception& e) {
        if (out.error.empty()) out.error = fmt::format("an event is not JSON: {}", payload.substr(0, 200));
        return;
      }
      if (j.contains("error")) {
        if (out.error.empty()) out.error = fmt::format("error event: {}", j["error"].dump());
        return;
      }
      const Clock::time_point now = Clock::now();
      if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
        if (first) out.ttft_s = std::chrono::duration<double>(now - start).count(), first = false;
        out.e2e_s = std::chrono::duration<double>(now - start).count();
      }
      if (j.contains("usage") && j["usage"].is_object()) usage_tokens = j["usage"].value("completion_tokens", -1);
    });
    return true;
  };
  const httplib::Result result = client.send(req);
  if (!result) {
    out.error = fmt::format("request failed: {}", httplib::to_string(result.error()));
    return out;
  }
  if (status != 200) {
    out.error = fmt::format("HTTP {}: {}", status, error_body.substr(0, 500));
    return out;
  }
  if (!out.error.empty()) return out;
  if (!done) {
    out.error = "the stream ended without data: [DONE]";
    return out;
  }
  if (usage_tokens != expected_tokens) {
    out.error = usage_tokens < 0 ? std::string("the stream carried no usage")
                                 : fmt::format("{} tokens generated, {} asked for", usage_tokens, expected_tokens);
    return out;
  }
  out.output_tokens = usage_tokens;
  out.ok = true;
  return out;
}

std::string request_body(const std::string& model, const std::vector<int32_t>& prompt, int output_len) {
  return json{{"model", model},
              {"prompt", prompt},
              {"max_tokens", output_len},
              {"temperature", 0},
              {"ignore_eos", true},
              {"stream", true},
              {"stream_options", {{"include_usage", true}}}}
      .dump();
}

std::vector<int32_t> random_prompt(std::mt19937_64& rng, int length, int vocab_size) {
  std::uniform_int_distribution<int32_t> id(0, vocab_size - 1);
  std::vector<int32_t> p(static_cast<size_t>(length));
  for (int32_t& t : p) t = id(rng);
  return p;
}

void fill_stats(ServeBenchRow& row, const std::vector<Outcome>& outcomes) {
  std::vector<double> ttft, tpot, e2e;
  for (const Outcome& o : outcomes) {
    if (!o.ok) continue;
    ttft.push_back(o.ttft_s * 1e3);
    e2e.push_back(o.e2e_s * 1e3);
    if (o.output_tokens > 1) tpot.push_back((o.e2e_s - o.ttft_s) * 1e3 / double(o.output_tokens - 1));
  }
  auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()); };
  if (!ttft.empty()) {
    row.ttft_mean_ms = mean(ttft);
    row.ttft_median_ms = percentile(ttft, 50);
    row.ttft_p99_ms = percentile(ttft, 99);
    row.e2e_mean_ms = mean(e2e);
  }
  if (!tpot.empty()) {
    row.tpot_mean_ms = mean(tpot);
    row.tpot_median_ms = percentile(tpot, 50);
    row.tpot_p99_ms = percentile(tpot, 99);
  }
}

ServeBenchRow run_concurrency(const ServeBenchOptions& o, const std::string& url, const std::string& model,
                              int vocab_size, int concurrency) {
  TPMOE_CHECK(concurrency >= 1, "bench serve: a concurrency must be at least 1, got {}", concurrency);
  const int n = o.num_prompts.value_or(std::max(4 * concurrency, 16));
  std::vector<std::string> bodies;
  std::mt19937_64 rng(o.seed ^ (uint64_t(concurrency) << 32));
  for (int i = 0; i < n; ++i)
    bodies.push_back(request_body(model, random_prompt(rng, o.input_len, vocab_size), o.output_len));

  std::vector<Outcome> outcomes(static_cast<size_t>(n));
  std::atomic<int> next{0};
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> clients;
  for (int c = 0; c < std::min(concurrency, n); ++c)
    clients.emplace_back([&] {
      auto client = make_client(url, o.timeout_s);
      for (int i; (i = next++) < n;) outcomes[size_t(i)] = send_request(*client, bodies[size_t(i)], o.output_len);
    });
  for (auto& t : clients) t.join();

  ServeBenchRow row;
  row.concurrency = concurrency;
  row.requests = n;
  row.duration_s = std::chrono::duration<double>(Clock::now() - start).count();
  for (const Outcome& out : outcomes) {
    if (out.ok) {
      ++row.completed;
      row.input_tokens += o.input_len;
      row.output_tokens += out.output_tokens;
    } else {
      ++row.failed;
      if (row.errors.size() < kErrorsKept) row.errors.push_back(out.error);
    }
  }
  row.request_rate = double(row.completed) / row.duration_s;
  row.output_tokens_per_s = double(row.output_tokens) / row.duration_s;
  row.total_tokens_per_s = double(row.input_tokens + row.output_tokens) / row.duration_s;
  fill_stats(row, outcomes);
  return row;
}

}  // namespace

int ServeBenchReport::failed() const {
  int n = 0;
  for (const auto& r : rows) n += r.failed;
  return n;
}

ServeBenchReport run_serve_bench(const ServeBenchOptions& o) {
  TPMOE_CHECK(!o.concurrencies.empty(), "bench serve: no concurrency given");
  TPMOE_CHECK(o.input_len >= 1, "bench serve: --input-len must be at least 1, got {}", o.input_len);
  TPMOE_CHECK(o.output_len >= 1, "bench serve: --output-len must be at least 1, got {}", o.output_len);
  TPMOE_CHECK(!o.num_prompts || *o.num_prompts >= 1, "bench serve: --num-prompts must be at least 1");
  ServeBenchReport report;
  report.url = base_url(o.url);
  const ServerInfo info = query_server(report.url, o.timeout_s);
  report.model = o.model.empty() ? info.model : o.model;
  report.vocab_size = o.vocab_size.value_or(info.vocab_size);
  TPMOE_CHECK(report.vocab_size > 0, "bench serve: {}/v1/models gives no vocab_size: give --vocab-size", report.url);
  report.input_len = o.input_len;
  report.output_len = o.output_len;

  // Warm-up (untimed): also fails fast, with the server's own message, when nothing would work.
  {
    auto client = make_client(report.url, o.timeout_s);
    std::mt19937_64 rng(o.seed ^ 0x5eedull);
    const Outcome warm = send_request(
        *client, request_body(report.model, random_prompt(rng, o.input_len, report.vocab_size), o.output_len),
        o.output_len);
    TPMOE_CHECK(warm.ok, "bench serve: the warm-up request to {} failed: {}", report.url, warm.error);
  }
  for (int c : o.concurrencies) {
    if (o.progress)
      std::fprintf(o.progress, "bench serve: concurrency %d, %d requests ...\n", c,
                   o.num_prompts.value_or(std::max(4 * c, 16)));
    report.rows.push_back(run_concurrency(o, report.url, report.model, report.vocab_size, c));
  }
  return report;
}

std::string format_serve_bench(const ServeBenchReport& r) {
  std::string out = fmt::format("bench serve: {} model '{}', {} prompt tokens (random ids), {} output tokens\n", r.url,
                                r.model, r.input_len, r.output_len);
  out += fmt::format("{:>5} {:>9} {:>6} {:>9} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "conc",
                     "requests", "failed", "duration", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p99",
                     "TPOT mean", "TPOT p50", "TPOT p99");
  out += fmt::format("{:>5} {:>9} {:>6} {:>9} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "", "", "", "s",
                     "", "", "ms", "ms", "ms", "ms", "ms", "ms");
  for (const ServeBenchRow& row : r.rows)
    out += fmt::format(
        "{:>5} {:>9} {:>6} {:>9.2f} {:>8.2f} {:>9.1f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f}\n",
        row.concurrency, row.requests, row.failed, row.duration_s, row.request_rate, row.output_tokens_per_s,
        row.ttft_mean_ms, row.ttft_median_ms, row.ttft_p99_ms, row.tpot_mean_ms, row.tpot_median_ms, row.tpot_p99_ms);
  for (const ServeBenchRow& row : r.rows)
    for (const std::string& e : row.errors) out += fmt::format("failed (concurrency {}): {}\n", row.concurrency, e);
  return out;
}

nlohmann::json serve_bench_json(const ServeBenchReport& r) {
  json rows = json::array();
  for (const ServeBenchRow& row : r.rows)
    rows.push_back({{"concurrency", row.concurrency},
                    {"requests", row.requests},
                    {"completed", row.completed},
                    {"failed", row.failed},
                    {"duration_s", row.duration_s},
                    {"input_tokens", row.input_tokens},
                    {"output_tokens", row.output_tokens},
                    {"request_rate", row.request_rate},
                    {"output_tokens_per_s", row.output_tokens_per_s},
                    {"total_tokens_per_s", row.total_tokens_per_s},
                    {"ttft_mean_ms", row.ttft_mean_ms},
                    {"ttft_median_ms", row.ttft_median_ms},
                    {"ttft_p99_ms", row.ttft_p99_ms},
                    {"tpot_mean_ms", row.tpot_mean_ms},
                    {"tpot_median_ms", row.tpot_median_ms},
                    {"tpot_p99_ms", row.tpot_p99_ms},
                    {"e2e_mean_ms", row.e2e_mean_ms},
                    {"errors", row.errors}});
  return {{"url", r.url},
          {"model", r.model},
          {"input_len", r.input_len},
          {"output_len", r.output_len},
          {"vocab_size", r.vocab_size},
          {"rows", rows}};
}

}  // namespace tpmoe::serve
