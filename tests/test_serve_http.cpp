// The HTTP server (src/serve/server.h) against a scripted scheduler (fake_scheduler.h): replies and
// their usage, the server-sent event stream (format, chunks, [DONE], include_usage), reasoning
// apart from content, stop strings, every bad request a 4xx with OpenAI's error JSON and the server
// still answering after it, a client gone mid-stream cancelled with its pages freed, 64 streams at
// once, /metrics, and a clean stop with streams in flight.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "fake_scheduler.h"
#include "prometheus_check.h"
#include "serve/server.h"
#include "test_util.h"
#include "text/text_model.h"

namespace tpmoe::serve {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kVocab = 1024;
constexpr int kContext = 256;

// A server on a free port in front of a FakeScheduler whose replies are the text `reply`.
class ServeHttp : public ::testing::Test {
 protected:
  // `chat_template` non-empty: the model's template instead of the preset's (same tokenizer).
  explicit ServeHttp(std::chrono::microseconds step = 1ms, const std::string& chat_template = "",
                     int context = kContext)
      : text_(text::load_text_model("", kVocab, {})) {
    if (!chat_template.empty()) text_.chat_template = text::ChatTemplate::parse(chat_template);
    ServeOptions options;
    options.max_context = context;
    options.max_batch = 64;
    options.page_size = 16;
    scheduler_ = std::make_unique<test::FakeScheduler>(
        options, kVocab, [this](const std::vector<int32_t>&) { return text_.tokenizer.encode(reply_); }, step);
    ServerOptions server_options;
    server_options.port = 0;
    server_options.served_model_name = "tiny";
    server_ = std::make_unique<OpenAIServer>(*scheduler_, text_, server_options);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->run(); });
  }
  ~ServeHttp() override {
    server_->stop();
    thread_.join();
  }

  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(30s);
    return c;
  }
  httplib::Result post(const std::string& path, const json& body) const {
    return client().Post(path, body.dump(), "application/json");
  }
  void expect_healthy() const {
    const auto r = client().Get("/health");
    ASSERT_TRUE(r) << "the server stopped answering";
    EXPECT_EQ(r->status, 200);
  }
  // A 4xx with OpenAI's error object (a message, type invalid_request_error), the server still up.
  json expect_error(const httplib::Result& r, int status, const std::string& context) const {
    EXPECT_TRUE(r) << context << ": no response (" << (r ? "" : httplib::to_string(r.error())) << ")";
    if (!r) return {};
    EXPECT_EQ(r->status, status) << context << ": " << r->body;
    json j;
    try {
      j = json::parse(r->body);
    } catch (const std::exception& e) {
      ADD_FAILURE() << context << ": the error body is not JSON: " << r->body;
      return {};
    }
    EXPECT_TRUE(j.contains("error")) << context << ": " << r->body;
    EXPECT_TRUE(j["error"]["message"].is_string() && !j["error"]["message"].get<std::string>().empty()) << r->body;
    EXPECT_EQ(j["error"]["type"], "invalid_request_error") << r->body;
    EXPECT_TRUE(j["error"].contains("param") && j["error"].contains("code")) << r->body;
    expect_healthy();
    return j;
  }

  text::TextModel text_;
  std::string reply_ = "Hello world, this is the scripted reply.";
  std::unique_ptr<test::FakeScheduler> scheduler_;
  std::unique_ptr<OpenAIServer> server_;
  int port_ = 0;
  std::thread thread_;
};

// The events of a server-sent event stream: each "data: <payload>\n\n"; the last must be [DONE].
std::vector<json> parse_sse(const std::string& body) {
  std::vector<json> events;
  size_t at = 0;
  bool done = false;
  while (at < body.size()) {
    const size_t end = body.find("\n\n", at);
    EXPECT_NE(end, std::string::npos) << "unterminated event: " << body.substr(at);
    if (end == std::string::npos) break;
    const std::string event = body.substr(at, end - at);
    at = end + 2;
    EXPECT_TRUE(event.starts_with("data: ")) << event;
    EXPECT_FALSE(done) << "an event after [DONE]: " << event;
    if (event == "data: [DONE]") {
      done = true;
      continue;
    }
    events.push_back(json::parse(event.substr(6)));
  }
  EXPECT_TRUE(done) << "no data: [DONE]";
  return events;
}

TEST_F(ServeHttp, ModelsAndHealth) {
  expect_healthy();
  const auto r = client().Get("/v1/models");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["data"][0]["id"], "tiny");
  EXPECT_EQ(j["data"][0]["max_model_len"], kContext);
  EXPECT_EQ(j["data"][0]["vocab_size"], kVocab);
  const auto one = client().Get("/v1/models/tiny");
  ASSERT_TRUE(one);
  EXPECT_EQ(one->status, 200);
  expect_error(client().Get("/v1/models/other"), 404, "unknown model card");
}

TEST_F(ServeHttp, CompletionWithUsage) {
  const auto r = post("/v1/completions", {{"model", "tiny"}, {"prompt", "Say hello"}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_TRUE(j["id"].get<std::string>().starts_with("cmpl-"));
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_EQ(j["choices"][0]["text"], reply_);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");  // the script ran out: EOS
  const int prompt_tokens = int(text_.tokenizer.encode("Say hello").size());
  const int reply_tokens = int(text_.tokenizer.encode(reply_).size());
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(j["usage"]["completion_tokens"], reply_tokens + 1);  // the EOS id counts, its text does not
  EXPECT_EQ(j["usage"]["total_tokens"], prompt_tokens + reply_tokens + 1);
}

TEST_F(ServeHttp, CompletionFromTokenIdsCutByMaxTokens) {
  const auto r = post("/v1/completions", {{"prompt", {1, 2, 3, 4}}, {"max_tokens", 3}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const auto ids = text_.tokenizer.encode(reply_);
  EXPECT_EQ(j["choices"][0]["text"], text_.tokenizer.decode(std::vector<int32_t>(ids.begin(), ids.begin() + 3)));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(j["usage"]["completion_tokens"], 3);
}

TEST_F(ServeHttp, StopStringCutsTheReply) {
  const auto r = post("/v1/completions", {{"prompt", "x"}, {"stop", {"this"}}});
  ASSERT_TRUE(r);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["choices"][0]["text"], "Hello world, ");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServeHttp, ChatSplitsReasoningFromContent) {
  // The preset template opens <think> for the reply, so the reply starts inside it.
  reply_ = "weighing it up</think>\n\nThe answer is 4.";
  const auto r = post("/v1/chat/completions",
                      {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "What is 2 + 2?"}}}}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_TRUE(j["id"].get<std::string>().starts_with("chatcmpl-"));
  const json& message = j["choices"][0]["message"];
  EXPECT_EQ(message["role"], "assistant");
  EXPECT_EQ(message["reasoning_content"], "weighing it up");
  EXPECT_EQ(message["content"], "\n\nThe answer is 4.");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  text::ChatRequest chat;
  chat.messages = {{{"role", "user"}, {"content", "What is 2 + 2?"}}};
  EXPECT_EQ(j["usage"]["prompt_tokens"], text_.tokenizer.encode(text_.render_chat(chat)).size());
}

TEST_F(ServeHttp, StreamedChatChunks) {
  reply_ = "hmm, let me see</think>It is four, I think.";
  const auto r = post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "2 + 2?"}}}},
                                               {"stream", true},
                                               {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  const std::vector<json> events = parse_sse(r->body);
  ASSERT_GE(events.size(), 4u);
  // First: the role; then text deltas; then the finish; then the usage.
  EXPECT_EQ(events.front()["choices"][0]["delta"]["role"], "assistant");
  std::string reasoning, content, finish;
  int content_chunks = 0;
  std::string id = events.front()["id"];
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json& e = events[i];
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    EXPECT_EQ(e["id"], id);
    EXPECT_EQ(e["model"], "tiny");
    EXPECT_TRUE(e.contains("usage") && e["usage"].is_null());
    const json& delta = e["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
    if (delta.contains("content")) content += delta["content"].get<std::string>(), ++content_chunks;
    if (!e["choices"][0]["finish_reason"].is_null()) {
      EXPECT_EQ(i, events.size() - 2) << "the finish is not the last choice chunk";
      finish = e["choices"][0]["finish_reason"];
    }
  }
  EXPECT_EQ(reasoning, "hmm, let me see");
  EXPECT_EQ(content, "It is four, I think.");
  EXPECT_GT(content_chunks, 3) << "the content came in one piece, not streamed";
  EXPECT_EQ(finish, "stop");
  const json& usage = events.back();
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], text_.tokenizer.encode(reply_).size() + 1);
  EXPECT_EQ(usage["usage"]["total_tokens"],
            usage["usage"]["prompt_tokens"].get<int>() + usage["usage"]["completion_tokens"].get<int>());
}

TEST_F(ServeHttp, StreamedCompletionChunks) {
  // Python's clients ask for compression; a compressed stream would arrive in compressor-sized
  // blocks, not per token, so the stream must go uncompressed.
  const auto r = client().Post("/v1/completions", {{"Accept-Encoding", "gzip, deflate, br"}},
                               json{{"prompt", "p"}, {"max_tokens", 5}, {"stream", true}}.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_FALSE(r->has_header("Content-Encoding")) << r->get_header_value("Content-Encoding");
  const std::vector<json> events = parse_sse(r->body);
  ASSERT_EQ(events.size(), 6u);  // one chunk per token, then the finish; no usage chunk unless asked
  std::string text;
  for (const json& e : events) {
    EXPECT_EQ(e["object"], "text_completion");
    EXPECT_FALSE(e.contains("usage"));
    text += e["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "length");
  const auto ids = text_.tokenizer.encode(reply_);
  EXPECT_EQ(text, text_.tokenizer.decode(std::vector<int32_t>(ids.begin(), ids.begin() + 5)));
}

TEST_F(ServeHttp, BadRequestsGetErrorsAndTheServerStaysUp) {
  auto raw = [&](const std::string& path, const std::string& body) {
    return client().Post(path, body, "application/json");
  };
  expect_error(raw("/v1/completions", "{\"prompt\": "), 400, "malformed JSON");
  expect_error(raw("/v1/chat/completions", "not json at all"), 400, "malformed JSON (chat)");
  expect_error(raw("/v1/completions", "[1, 2]"), 400, "not an object");
  const json unknown = expect_error(post("/v1/completions", {{"model", "gpt-4"}, {"prompt", "x"}}), 404, "model");
  EXPECT_EQ(unknown["error"]["param"], "model");
  EXPECT_EQ(unknown["error"]["code"], "model_not_found");
  const json too_long =
      expect_error(post("/v1/completions", {{"prompt", std::vector<int>(kContext, 1)}}), 400, "prompt too long");
  EXPECT_EQ(too_long["error"]["code"], "context_length_exceeded");
  const json over = expect_error(post("/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", kContext}}), 400,
                                 "prompt + max_tokens over the context");
  EXPECT_EQ(over["error"]["param"], "max_tokens");
  for (int bad : {0, -1})
    EXPECT_EQ(expect_error(post("/v1/completions", {{"prompt", "x"}, {"max_tokens", bad}}), 400,
                           "max_tokens " + std::to_string(bad))["error"]["param"],
              "max_tokens");
  // A chat request takes either name; the error names the one it sent.
  for (const char* name : {"max_completion_tokens", "max_tokens"}) {
    const json e =
        expect_error(post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {name, 0}}),
                     400, std::string(name) + " 0 (chat)");
    EXPECT_EQ(e["error"]["param"], name);
    EXPECT_NE(e["error"]["message"].get<std::string>().find(std::string("'") + name + "'"), std::string::npos)
        << e.dump();
  }
  const json cold = expect_error(post("/v1/completions", {{"prompt", "x"}, {"temperature", -0.5}}), 400, "temperature");
  EXPECT_EQ(cold["error"]["param"], "temperature");
  EXPECT_NE(cold["error"]["message"].get<std::string>().find("temperature"), std::string::npos);
  expect_error(post("/v1/completions", {{"prompt", "x"}, {"top_p", 0}}), 400, "top_p 0");
  expect_error(post("/v1/completions", {{"prompt", "x"}, {"n", 3}}), 400, "n 3");
  expect_error(post("/v1/completions", {{"prompt", {1, kVocab}}}), 400, "id outside the vocabulary");
  expect_error(post("/v1/completions", {{"prompt", ""}}), 400, "empty prompt");
  expect_error(post("/v1/completions", {{"prompt", "x"}, {"stop_token_ids", {kVocab + 5}}}), 400, "stop id");
  EXPECT_EQ(expect_error(post("/v1/completions",
                              {{"prompt", "x"}, {"stop", std::vector<std::string>(kMaxStopStrings + 1, "x")}}),
                         400, "too many stop strings")["error"]["param"],
            "stop");
  EXPECT_EQ(expect_error(post("/v1/completions",
                              {{"prompt", "x"}, {"stop_token_ids", std::vector<int>(kMaxStopTokenIds + 1, 1)}}),
                         400, "too many stop token ids")["error"]["param"],
            "stop_token_ids");
  expect_error(post("/v1/chat/completions", {{"messages", {{{"role", "robot"}, {"content", "x"}}}}}), 400,
               "a role the template refuses");
  // What only the scheduler knows can never run: its message, as a 400.
  const json refused =
      expect_error(post("/v1/completions", {{"prompt", {1, test::FakeScheduler::kRefusedId}}}), 400, "submit refused");
  EXPECT_NE(refused["error"]["message"].get<std::string>().find("refuses"), std::string::npos);
  // Paths and methods.
  expect_error(client().Get("/v1/nothing"), 404, "unknown path");
  const auto wrong_method = client().Get("/v1/completions");
  expect_error(wrong_method, 405, "GET on a POST endpoint");
  EXPECT_EQ(wrong_method->get_header_value("Allow"), "POST");
  expect_error(raw("/health", "{}"), 405, "POST on a GET endpoint");
}

TEST_F(ServeHttp, HugeBodyIs413) {
  const std::string huge(100u << 20, 'a');  // 100 MB, the limit is 8 MB
  expect_error(client().Post("/v1/completions", huge, "application/json"), 413, "100 MB body");
}

TEST_F(ServeHttp, ClientGoneMidStreamIsCancelledAndItsPagesFreed) {
  reply_ = std::string(200, 'x');  // a long reply: the stream is still going when the client leaves
  httplib::Client c = client();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = json{{"prompt", "x"}, {"stream", true}}.dump();
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };  // leave after 3
  const auto r = c.send(req);
  EXPECT_FALSE(r);  // the client cancelled
  EXPECT_EQ(chunks, 3);
  c.stop();
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (scheduler_->cancel_calls().empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  ASSERT_EQ(scheduler_->cancel_calls().size(), 1u) << "the server did not cancel the request of a client gone";
  while ((scheduler_->stats().running > 0) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  const auto m = client().Get("/metrics");
  ASSERT_TRUE(m);
  const test::PromExposition e = test::parse_prometheus(m->body);
  EXPECT_EQ(e.value("tpmoe_kv_pages_used"), 0);
  EXPECT_EQ(e.value("tpmoe_requests_aborted_total"), 1);
  EXPECT_EQ(e.value("tpmoe_requests_running"), 0);
  expect_healthy();
}

TEST_F(ServeHttp, MetricsAfterTraffic) {
  for (int i = 0; i < 3; ++i) ASSERT_EQ(post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 4}})->status, 200);
  expect_error(post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 0}}), 400, "a 400 to count");
  const auto r = client().Get("/metrics");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_TRUE(r->get_header_value("Content-Type").starts_with("text/plain; version=0.0.4"));
  const test::PromExposition e = test::parse_prometheus(r->body);
  for (const char* name :
       {"tpmoe_requests_running", "tpmoe_requests_waiting", "tpmoe_kv_pages_used", "tpmoe_kv_pages_total",
        "tpmoe_kv_cache_usage_ratio", "tpmoe_prompt_tokens_total", "tpmoe_generation_tokens_total",
        "tpmoe_requests_finished_total", "tpmoe_requests_aborted_total"})
    EXPECT_TRUE(e.value(name).has_value()) << name;
  EXPECT_EQ(e.value("tpmoe_requests_finished_total"), 3);
  EXPECT_EQ(e.value("tpmoe_generation_tokens_total"), 12);
  EXPECT_EQ(e.value("tpmoe_kv_pages_total"), 64 * kContext / 16);
  EXPECT_EQ(e.value("tpmoe_time_to_first_token_seconds_count"), 3);
  EXPECT_EQ(e.value("tpmoe_time_per_output_token_seconds_count"), 3);
  EXPECT_EQ(e.value("tpmoe_e2e_request_latency_seconds_count"), 3);
  EXPECT_GE(*e.value("tpmoe_http_responses_total", {{"code", "200"}}), 3);
  EXPECT_EQ(e.value("tpmoe_http_responses_total", {{"code", "400"}}), 1);
}

// Slower steps, so that 64 streams overlap for a while.
// The server in front of MiniMax-M3's chat template: its <mm:think> tags and its tool calls.
class ServeHttpM3 : public ServeHttp {
 protected:
  ServeHttpM3() : ServeHttp(1ms, test::read_text_file(test::chat_template_path("minimax_m3.jinja")), kM3Context) {}
  // The template's own system prompt and the tools run past the preset tests' context.
  static constexpr int kM3Context = 4096;

  static json tools() {
    return json::parse(R"([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])");
  }
  static json ask(bool stream) {
    json body = {{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}, {"tools", tools()}};
    if (stream) body["stream"] = true;
    return body;
  }
  static std::string call_text(const std::string& city, int days) {
    const std::string ns = "]<]minimax[>[";
    return ns + "<invoke name=\"get_weather\">" + ns + "<city>" + city + ns + "</city>" + ns + "<days>" +
           std::to_string(days) + ns + "</days>" + ns + "</invoke>\n";
  }
  void script_two_calls() {
    const std::string ns = "]<]minimax[>[";
    reply_ = "<mm:think>The user wants weather.</mm:think>Checking both." + ns + "<tool_call>\n" +
             call_text("Paris", 3) + call_text("Lyon", 1) + ns + "</tool_call>";
  }
};

TEST_F(ServeHttpM3, ToolCallsComeBackAsToolCalls) {
  script_two_calls();
  const auto r = post("/v1/chat/completions", ask(false));
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const json& message = j["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], "The user wants weather.");
  EXPECT_EQ(message["content"], "Checking both.");
  ASSERT_EQ(message["tool_calls"].size(), 2u) << r->body;
  std::vector<std::string> ids;
  for (const json& call : message["tool_calls"]) {
    EXPECT_EQ(call["type"], "function");
    EXPECT_EQ(call["function"]["name"], "get_weather");
    EXPECT_TRUE(call["function"]["arguments"].is_string());
    ids.push_back(call["id"]);
    EXPECT_TRUE(ids.back().starts_with("call_")) << ids.back();
  }
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_EQ(json::parse(message["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json({{"city", "Paris"}, {"days", 3}}));
  EXPECT_EQ(json::parse(message["tool_calls"][1]["function"]["arguments"].get<std::string>()),
            json({{"city", "Lyon"}, {"days", 1}}));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");

  // parallel_tool_calls false: the first call only. tool_choice "none": the markup stays text.
  json one = ask(false);
  one["parallel_tool_calls"] = false;
  const json first = json::parse(post("/v1/chat/completions", one)->body);
  ASSERT_EQ(first["choices"][0]["message"]["tool_calls"].size(), 1u) << first.dump();
  json none = ask(false);
  none["tool_choice"] = "none";
  const json text = json::parse(post("/v1/chat/completions", none)->body);
  EXPECT_FALSE(text["choices"][0]["message"].contains("tool_calls")) << text.dump();
  EXPECT_NE(text["choices"][0]["message"]["content"].get<std::string>().find("<invoke name="), std::string::npos);
  EXPECT_EQ(text["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServeHttpM3, StreamedToolCalls) {
  script_two_calls();
  const auto r = post("/v1/chat/completions", ask(true));
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  std::string reasoning, content, finish;
  std::vector<json> calls;
  for (const json& e : parse_sse(r->body)) {
    const json& choice = e["choices"][0];
    const json& delta = choice["delta"];
    if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (delta.contains("tool_calls"))
      for (const json& c : delta["tool_calls"]) calls.push_back(c);
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
  }
  EXPECT_EQ(reasoning, "The user wants weather.");
  EXPECT_EQ(content, "Checking both.");
  ASSERT_EQ(calls.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(calls[i]["index"], i);
    EXPECT_EQ(calls[i]["type"], "function");
    EXPECT_EQ(calls[i]["function"]["name"], "get_weather");
  }
  EXPECT_EQ(json::parse(calls[1]["function"]["arguments"].get<std::string>()), json({{"city", "Lyon"}, {"days", 1}}));
  EXPECT_EQ(finish, "tool_calls");
}

TEST_F(ServeHttpM3, ToolRoundTripAndBadToolRequests) {
  // The client sends the call back with its arguments as JSON text (as OpenAI's clients do) and the
  // tool's result: the template renders it.
  reply_ = "It is sunny in Paris.";
  json body = ask(false);
  body["messages"].push_back({{"role", "assistant"},
                              {"content", nullptr},
                              {"tool_calls",
                               {{{"id", "call_1"},
                                 {"type", "function"},
                                 {"function", {{"name", "get_weather"}, {"arguments", R"({"city": "Paris"})"}}}}}}});
  body["messages"].push_back({{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "sunny"}});
  const auto r = post("/v1/chat/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["choices"][0]["message"]["content"], "It is sunny in Paris.");
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");

  body["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris";
  EXPECT_EQ(expect_error(post("/v1/chat/completions", body), 400, "arguments not JSON")["error"]["param"], "messages");
  json required = ask(false);
  required["tool_choice"] = "required";
  EXPECT_EQ(expect_error(post("/v1/chat/completions", required), 400, "tool_choice required")["error"]["param"],
            "tool_choice");
  json bad_tool = ask(false);
  bad_tool["tools"] = {{{"type", "function"}}};
  EXPECT_EQ(expect_error(post("/v1/chat/completions", bad_tool), 400, "a tool without a function")["error"]["param"],
            "tools");
}

class ServeHttpSlow : public ServeHttp {
 protected:
  ServeHttpSlow() : ServeHttp(10ms) {}
  std::thread start_long_stream(std::string& body);
};

TEST_F(ServeHttpSlow, SixtyFourStreamsAtOnce) {
  reply_ = std::string(120, 'y');  // 100 steps of 10 ms: a second for all 64 clients to connect
  constexpr int kStreams = 64;
  std::vector<std::string> texts(kStreams);
  std::vector<int> statuses(kStreams, 0);
  std::vector<std::thread> clients;
  for (int i = 0; i < kStreams; ++i)
    clients.emplace_back([&, i] {
      const auto r = post("/v1/completions", {{"prompt", {100 + i}}, {"stream", true}, {"max_tokens", 100}});
      if (!r) {
        texts[i] = "no response: " + httplib::to_string(r.error());
        return;
      }
      statuses[i] = r->status;
      for (const json& e : parse_sse(r->body)) texts[i] += e["choices"][0]["text"].get<std::string>();
    });
  for (auto& t : clients) t.join();
  for (int i = 0; i < kStreams; ++i) {
    EXPECT_EQ(statuses[i], 200) << "stream " << i;
    EXPECT_EQ(texts[i], std::string(100, 'y')) << "stream " << i;
  }
  EXPECT_EQ(scheduler_->peak_running(), kStreams) << "the 64 streams were not all in flight at once";
}

// A streamed completion of 200 characters on its own thread (its SSE body lands in `body`), once
// the scheduler runs it.
std::thread ServeHttpSlow::start_long_stream(std::string& body) {
  reply_ = std::string(200, 'z');
  std::thread streamer([this, &body] {
    const auto r = post("/v1/completions", {{"prompt", "x"}, {"stream", true}});
    if (r) body = r->body;
  });
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (scheduler_->stats().running == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  return streamer;
}

TEST_F(ServeHttpSlow, StopEndsStreamsInFlight) {
  std::string body;
  std::thread streamer = start_long_stream(body);
  server_->stop();
  thread_.join();                // run() returns
  thread_ = std::thread([] {});  // the fixture joins it again (also when an assertion below returns)
  streamer.join();
  const std::vector<json> events = parse_sse(body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "abort");
}

TEST_F(ServeHttpSlow, SchedulerFailureStopsTheServer) {
  std::string body;
  std::thread streamer = start_long_stream(body);
  scheduler_->fail();
  thread_.join();                // the stop handler made run() return
  thread_ = std::thread([] {});  // the fixture joins it again (also when an assertion below returns)
  streamer.join();
  const std::vector<json> events = parse_sse(body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "abort");
}

}  // namespace
}  // namespace tpmoe::serve
