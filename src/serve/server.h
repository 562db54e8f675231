// The OpenAI-compatible HTTP server (cpp-httplib) in front of a Scheduler:
//
//   POST /v1/completions        a prompt (text or token ids) -> text; stream: true for server-sent events
//   POST /v1/chat/completions   messages, rendered with the model's chat template -> a message, its
//                               thinking apart as reasoning_content, its tool calls as tool_calls
//   GET  /v1/models             the one model served
//   GET  /health                200 while serving
//   GET  /metrics               Prometheus text (serve/metrics.h)
//
// Each request is a handler thread of the HTTP pool: it submits to the scheduler and drains the
// request's update queue, which the scheduler's thread fills (on_update only pushes). A client that
// goes away mid-stream is cancelled, so its KV pages go back to the pool at once.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "serve/reply_format.h"
#include "text/text_model.h"
#include "tpmoe/serving.h"

namespace tpmoe::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0: a free port (bind() says which)
  std::string served_model_name;    // the name requests must give as "model" (required)
  size_t max_body_bytes = 8 << 20;  // larger bodies get a 413
  int http_threads = 0;             // 0: max(128, 2 * max_batch + 16): a streaming request holds a thread
  bool access_log = false;          // one line per response on stderr: method, path, status
};

class OpenAIServer {
 public:
  // `scheduler` and `text` must outlive the server.
  OpenAIServer(Scheduler& scheduler, const text::TextModel& text, ServerOptions options);
  ~OpenAIServer();
  OpenAIServer(const OpenAIServer&) = delete;
  OpenAIServer& operator=(const OpenAIServer&) = delete;

  // How the model's replies mark reasoning and tool calls, as read off its chat template.
  const ReplyFormat& reply_format() const;

  // Binds the listening socket and returns its port; throws tpmoe::Error naming host and port when
  // it cannot.
  int bind();
  // Serves until stop() (bind() first). Returns once every handler has finished.
  void run();
  // From any thread (a signal watcher): refuses new requests, cancels the ones in flight, and makes
  // run() return. The scheduler calls it too when serving must end early (set_stop_handler).
  void stop();

 private:
  struct Impl;
  struct StopLink;
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<StopLink> stop_link_;
};

}  // namespace tpmoe::serve
