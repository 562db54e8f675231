#include "serve/openai_api.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "serve/json_nesting.h"

namespace tpmoe::serve {

Json error_json(int status, const std::string& message, const std::string& param, const std::string& code) {
  Json error = Json::object();
  error["message"] = message;
  error["type"] = status >= 400 && status < 500 ? "invalid_request_error" : "internal_server_error";
  error["param"] = param.empty() ? Json(nullptr) : Json(param);
  error["code"] = code.empty() ? Json(nullptr) : Json(code);
  return Json{{"error", error}};
}

Json parse_json_body(std::string_view body) {
  if (json_nesting(body, kMaxRequestNesting) > kMaxRequestNesting)
    throw ApiError(
        400, fmt::format("the request body nests arrays and objects more than {} levels deep", kMaxRequestNesting), "",
        "invalid_json");
  Json j;
  try {
    j = Json::parse(body);
  } catch (const Json::exception& e) {  // a parse error, or a number past a double's range (out_of_range)
    throw ApiError(400, fmt::format("the request body is not valid JSON: {}", e.what()), "", "invalid_json");
  }
  if (!j.is_object()) throw ApiError(400, fmt::format("the request body must be a JSON object, got {}", j.type_name()));
  return j;
}

namespace {

// A field's value, or nullptr when absent or null (OpenAI's clients send null for "not given").
const Json* field(const Json& body, const char* key) {
  const auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

[[noreturn]] void bad_type(const char* key, const char* expected, const Json& value) {
  throw ApiError(400, fmt::format("'{}' must be {}, got {}", key, expected, value.type_name()), key, "invalid_type");
}

std::optional<double> number_field(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad_type(key, "a number", *v);
  return v->get<double>();
}

std::optional<int64_t> int_field(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    throw ApiError(400, fmt::format("'{}' is out of range: {}", key, v->dump()), key, "invalid_value");
  if (!v->is_number_integer()) bad_type(key, "an integer", *v);
  return v->get<int64_t>();
}

std::optional<bool> bool_field(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad_type(key, "true or false", *v);
  return v->get<bool>();
}

[[noreturn]] void unsupported(const char* key, const std::string& what) {
  throw ApiError(400, fmt::format("'{}': {} is not supported by this server", key, what), key, "unsupported_parameter");
}

// Integers that must fit an int for SamplingParams; a value outside is out of range, not wrapped.
int to_int(int64_t v, const char* key) {
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
    throw ApiError(400, fmt::format("'{}' is out of range: {}", key, v), key, "invalid_value");
  return int(v);
}

void read_sampling(const Json& body, ApiRequest& r) {
  SamplingParams& s = r.sampling;
  if (auto v = number_field(body, "temperature")) s.temperature = float(*v);
  if (auto v = number_field(body, "top_p")) s.top_p = float(*v);
  if (auto v = int_field(body, "top_k")) s.top_k = to_int(*v, "top_k");
  if (auto v = number_field(body, "min_p")) s.min_p = float(*v);
  if (auto v = number_field(body, "presence_penalty")) s.presence_penalty = float(*v);
  if (auto v = number_field(body, "frequency_penalty")) s.frequency_penalty = float(*v);
  if (auto v = number_field(body, "repetition_penalty")) s.repetition_penalty = float(*v);
  // A negative seed is a seed too (Python clients send any int); its two's-complement bits are used.
  if (auto v = int_field(body, "seed")) s.seed = uint64_t(*v);
  if (auto v = bool_field(body, "ignore_eos")) s.ignore_eos = *v;
  if (const Json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      s.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const auto& item : *stop) {
        if (!item.is_string()) bad_type("stop", "a string or a list of strings", item);
        s.stop.push_back(item.get<std::string>());
      }
    } else {
      bad_type("stop", "a string or a list of strings", *stop);
    }
  }
  if (const Json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) bad_type("stop_token_ids", "a list of token ids", *ids);
    for (const auto& id : *ids) {
      if (!id.is_number_integer()) bad_type("stop_token_ids", "a list of token ids", id);
      s.stop_token_ids.push_back(to_int(id.get<int64_t>(), "stop_token_ids"));
    }
  }
  r.max_tokens = int_field(body, "max_tokens");
  if (r.endpoint == Endpoint::kChatCompletions)
    if (auto v = int_field(body, "max_completion_tokens")) {
      r.max_tokens = v;
      r.max_tokens_field = "max_completion_tokens";
    }
}

// Refuses what would change the reply but is not implemented, rather than ignoring it.
void refuse_unsupported(const Json& body, Endpoint endpoint) {
  if (auto n = int_field(body, "n"); n && *n != 1)
    throw ApiError(400, fmt::format("'n' must be 1: this server returns one choice per request, got {}", *n), "n",
                   "unsupported_parameter");
  if (auto best_of = int_field(body, "best_of"); best_of && *best_of != 1) unsupported("best_of", "best_of > 1");
  if (const Json* v = field(body, "logprobs"); v && !(v->is_boolean() && !v->get<bool>()))
    unsupported("logprobs", "returning log probabilities");
  if (field(body, "top_logprobs")) unsupported("top_logprobs", "returning log probabilities");
  if (const Json* v = field(body, "logit_bias"); v && !(v->is_object() && v->empty()))
    unsupported("logit_bias", "biasing logits");
  if (auto echo = bool_field(body, "echo"); echo && *echo) unsupported("echo", "echoing the prompt");
  if (const Json* v = field(body, "suffix"); v && !(v->is_string() && v->get<std::string>().empty()))
    unsupported("suffix", "a suffix (insertion)");
  if (auto beam = bool_field(body, "use_beam_search"); beam && *beam) unsupported("use_beam_search", "beam search");
  if (const Json* format = field(body, "response_format")) {
    const Json* type = format->is_object() ? field(*format, "type") : nullptr;
    if (!type || *type != "text") unsupported("response_format", "a response format other than text");
  }
  if (endpoint == Endpoint::kCompletions && field(body, "messages"))
    throw ApiError(400, "'messages' belongs to /v1/chat/completions; /v1/completions takes 'prompt'", "messages");
}

void read_prompt(const Json& body, ApiRequest& r) {
  const Json* prompt = field(body, "prompt");
  if (!prompt) throw ApiError(400, "'prompt' is required: a string or a list of token ids", "prompt", "missing_field");
  const Json* single = prompt;
  // A list of one prompt (a string or a list of ids) is that prompt; batches are not served.
  if (prompt->is_array() && !prompt->empty() && !(*prompt)[0].is_number()) {
    if (prompt->size() != 1)
      throw ApiError(400, fmt::format("'prompt' holds {} prompts; this server takes one per request", prompt->size()),
                     "prompt", "unsupported_parameter");
    single = &(*prompt)[0];
  }
  if (single->is_string()) {
    r.prompt_text = single->get<std::string>();
    return;
  }
  if (!single->is_array()) bad_type("prompt", "a string or a list of token ids", *single);
  r.prompt_is_ids = true;
  for (const auto& id : *single) {
    if (!id.is_number_integer()) bad_type("prompt", "a string or a list of token ids", id);
    r.prompt_ids.push_back(id.is_number_unsigned() && id.get<uint64_t>() > uint64_t(INT64_MAX)
                               ? std::numeric_limits<int64_t>::max()
                               : id.get<int64_t>());
  }
}

// Message content as the chat template sees it: a string. A list of text parts (OpenAI's content
// parts) is joined with newlines, as vLLM does for templates that take strings.
void normalise_content(Json& message, size_t index) {
  auto it = message.find("content");
  if (it == message.end() || it->is_null() || it->is_string()) return;
  if (!it->is_array())
    throw ApiError(
        400,
        fmt::format("messages[{}].content must be a string or a list of text parts, got {}", index, it->type_name()),
        "messages");
  std::string joined;
  for (const auto& part : *it) {
    const Json* type = part.is_object() ? field(part, "type") : nullptr;
    const Json* text = part.is_object() ? field(part, "text") : nullptr;
    if (!type || *type != "text" || !text || !text->is_string())
      throw ApiError(400,
                     fmt::format("messages[{}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                 "supported",
                                 index),
                     "messages", "unsupported_content");
    if (!joined.empty()) joined += '\n';
    joined += text->get<std::string>();
  }
  *it = joined;
}

// An assistant turn's tool calls as templates take them: OpenAI's clients send each call's arguments
// as JSON text, templates iterate them as a mapping (vLLM parses them the same way).
void parse_tool_call_arguments(Json& message, size_t index) {
  auto calls = message.find("tool_calls");
  if (calls == message.end() || calls->is_null()) return;
  if (!calls->is_array())
    throw ApiError(400, fmt::format("messages[{}].tool_calls must be a list, got {}", index, calls->type_name()),
                   "messages", "invalid_type");
  for (size_t j = 0; j < calls->size(); ++j) {
    Json& call = (*calls)[j];
    if (!call.is_object() || !call.contains("function") || !call["function"].is_object()) continue;
    Json& function = call["function"];
    auto args = function.find("arguments");
    if (args == function.end() || !args->is_string()) continue;
    const std::string& text = args->get_ref<const std::string&>();
    if (json_nesting(text, kMaxRequestNesting) > kMaxRequestNesting)
      throw ApiError(400,
                     fmt::format("messages[{}].tool_calls[{}].function.arguments nests arrays and objects more than {} "
                                 "levels deep",
                                 index, j, kMaxRequestNesting),
                     "messages", "invalid_value");
    Json parsed = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded() || !parsed.is_object())
      throw ApiError(
          400,
          fmt::format("messages[{}].tool_calls[{}].function.arguments must be a JSON object (as text or as an object)",
                      index, j),
          "messages", "invalid_value");
    *args = std::move(parsed);
  }
}

void read_tools(const Json& body, ApiRequest& r) {
  const Json* tools = field(body, "tools");
  if (tools) {
    if (!tools->is_array()) bad_type("tools", "a list", *tools);
    for (size_t i = 0; i < tools->size(); ++i) {
      const Json& tool = (*tools)[i];
      const Json* type = tool.is_object() ? field(tool, "type") : nullptr;
      const Json* function = tool.is_object() ? field(tool, "function") : nullptr;
      const Json* name = function && function->is_object() ? field(*function, "name") : nullptr;
      if ((type && *type != "function") || !name || !name->is_string())
        throw ApiError(400,
                       fmt::format("tools[{}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", i),
                       "tools", "invalid_value");
    }
    r.chat.tools = *tools;
  }
  const bool have_tools = tools && !tools->empty();
  std::string choice = have_tools ? "auto" : "none";
  if (const Json* tool_choice = field(body, "tool_choice")) {
    if (!tool_choice->is_string() && !tool_choice->is_object())
      bad_type("tool_choice", "\"none\", \"auto\", \"required\" or a named function", *tool_choice);
    if (tool_choice->is_object() || *tool_choice == "required")
      unsupported("tool_choice", "forcing a tool call (it needs constrained decoding)");
    choice = tool_choice->get<std::string>();
    if (choice != "none" && choice != "auto")
      throw ApiError(400, fmt::format("'tool_choice' must be \"none\", \"auto\" or \"required\", got \"{}\"", choice),
                     "tool_choice", "invalid_value");
    if (choice == "auto" && !have_tools)
      throw ApiError(400, "'tool_choice' \"auto\" needs 'tools'", "tool_choice", "invalid_value");
  }
  r.read_tool_calls = choice == "auto";
  if (auto v = bool_field(body, "parallel_tool_calls")) r.parallel_tool_calls = *v;
}

void read_chat(const Json& body, ApiRequest& r) {
  const Json* messages = field(body, "messages");
  if (!messages) throw ApiError(400, "'messages' is required: a list of messages", "messages", "missing_field");
  if (!messages->is_array() || messages->empty())
    throw ApiError(400, "'messages' must be a non-empty list of messages", "messages", "invalid_value");
  r.chat.messages = *messages;
  for (size_t i = 0; i < r.chat.messages.size(); ++i) {
    Json& m = r.chat.messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw ApiError(400, fmt::format("messages[{}] must be an object with a string 'role'", i), "messages");
    normalise_content(m, i);
    parse_tool_call_arguments(m, i);
  }
  read_tools(body, r);
  if (auto v = bool_field(body, "add_generation_prompt")) r.chat.add_generation_prompt = *v;
  if (const Json* kwargs = field(body, "chat_template_kwargs")) {
    if (!kwargs->is_object()) bad_type("chat_template_kwargs", "an object", *kwargs);
    r.chat.extra = *kwargs;
  }
}

}  // namespace

ApiRequest parse_api_request(Endpoint endpoint, const Json& body) {
  ApiRequest r;
  r.endpoint = endpoint;
  if (const Json* model = field(body, "model")) {
    if (!model->is_string()) bad_type("model", "a string", *model);
    r.model = model->get<std::string>();
  }
  refuse_unsupported(body, endpoint);
  if (endpoint == Endpoint::kCompletions)
    read_prompt(body, r);
  else
    read_chat(body, r);
  read_sampling(body, r);
  if (auto v = bool_field(body, "stream")) r.stream = *v;
  if (const Json* options = field(body, "stream_options")) {
    if (!r.stream) throw ApiError(400, "'stream_options' is only allowed with stream: true", "stream_options");
    if (!options->is_object()) bad_type("stream_options", "an object", *options);
    if (auto v = bool_field(*options, "include_usage")) r.include_usage = *v;
  }
  return r;
}

std::string sampling_param_in(std::string_view message) {
  constexpr std::string_view kPrefix = "sampling: ";
  const size_t at = message.find(kPrefix);
  if (at == std::string_view::npos) return "";
  for (const char* name : {"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty", "max_tokens", "stop token id", "stop string"}) {
    if (message.substr(at + kPrefix.size()).starts_with(name)) {
      const std::string_view n = name;
      return n == "stop token id" ? "stop_token_ids" : n == "stop string" ? "stop" : std::string(n);
    }
  }
  return "";
}

Json usage_json(const Usage& u) {
  return Json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

namespace {

bool is_chat(const ReplyHeader& h) { return h.endpoint == Endpoint::kChatCompletions; }

Json reply_base(const ReplyHeader& h, bool chunk) {
  const char* object = is_chat(h) ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion";
  return Json{{"id", h.id}, {"object", object}, {"created", h.created}, {"model", h.model}};
}

Json finish_json(const std::string& finish_reason) {
  return finish_reason.empty() ? Json(nullptr) : Json(finish_reason);
}

Json chunk_with_choice(const ReplyHeader& h, Json choice) {
  Json j = reply_base(h, true);
  j["choices"] = Json::array({std::move(choice)});
  if (h.include_usage) j["usage"] = nullptr;
  return j;
}

}  // namespace

namespace {

// A call as message.tool_calls holds it (and, with its index, as delta.tool_calls does).
Json tool_call_json(const ToolCall& call, bool with_index) {
  Json j = Json::object();
  if (with_index) j["index"] = call.index;
  j["id"] = call.id;
  j["type"] = "function";
  j["function"] = Json{{"name", call.name}, {"arguments", dump_json(call.arguments)}};
  return j;
}

}  // namespace

Json full_reply(const ReplyHeader& h, const ReplyText& text, const std::string& finish_reason, const Usage& usage) {
  Json j = reply_base(h, false);
  Json choice{{"index", 0}};
  if (is_chat(h)) {
    Json message{{"role", "assistant"}};
    message["content"] = text.content.empty() && !text.tool_calls.empty() ? Json(nullptr) : Json(text.content);
    message["reasoning_content"] = text.reasoning.empty() ? Json(nullptr) : Json(text.reasoning);
    if (!text.tool_calls.empty()) {
      Json calls = Json::array();
      for (const ToolCall& call : text.tool_calls) calls.push_back(tool_call_json(call, false));
      message["tool_calls"] = std::move(calls);
    }
    choice["message"] = std::move(message);
  } else {
    choice["text"] = text.content;
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish_json(finish_reason);
  j["choices"] = Json::array({std::move(choice)});
  j["usage"] = usage_json(usage);
  return j;
}

Json chat_role_chunk(const ReplyHeader& h) {
  return chunk_with_choice(h, Json{{"index", 0},
                                   {"delta", {{"role", "assistant"}, {"content", ""}}},
                                   {"logprobs", nullptr},
                                   {"finish_reason", nullptr}});
}

Json delta_chunk(const ReplyHeader& h, const ReplyText& delta, const std::string& finish_reason) {
  Json choice{{"index", 0}};
  if (is_chat(h)) {
    Json d = Json::object();
    if (!delta.reasoning.empty()) d["reasoning_content"] = delta.reasoning;
    if (!delta.content.empty()) d["content"] = delta.content;
    if (!delta.tool_calls.empty()) {
      Json calls = Json::array();
      for (const ToolCall& call : delta.tool_calls) calls.push_back(tool_call_json(call, true));
      d["tool_calls"] = std::move(calls);
    }
    choice["delta"] = std::move(d);
  } else {
    choice["text"] = delta.content;
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish_json(finish_reason);
  return chunk_with_choice(h, std::move(choice));
}

Json usage_chunk(const ReplyHeader& h, const Usage& usage) {
  Json j = reply_base(h, true);
  j["choices"] = Json::array();
  j["usage"] = usage_json(usage);
  return j;
}

std::string dump_json(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string sse_event(const Json& j) { return "data: " + dump_json(j) + "\n\n"; }

}  // namespace tpmoe::serve
