#include "serve/server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_set>

#include <sys/socket.h>

#include "core/error.h"
#include "serve/metrics.h"
#include "serve/openai_api.h"
#include "serve/reasoning.h"
#include "serve/reply_format.h"
#include "serve/tool_calls.h"

namespace tpmoe::serve {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct TimedUpdate {
  ServeUpdate update;
  Clock::time_point at;  // when the scheduler handed it over
};

// One request's updates, from the scheduler's thread (push) to its handler's (take). Held by a
// shared_ptr in the scheduler's callback: the handler may be gone (its client left) while the
// scheduler still holds the request.
class UpdateQueue {
 public:
  void push(const ServeUpdate& update) {
    {
      std::lock_guard lock(mutex_);
      items_.push_back({update, Clock::now()});
    }
    ready_.notify_one();
  }
  // Everything queued, after waiting up to `timeout` for the first one (empty: nothing came).
  std::vector<TimedUpdate> take(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    ready_.wait_for(lock, timeout, [&] { return !items_.empty(); });
    std::vector<TimedUpdate> out(std::make_move_iterator(items_.begin()), std::make_move_iterator(items_.end()));
    items_.clear();
    return out;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<TimedUpdate> items_;
};

// A request's reply as its updates arrive: its text (for chat: the reasoning split from the content,
// and the tool calls read out of the content when the request asked for them), its token counts and
// timings.
class Reply {
 public:
  // `tool_calls` set: the reply's tool calls are read in that syntax, typed by the request's tools.
  Reply(ReplyHeader header, Clock::time_point arrival, int prompt_tokens, bool starts_in_reasoning,
        const ThinkTags& think, std::optional<ToolCallParser> tool_calls, bool parallel_tool_calls)
      : header_(std::move(header)),
        arrival_(arrival),
        splitter_(starts_in_reasoning, think),
        tool_calls_(std::move(tool_calls)),
        parallel_tool_calls_(parallel_tool_calls) {
    usage_.prompt_tokens = prompt_tokens;
  }

  // The text `u` adds, split; at the last update also what the readers held back.
  ReplyText apply(const TimedUpdate& u) {
    if (!u.update.tokens.empty()) {
      if (timings_.first_token < 0) timings_.first_token = seconds_between(arrival_, u.at);
      timings_.last_token = seconds_between(arrival_, u.at);
    }
    tokens_seen_ += int(u.update.tokens.size());
    usage_.completion_tokens = std::max(tokens_seen_, u.update.completion_tokens);
    timings_.completion_tokens = usage_.completion_tokens;
    const bool last = !u.update.finish_reason.empty();
    ReplyText delta = split(u.update.text, last);
    if (last) {
      finish_reason_ = u.update.finish_reason;
      // OpenAI's reason for a reply that ended by calling tools.
      if (finish_reason_ == "stop" && !whole_.tool_calls.empty()) finish_reason_ = "tool_calls";
    }
    return delta;
  }

  bool chat() const { return header_.endpoint == Endpoint::kChatCompletions; }
  bool finished() const { return !finish_reason_.empty(); }
  const std::string& finish_reason() const { return finish_reason_; }
  const ReplyHeader& header() const { return header_; }
  const ReplyText& whole() const { return whole_; }
  const Usage& usage() const { return usage_; }
  const RequestTimings& timings() const { return timings_; }

 private:
  ReplyText split(const std::string& text, bool last) {
    ReplyText delta;
    if (!chat()) {  // completions return the text as generated
      delta.content = text;
      whole_.content += text;
      return delta;
    }
    ReasoningDelta parts = splitter_.feed(text);
    if (last) {
      const ReasoningDelta tail = splitter_.flush();
      parts.reasoning += tail.reasoning;
      parts.content += tail.content;
    }
    delta.reasoning = std::move(parts.reasoning);
    if (tool_calls_) {
      ToolCallDelta calls = tool_calls_->feed(parts.content);
      if (last) {
        ToolCallDelta tail = tool_calls_->flush();
        calls.content += tail.content;
        for (ToolCall& call : tail.calls) calls.calls.push_back(std::move(call));
      }
      delta.content = std::move(calls.content);
      for (ToolCall& call : calls.calls)
        if (parallel_tool_calls_ || call.index == 0) delta.tool_calls.push_back(std::move(call));
    } else {
      delta.content = std::move(parts.content);
    }
    whole_.reasoning += delta.reasoning;
    whole_.content += delta.content;
    whole_.tool_calls.insert(whole_.tool_calls.end(), delta.tool_calls.begin(), delta.tool_calls.end());
    return delta;
  }

  ReplyHeader header_;
  Clock::time_point arrival_;
  ReasoningSplitter splitter_;
  std::optional<ToolCallParser> tool_calls_;
  bool parallel_tool_calls_;
  ReplyText whole_;
  Usage usage_;
  RequestTimings timings_;
  int tokens_seen_ = 0;
  std::string finish_reason_;
};

// Paths the server answers and the methods each takes: another method is a 405, not a 404.
struct Route {
  const char* path;
  const char* method;
};
constexpr Route kRoutes[] = {{"/v1/completions", "POST"},
                             {"/v1/chat/completions", "POST"},
                             {"/v1/models", "GET"},
                             {"/health", "GET"},
                             {"/metrics", "GET"}};

// How long a handler waits for its cancelled request's last update once the server stops, before
// it ends the reply itself (a scheduler that no longer steps must not hold up shutdown).
constexpr std::chrono::seconds kStopGrace{10};
constexpr std::chrono::milliseconds kPollInterval{100};

// httplib::Server listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, compiled into Debian's
// library): a burst of connections (64 clients starting at once) overflows it, and the kernel then
// drops the handshakes it cannot queue, which clients see as connections closed before a response.
// Listening again on the bound socket raises the backlog (Linux takes the new value).
class HttpServer : public httplib::Server {
 public:
  void raise_backlog(int backlog) {
    TPMOE_CHECK(::listen(svr_sock_, backlog) == 0, "serve: listen() on the bound socket failed");
  }
};

constexpr int kListenBacklog = 1024;

}  // namespace

struct OpenAIServer::Impl {
  Impl(Scheduler& s, const text::TextModel& t, ServerOptions o)
      : scheduler(s),
        text(t),
        options(std::move(o)),
        format(text.chat_template ? reply_format_of_template(text.chat_template->source()) : ReplyFormat{}) {
    TPMOE_CHECK(!options.served_model_name.empty(), "serve: the served model name is empty");
    std::random_device device;
    id_salt = (uint64_t(device()) << 32) ^ device();
    started_unix =
        std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
    setup_routes();
  }

  Scheduler& scheduler;
  const text::TextModel& text;
  ServerOptions options;
  ReplyFormat format;  // the model's reasoning tags and tool-call syntax, from its chat template
  HttpServer http;
  ServerMetrics metrics;
  std::mutex template_mutex;  // the chat template interpreter does not promise thread safety
  uint64_t id_salt = 0;
  std::atomic<uint64_t> next_id{0};
  int64_t started_unix = 0;

  // Lifecycle: stop() may come before, during or after run(); `guard` in run() keeps stopping the
  // HTTP server until its listen loop has returned. It first lets the streams in flight end: the
  // HTTP server writes no more of a chunked response once it is stopping, so a stream whose body
  // had not begun would end with nothing, not its "abort" chunk and [DONE].
  std::mutex lifecycle_mutex;
  std::condition_variable lifecycle_changed;
  bool stopping = false, run_done = false;
  int open_streams = 0;  // stream replies whose response has not been released yet
  std::atomic<bool> stopping_flag{false};
  Clock::time_point stop_time;

  std::mutex active_mutex;
  std::unordered_set<uint64_t> active;  // scheduler ids of requests with a handler

  void setup_routes();
  void handle_generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res);
  void stream_reply(httplib::Response& res, uint64_t id, std::shared_ptr<UpdateQueue> queue,
                    std::shared_ptr<Reply> reply);
  void wait_reply(UpdateQueue& queue, Reply& reply);
  // Reply::apply, and the time to the first token into the metrics as soon as it is known.
  ReplyText apply(Reply& reply, const TimedUpdate& u);
  // The updates that came, after waiting for at least one; once the server has stopped and the
  // scheduler did not end the request within kStopGrace, an "abort" made here.
  std::vector<TimedUpdate> next_updates(UpdateQueue& queue, const Reply& reply);
  void finish_request(uint64_t id, const Reply& reply);
  void cancel(uint64_t id) { scheduler.cancel(id); }

  ReplyHeader make_header(Endpoint endpoint, bool include_usage) {
    ReplyHeader h;
    h.endpoint = endpoint;
    const uint64_t n = next_id++;
    // splitmix64 of (salt + n): ids unique in this process and unlike another run's.
    uint64_t x = id_salt + 0x9e3779b97f4a7c15ull * (n + 1);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    h.id = fmt::format("{}-{:016x}", endpoint == Endpoint::kChatCompletions ? "chatcmpl" : "cmpl", x ^ (x >> 31));
    h.created =
        std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
    h.model = options.served_model_name;
    h.include_usage = include_usage;
    return h;
  }
};

namespace {

void send_json(httplib::Response& res, int status, const Json& j) {
  res.status = status;
  res.set_content(dump_json(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  send_json(res, e.status(), error_json(e.status(), e.what(), e.param(), e.code()));
}

// The prompt's token ids, and whether the reply starts inside a think block the prompt opened.
struct Prompt {
  std::vector<int32_t> ids;
  bool starts_in_reasoning = false;
};

}  // namespace

void OpenAIServer::Impl::setup_routes() {
  const int threads =
      options.http_threads > 0 ? options.http_threads : std::max(128, 2 * scheduler.options().max_batch + 16);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  http.set_payload_max_length(options.max_body_bytes);
  // A stream is many small writes: without TCP_NODELAY, Nagle's algorithm holds each one back until
  // the client acknowledges the last (up to its delayed-ACK time, tens of milliseconds).
  http.set_tcp_nodelay(true);
  // httplib closes a kept-alive connection after 5 requests by default; a client sending many
  // (a load generator) would reconnect every fifth.
  http.set_keep_alive_max_count(1000);

  http.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    for (const Route& route : kRoutes) {
      if (req.path != route.path) continue;
      const bool get_like = std::string_view(route.method) == "GET" && req.method == "HEAD";
      if (req.method == route.method || get_like) return httplib::Server::HandlerResponse::Unhandled;
      res.set_header("Allow", route.method);
      send_error(res, ApiError(405, fmt::format("{} takes {}, not {}", req.path, route.method, req.method), "",
                               "method_not_allowed"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Responses httplib makes itself (no route, a body over the limit, a malformed request) get
  // OpenAI's error JSON too; a handler's own error already has its body.
  http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                                                                     httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string message, code;
    if (res.status == 404) {
      message = fmt::format("no such endpoint: {} {}", req.method, req.path), code = "not_found";
    } else if (res.status == 413) {
      message = fmt::format("the request body is larger than this server's limit of {} bytes", options.max_body_bytes);
      code = "payload_too_large";
    } else if (res.status == 400) {
      message = "malformed HTTP request";
    } else {
      message = fmt::format("HTTP error {}", res.status);
    }
    send_json(res, res.status, error_json(res.status, message, "", code));
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string message = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      message = fmt::format("internal error: {}", e.what());
    } catch (...) {
    }
    send_json(res, 500, error_json(500, message));
  });
  // Responses are counted by the post-routing handler, which runs for every response (errors too) just
  // before its status line is written: a client that has its answer and then reads /metrics finds it
  // counted. The logger runs only once the response is sent, so counting there raced that read.
  http.set_post_routing_handler(
      [this](const httplib::Request&, httplib::Response& res) { metrics.record_response(res.status); });
  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    if (options.access_log) std::fprintf(stderr, "%s %s %d\n", req.method.c_str(), req.path.c_str(), res.status);
  });

  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(Endpoint::kCompletions, req, res);
  });
  http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(Endpoint::kChatCompletions, req, res);
  });
  auto model_card = [this] {
    return Json{{"id", options.served_model_name},
                {"object", "model"},
                {"created", started_unix},
                {"owned_by", "tpmoe"},
                // vLLM's field, and the vocabulary (a load generator draws token-id prompts from it).
                {"max_model_len", scheduler.options().max_context},
                {"vocab_size", scheduler.vocab_size()}};
  };
  http.Get("/v1/models", [model_card](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, Json{{"object", "list"}, {"data", Json::array({model_card()})}});
  });
  http.Get(R"(/v1/models/(.+))", [this, model_card](const httplib::Request& req, httplib::Response& res) {
    if (req.matches[1] != options.served_model_name)
      return send_error(res, ApiError(404, fmt::format("the model '{}' does not exist", req.matches[1].str()), "model",
                                      "model_not_found"));
    send_json(res, 200, model_card());
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (stopping_flag) return send_error(res, ApiError(503, "the server is shutting down", "", "shutting_down"));
    send_json(res, 200, Json{{"status", "ok"}});
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(scheduler.stats()), "text/plain; version=0.0.4; charset=utf-8");
  });
}

void OpenAIServer::Impl::handle_generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
  const Clock::time_point arrival = Clock::now();
  try {
    if (stopping_flag) throw ApiError(503, "the server is shutting down", "", "shutting_down");
    const ApiRequest api = parse_api_request(endpoint, parse_json_body(req.body));
    if (!api.model.empty() && api.model != options.served_model_name)
      throw ApiError(
          404,
          fmt::format("the model '{}' does not exist; this server serves '{}'", api.model, options.served_model_name),
          "model", "model_not_found");
    const char* prompt_param = endpoint == Endpoint::kChatCompletions ? "messages" : "prompt";
    const int vocab = scheduler.vocab_size();

    Prompt prompt;
    try {
      if (endpoint == Endpoint::kChatCompletions) {
        if (!text.chat_template)
          throw ApiError(
              400, fmt::format("this model has no chat template ({}): use /v1/completions", text.chat_template_error),
              "messages", "no_chat_template");
        std::string rendered;
        {
          std::lock_guard lock(template_mutex);
          rendered = text.render_chat(api.chat);
        }
        prompt.ids = text.tokenizer.encode(rendered);
        prompt.starts_in_reasoning = prompt_opens_reasoning(rendered, format.think);
      } else if (api.prompt_is_ids) {
        for (size_t i = 0; i < api.prompt_ids.size(); ++i) {
          const int64_t id = api.prompt_ids[i];
          if (id < 0 || id >= vocab)
            throw ApiError(400,
                           fmt::format("prompt token {} is id {}, outside the vocabulary (0 to {})", i, id, vocab - 1),
                           "prompt", "invalid_value");
          prompt.ids.push_back(int32_t(id));
        }
      } else {
        prompt.ids = text.tokenizer.encode(api.prompt_text);
      }
    } catch (const Error& e) {  // a template error, invalid UTF-8
      throw ApiError(400, e.what(), prompt_param);
    }
    const int prompt_len = int(prompt.ids.size());
    const int context = scheduler.options().max_context;
    if (prompt_len == 0) throw ApiError(400, "the prompt is empty", prompt_param, "invalid_value");
    if (prompt_len >= context)
      throw ApiError(400,
                     fmt::format("the prompt is {} tokens, and this model's context holds {} in all (prompt and "
                                 "reply): shorten the prompt",
                                 prompt_len, context),
                     prompt_param, "context_length_exceeded");
    const char* max_param = api.max_tokens_field;
    if (api.max_tokens && *api.max_tokens < 1)
      throw ApiError(400, fmt::format("'{}' must be at least 1, got {}", max_param, *api.max_tokens), max_param,
                     "invalid_value");
    const int64_t max_tokens = api.max_tokens.value_or(context - prompt_len);  // vLLM's default: the rest
    if (prompt_len + max_tokens > context)
      throw ApiError(400,
                     fmt::format("this model's context holds {} tokens, and the request asks for {} ({} in the "
                                 "prompt, {} in the reply): shorten the prompt or lower {}",
                                 context, prompt_len + max_tokens, prompt_len, max_tokens, max_param),
                     max_param, "context_length_exceeded");

    ServeRequest request;
    request.sampling = api.sampling;
    request.sampling.max_tokens = int(max_tokens);
    try {
      request.sampling.validate(vocab);
    } catch (const Error& e) {
      throw ApiError(400, e.what(), sampling_param_in(e.what()), "invalid_value");
    }
    request.prompt = prompt.ids;
    request.eos_token_ids = text.eos_ids;
    auto decoder = std::make_shared<text::StreamDecoder>(text.tokenizer);
    request.detokenize = [decoder, &tokenizer = text.tokenizer](int32_t id) {
      // A model's vocabulary may be padded past its tokenizer's: such an id has no text.
      return tokenizer.is_valid_id(id) ? decoder->push(id) : std::string();
    };
    auto queue = std::make_shared<UpdateQueue>();
    request.on_update = [queue](const ServeUpdate& u) { queue->push(u); };

    ReplyHeader header = make_header(endpoint, api.include_usage);
    std::optional<ToolCallParser> tool_calls;
    if (api.read_tool_calls && format.tool_calls != ToolCallSyntax::kNone)
      tool_calls.emplace(format.tool_calls, api.chat.tools, "call_" + header.id.substr(header.id.find('-') + 1) + "_");
    auto reply = std::make_shared<Reply>(std::move(header), arrival, prompt_len, prompt.starts_in_reasoning,
                                         format.think, std::move(tool_calls), api.parallel_tool_calls);
    uint64_t id = 0;
    {
      // Registered under the lock stop() cancels under: a request submitted while stopping is
      // cancelled by whichever of the two comes second.
      std::lock_guard lock(active_mutex);
      if (stopping_flag) throw ApiError(503, "the server is shutting down", "", "shutting_down");
      try {
        id = scheduler.submit(std::move(request));
      } catch (const Error& e) {
        throw ApiError(400, e.what(), "", "invalid_request");
      }
      active.insert(id);
    }
    if (api.stream) return stream_reply(res, id, std::move(queue), std::move(reply));
    wait_reply(*queue, *reply);
    finish_request(id, *reply);
    send_json(res, 200, full_reply(reply->header(), reply->whole(), reply->finish_reason(), reply->usage()));
  } catch (const ApiError& e) {
    send_error(res, e);
  } catch (const std::exception& e) {
    send_error(res, ApiError(500, fmt::format("internal error: {}", e.what())));
  }
}

std::vector<TimedUpdate> OpenAIServer::Impl::next_updates(UpdateQueue& queue, const Reply& reply) {
  for (;;) {
    std::vector<TimedUpdate> updates = queue.take(kPollInterval);
    if (!updates.empty()) return updates;
    if (!stopping_flag) continue;
    std::lock_guard lock(lifecycle_mutex);
    if (Clock::now() - stop_time < kStopGrace) continue;
    // The scheduler did not end the cancelled request in time: end the reply here.
    TimedUpdate abort{{}, Clock::now()};
    abort.update.finish_reason = "abort";
    abort.update.completion_tokens = reply.usage().completion_tokens;
    return {abort};
  }
}

void OpenAIServer::Impl::wait_reply(UpdateQueue& queue, Reply& reply) {
  // A client that leaves while waiting here is not noticed (httplib 0.11 gives a handler no way to
  // see its socket close): the request runs to its end.
  while (!reply.finished())
    for (const TimedUpdate& u : next_updates(queue, reply)) apply(reply, u);
}

ReplyText OpenAIServer::Impl::apply(Reply& reply, const TimedUpdate& u) {
  const bool first = reply.timings().first_token < 0;
  ReplyText delta = reply.apply(u);
  if (first && reply.timings().first_token >= 0) metrics.record_first_token(reply.timings().first_token);
  return delta;
}

void OpenAIServer::Impl::finish_request(uint64_t id, const Reply& reply) {
  {
    std::lock_guard lock(active_mutex);
    active.erase(id);
  }
  const std::string& finish = reply.finish_reason();
  if (finish == "stop" || finish == "length" || finish == "tool_calls") metrics.record_finished(reply.timings());
}

void OpenAIServer::Impl::stream_reply(httplib::Response& res, uint64_t id, std::shared_ptr<UpdateQueue> queue,
                                      std::shared_ptr<Reply> reply) {
  res.set_header("Cache-Control", "no-cache");
  {
    std::lock_guard lock(lifecycle_mutex);
    ++open_streams;  // until the releaser runs, however the response ends
  }
  // The provider runs on this handler's thread once the headers are out, and writes the whole
  // stream in one call. A write that fails means the client is gone: the releaser cancels the
  // request (it runs however the response ends).
  auto provider = [this, id, queue, reply](size_t, httplib::DataSink& sink) {
    auto write = [&sink](const std::string& s) { return sink.write(s.data(), s.size()); };
    try {
      if (reply->chat() && !write(sse_event(chat_role_chunk(reply->header())))) return false;
      while (!reply->finished()) {
        for (const TimedUpdate& u : next_updates(*queue, *reply)) {
          const ReplyText delta = apply(*reply, u);
          // Completions send a chunk per update that added tokens (its text may still be empty, held
          // back as incomplete UTF-8): a client times its first token by the first chunk.
          const bool has_text = !delta.content.empty() || !delta.reasoning.empty() || !delta.tool_calls.empty();
          const bool send = has_text || (!reply->chat() && !u.update.tokens.empty());
          if (send && !write(sse_event(delta_chunk(reply->header(), delta, "")))) return false;
          if (reply->finished()) break;
        }
      }
      finish_request(id, *reply);
      if (!write(sse_event(delta_chunk(reply->header(), {}, reply->finish_reason())))) return false;
      if (reply->header().include_usage && !write(sse_event(usage_chunk(reply->header(), reply->usage()))))
        return false;
      if (!write(std::string(kSseDone))) return false;
      sink.done();
      return true;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "serve: stream of request %llu failed: %s\n", (unsigned long long)id, e.what());
      return false;
    }
  };
  // Counted once even if httplib copied the response (a copy carries the releaser too).
  auto released = std::make_shared<std::atomic<bool>>(false);
  auto releaser = [this, id, reply, released](bool success) {
    if (released->exchange(true)) return;
    if (!success || !reply->finished()) {
      cancel(id);
      std::lock_guard lock(active_mutex);
      active.erase(id);
    }
    {
      std::lock_guard lock(lifecycle_mutex);
      --open_streams;
    }
    lifecycle_changed.notify_all();
  };
  res.set_chunked_content_provider("text/event-stream", std::move(provider), std::move(releaser));
}

// The scheduler's stop handler (serving must end early, e.g. a rank failed) reaches the server
// through this, so a handler that fires while the server is being destroyed finds it gone.
struct OpenAIServer::StopLink {
  std::mutex mutex;
  OpenAIServer* server = nullptr;
};

OpenAIServer::OpenAIServer(Scheduler& scheduler, const text::TextModel& text, ServerOptions options)
    : impl_(std::make_unique<Impl>(scheduler, text, std::move(options))), stop_link_(std::make_shared<StopLink>()) {
  stop_link_->server = this;
  scheduler.set_stop_handler([link = stop_link_] {
    std::lock_guard lock(link->mutex);
    if (link->server) link->server->stop();
  });
}

OpenAIServer::~OpenAIServer() {
  impl_->scheduler.set_stop_handler({});
  std::lock_guard lock(stop_link_->mutex);
  stop_link_->server = nullptr;
}

const ReplyFormat& OpenAIServer::reply_format() const { return impl_->format; }

int OpenAIServer::bind() {
  const ServerOptions& o = impl_->options;
  int port = o.port;
  if (port == 0) {
    port = impl_->http.bind_to_any_port(o.host);
    TPMOE_CHECK(port > 0, "serve: cannot listen on {} (no free port)", o.host);
  } else {
    TPMOE_CHECK(impl_->http.bind_to_port(o.host, port), "serve: cannot listen on {}:{} (in use, or not this host's)",
                o.host, port);
  }
  impl_->http.raise_backlog(kListenBacklog);
  return port;
}

void OpenAIServer::run() {
  Impl& s = *impl_;
  std::thread guard([&s] {
    std::unique_lock lock(s.lifecycle_mutex);
    s.lifecycle_changed.wait(lock, [&] { return s.stopping || s.run_done; });
    // The streams in flight end first (stop() cancelled their requests; each ends with "abort"
    // within kStopGrace), while new requests get a 503.
    s.lifecycle_changed.wait_until(lock, s.stop_time + kStopGrace + kPollInterval * 5,
                                   [&] { return s.run_done || s.open_streams == 0; });
    // httplib's stop() does nothing until its listen loop runs: repeat it until that loop returned.
    while (!s.run_done) {
      lock.unlock();
      s.http.stop();
      lock.lock();
      s.lifecycle_changed.wait_for(lock, std::chrono::milliseconds(20), [&] { return s.run_done; });
    }
  });
  s.http.listen_after_bind();
  {
    std::lock_guard lock(s.lifecycle_mutex);
    s.run_done = true;
  }
  s.lifecycle_changed.notify_all();
  guard.join();
}

void OpenAIServer::stop() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.lifecycle_mutex);
    if (s.stopping) return;
    s.stopping = true;
    s.stop_time = Clock::now();
  }
  s.stopping_flag = true;
  {
    std::lock_guard lock(s.active_mutex);
    for (uint64_t id : s.active) s.cancel(id);
  }
  s.lifecycle_changed.notify_all();
}

}  // namespace tpmoe::serve
