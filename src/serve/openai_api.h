// The OpenAI API's shapes (https://platform.openai.com/docs/api-reference): a request body read
// into what the scheduler needs, and the JSON of replies, stream chunks and errors. No I/O here:
// server.cpp moves the bytes.
//
// Parameters beyond OpenAI's are vLLM's (top_k, min_p, repetition_penalty, stop_token_ids,
// ignore_eos, chat_template_kwargs, add_generation_prompt). A parameter tpmoe cannot honour with a
// value that would change the reply (n > 1, logprobs, echo, logit_bias, ...) is a 400 naming it,
// never silently ignored; unknown fields are ignored, as OpenAI's own clients send many.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "serve/reasoning.h"
#include "serve/tool_calls.h"
#include "text/chat_template.h"
#include "tpmoe/sampling.h"

namespace tpmoe::serve {

using Json = nlohmann::ordered_json;

// A request the server refuses (or cannot serve): an HTTP status and OpenAI's error object.
class ApiError : public std::runtime_error {
 public:
  // `param`: the body field at fault (empty: none); `code`: a short machine-readable reason (empty:
  // null), e.g. "model_not_found", "context_length_exceeded".
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "")
      : std::runtime_error(message), status_(status), param_(std::move(param)), code_(std::move(code)) {}
  int status() const { return status_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }

 private:
  int status_;
  std::string param_, code_;
};

// {"error": {"message", "type", "param", "code"}}: type "invalid_request_error" for a 4xx,
// "internal_server_error" otherwise; an empty param or code is null.
Json error_json(int status, const std::string& message, const std::string& param = "", const std::string& code = "");

enum class Endpoint { kCompletions, kChatCompletions };

// A request body, checked and read. What needs the model (tokens, the context) comes later.
struct ApiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;  // empty: not given
  // /v1/completions: the prompt as text, or as token ids (prompt_is_ids).
  std::string prompt_text;
  std::vector<int64_t> prompt_ids;
  bool prompt_is_ids = false;
  // /v1/chat/completions: the conversation, for the chat template (an assistant turn's tool-call
  // arguments given as JSON text are parsed into objects, as templates iterate them).
  text::ChatRequest chat;
  // tools given and tool_choice "auto" (the default with tools): the reply's tool calls are read out
  // of its text. tool_choice "none" leaves them text; "required" or a named function would need
  // constrained decoding and are refused.
  bool read_tool_calls = false;
  bool parallel_tool_calls = true;    // false: only the reply's first call is returned
  std::optional<int64_t> max_tokens;  // unset: the rest of the context
  // The field max_tokens came from, for errors: chat takes max_completion_tokens or the older
  // max_tokens (max_completion_tokens where both are given).
  const char* max_tokens_field = "max_tokens";
  SamplingParams sampling;  // all but max_tokens
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
};

// Arrays and objects a request may nest, in its body and in the JSON text it carries (a tool call's
// arguments): more than any message list or tool schema needs. Deeper JSON is refused before it is
// parsed: the code that copies, renders and compares parsed values recurses once a level, and a
// body of a few megabytes could otherwise nest deep enough to overflow a thread's stack.
inline constexpr int kMaxRequestNesting = 64;

// The body's text as a JSON object; 400 naming the problem when it is not one (or nests past
// kMaxRequestNesting).
Json parse_json_body(std::string_view body);
// Reads a request for `endpoint`; throws ApiError (400, naming the field) for a field of the wrong
// type or a value tpmoe does not support. Sampling values themselves are checked by
// SamplingParams::validate.
ApiRequest parse_api_request(Endpoint endpoint, const Json& body);

// The body field SamplingParams::validate's message is about ("temperature" from "sampling:
// temperature must be ..."), or "" when it names none.
std::string sampling_param_in(std::string_view validate_message);

struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
};
Json usage_json(const Usage& usage);

// What every reply and chunk of one request repeats.
struct ReplyHeader {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;  // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;
  std::string model;
  bool include_usage = false;  // streamed: chunks carry "usage": null, the last one the usage
};

// A reply's text (or a piece of it) as the API returns it: the reasoning, the content and the tool
// calls read out of the content. Completions return the content only.
struct ReplyText {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
};

// A whole reply ("text_completion" / "chat.completion"). A chat message with tool calls and no other
// text has content null, as OpenAI's.
Json full_reply(const ReplyHeader& header, const ReplyText& text, const std::string& finish_reason, const Usage& usage);
// A chat stream's first chunk: the assistant role, before any text.
Json chat_role_chunk(const ReplyHeader& header);
// A stream chunk with `delta`'s text and calls (completions: content only); `finish_reason` empty:
// null. Each call comes whole in one chunk, its index the call's place in the reply.
Json delta_chunk(const ReplyHeader& header, const ReplyText& delta, const std::string& finish_reason);
// The last chunk when include_usage: no choices, the usage.
Json usage_chunk(const ReplyHeader& header, const Usage& usage);

// JSON text (invalid UTF-8 replaced, never thrown on), and as one server-sent event.
std::string dump_json(const Json& j);
std::string sse_event(const Json& j);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

}  // namespace tpmoe::serve
