// The OpenAI request and reply shapes (src/serve/openai_api.h): bodies read into sampling
// parameters with vLLM's names, each wrong type or unsupported value a 400 naming its field, and
// replies, chunks and errors shaped as OpenAI's clients parse them.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "serve/json_nesting.h"
#include "serve/openai_api.h"

namespace tpmoe::serve {
namespace {

ApiRequest parse(Endpoint endpoint, const std::string& body) {
  return parse_api_request(endpoint, parse_json_body(body));
}

// The request is refused with `status`, naming `param` (empty: no param).
void expect_refused(Endpoint endpoint, const std::string& body, int status, const std::string& param) {
  try {
    parse(endpoint, body);
    ADD_FAILURE() << "accepted: " << body;
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), status) << body << ": " << e.what();
    EXPECT_EQ(e.param(), param) << body << ": " << e.what();
    EXPECT_FALSE(std::string(e.what()).empty());
  }
}

TEST(ServeProtocol, CompletionFieldsMapOntoSamplingParams) {
  const ApiRequest r = parse(Endpoint::kCompletions, R"({
    "model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "top_k": 40,
    "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
    "seed": 1234, "stop": ["\n\n", "END"], "stop_token_ids": [3, 4], "ignore_eos": true, "n": 1,
    "stream": true, "stream_options": {"include_usage": true}, "user": "ignored", "logprobs": null})");
  EXPECT_EQ(r.model, "tiny");
  EXPECT_EQ(r.prompt_text, "hello");
  EXPECT_FALSE(r.prompt_is_ids);
  EXPECT_EQ(r.max_tokens, 12);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.8f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.05f);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(r.sampling.seed, 1234u);
  EXPECT_EQ(r.sampling.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(r.sampling.stop_token_ids, (std::vector<int32_t>{3, 4}));
  EXPECT_TRUE(r.sampling.ignore_eos);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST(ServeProtocol, DefaultsAreGreedyWithTheRestOfTheContext) {
  const ApiRequest r = parse(Endpoint::kCompletions, R"({"prompt": "x"})");
  EXPECT_TRUE(r.sampling.greedy());
  EXPECT_FALSE(r.max_tokens.has_value());  // the server fills in the rest of the context
  EXPECT_FALSE(r.sampling.seed.has_value());
  EXPECT_FALSE(r.stream);
  EXPECT_TRUE(r.model.empty());
}

TEST(ServeProtocol, PromptForms) {
  EXPECT_EQ(parse(Endpoint::kCompletions, R"({"prompt": [1, 2, 3]})").prompt_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(parse(Endpoint::kCompletions, R"({"prompt": [1, 2, 3]})").prompt_is_ids);
  EXPECT_EQ(parse(Endpoint::kCompletions, R"({"prompt": [[5, 6]]})").prompt_ids, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(parse(Endpoint::kCompletions, R"({"prompt": ["one"]})").prompt_text, "one");
  EXPECT_EQ(parse(Endpoint::kCompletions, R"({"stop": "x", "prompt": "p"})").sampling.stop,
            (std::vector<std::string>{"x"}));
  expect_refused(Endpoint::kCompletions, R"({"prompt": ["one", "two"]})", 400, "prompt");
  expect_refused(Endpoint::kCompletions, R"({"prompt": [1, "a"]})", 400, "prompt");
  expect_refused(Endpoint::kCompletions, R"({"prompt": 5})", 400, "prompt");
  expect_refused(Endpoint::kCompletions, R"({"max_tokens": 4})", 400, "prompt");
}

TEST(ServeProtocol, ChatMessagesAndTemplateArguments) {
  const ApiRequest r = parse(Endpoint::kChatCompletions, R"({
    "messages": [{"role": "system", "content": "be brief"},
                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    "max_tokens": 5, "max_completion_tokens": 7, "chat_template_kwargs": {"enable_thinking": false}})");
  ASSERT_EQ(r.chat.messages.size(), 2u);
  EXPECT_EQ(r.chat.messages[1]["content"], "a\nb");  // text parts joined
  EXPECT_EQ(r.max_tokens, 7);                        // max_completion_tokens wins
  EXPECT_EQ(r.chat.extra["enable_thinking"], false);
  EXPECT_TRUE(r.chat.add_generation_prompt);
  expect_refused(Endpoint::kChatCompletions, R"({"messages": []})", 400, "messages");
  expect_refused(Endpoint::kChatCompletions, R"({"messages": "hi"})", 400, "messages");
  expect_refused(Endpoint::kChatCompletions, R"({"messages": [{"content": "no role"}]})", 400, "messages");
  expect_refused(Endpoint::kChatCompletions,
                 R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})", 400,
                 "messages");
  expect_refused(Endpoint::kChatCompletions, R"({"prompt": "belongs to completions"})", 400, "messages");
  expect_refused(Endpoint::kCompletions, R"({"prompt": "p", "messages": []})", 400, "messages");
}

TEST(ServeProtocol, ToolsAndToolChoice) {
  const Endpoint chat = Endpoint::kChatCompletions;
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}])";
  const std::string user = R"("messages": [{"role": "user", "content": "hi"}])";
  // With tools, tool_choice defaults to "auto": the reply's calls are read.
  ApiRequest r = parse(chat, "{" + user + ", " + tools + "}");
  EXPECT_TRUE(r.read_tool_calls);
  EXPECT_TRUE(r.parallel_tool_calls);
  EXPECT_EQ(r.chat.tools[0]["function"]["name"], "f");
  r = parse(chat, "{" + user + ", " + tools + R"(, "tool_choice": "none", "parallel_tool_calls": false})");
  EXPECT_FALSE(r.read_tool_calls);
  EXPECT_FALSE(r.parallel_tool_calls);
  EXPECT_FALSE(parse(chat, "{" + user + "}").read_tool_calls);
  EXPECT_FALSE(parse(chat, "{" + user + R"(, "tools": []})").read_tool_calls);
  EXPECT_FALSE(parse(chat, "{" + user + R"(, "tool_choice": "none"})").read_tool_calls);
  // Forcing a call needs constrained decoding; "auto" needs tools; a tool must name its function.
  expect_refused(chat, "{" + user + ", " + tools + R"(, "tool_choice": "required"})", 400, "tool_choice");
  expect_refused(chat,
                 "{" + user + ", " + tools + R"(, "tool_choice": {"type": "function", "function": {"name": "f"}}})",
                 400, "tool_choice");
  expect_refused(chat, "{" + user + ", " + tools + R"(, "tool_choice": "sometimes"})", 400, "tool_choice");
  expect_refused(chat, "{" + user + ", " + tools + R"(, "tool_choice": 1})", 400, "tool_choice");
  expect_refused(chat, "{" + user + R"(, "tool_choice": "auto"})", 400, "tool_choice");
  expect_refused(chat, "{" + user + R"(, "tools": {"name": "f"}})", 400, "tools");
  expect_refused(chat, "{" + user + R"(, "tools": [{"type": "function", "function": {}}]})", 400, "tools");
  expect_refused(chat, "{" + user + R"(, "tools": [{"type": "retrieval", "function": {"name": "f"}}]})", 400, "tools");
  expect_refused(chat, "{" + user + ", " + tools + R"(, "parallel_tool_calls": "yes"})", 400, "parallel_tool_calls");
}

TEST(ServeProtocol, AssistantToolCallArgumentsAsTextBecomeObjects) {
  const ApiRequest r = parse(Endpoint::kChatCompletions, R"({"messages": [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}},
      {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": {"already": "an object"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})");
  const Json& calls = r.chat.messages[1]["tool_calls"];
  EXPECT_EQ(calls[0]["function"]["arguments"], Json({{"city", "Paris"}, {"days", 2}}));
  EXPECT_EQ(calls[1]["function"]["arguments"], Json({{"already", "an object"}}));
  for (const char* args : {R"("not json")", R"("[1, 2]")"})
    expect_refused(
        Endpoint::kChatCompletions,
        std::string(R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": )") +
            args + "}}]}]}",
        400, "messages");
  expect_refused(Endpoint::kChatCompletions, R"j({"messages": [{"role": "assistant", "tool_calls": "f()"}]})j", 400,
                 "messages");
}

TEST(ServeProtocol, WrongTypesAndUnsupportedValuesNameTheField) {
  const Endpoint c = Endpoint::kCompletions;
  expect_refused(c, R"({"prompt": "p", "temperature": "hot"})", 400, "temperature");
  expect_refused(c, R"({"prompt": "p", "max_tokens": 1.5})", 400, "max_tokens");
  expect_refused(c, R"({"prompt": "p", "top_k": 99999999999})", 400, "top_k");
  expect_refused(c, R"({"prompt": "p", "stop": 3})", 400, "stop");
  expect_refused(c, R"({"prompt": "p", "stop_token_ids": ["a"]})", 400, "stop_token_ids");
  expect_refused(c, R"({"prompt": "p", "ignore_eos": 1})", 400, "ignore_eos");
  expect_refused(c, R"({"prompt": "p", "model": 3})", 400, "model");
  expect_refused(c, R"({"prompt": "p", "n": 2})", 400, "n");
  expect_refused(c, R"({"prompt": "p", "best_of": 3})", 400, "best_of");
  expect_refused(c, R"({"prompt": "p", "logprobs": 2})", 400, "logprobs");
  expect_refused(c, R"({"prompt": "p", "echo": true})", 400, "echo");
  expect_refused(c, R"({"prompt": "p", "logit_bias": {"5": 100}})", 400, "logit_bias");
  expect_refused(c, R"({"prompt": "p", "suffix": "s"})", 400, "suffix");
  expect_refused(c, R"({"prompt": "p", "stream_options": {"include_usage": true}})", 400, "stream_options");
  expect_refused(Endpoint::kChatCompletions, R"({"messages": [{"role": "user"}], "logprobs": true})", 400, "logprobs");
  expect_refused(Endpoint::kChatCompletions,
                 R"({"messages": [{"role": "user"}], "response_format": {"type": "json_object"}})", 400,
                 "response_format");
  // Accepted: the defaults spelled out.
  EXPECT_NO_THROW(parse(c, R"({"prompt": "p", "n": 1, "logprobs": null, "echo": false, "logit_bias": {}})"));
}

TEST(ServeProtocol, MalformedBodies) {
  // The last: a number past a double's range, which the JSON parser reports as out_of_range, not as
  // a parse error (it reached the client as a 500 once).
  for (const char* body :
       {"{", "", "[1, 2]", "\"text\"", "{\"prompt\": \"\xff\"}", "{\"prompt\": \"p\", \"seed\": 6e333333}"}) {
    try {
      parse_json_body(body);
      ADD_FAILURE() << "accepted: " << body;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status(), 400) << body;
    }
  }
}

// Deeply nested JSON would make the code that copies and renders parsed values recurse past a
// thread's stack: refused before it is parsed, in the body and in the arguments text a message
// carries. Brackets inside strings do not count.
TEST(ServeProtocol, JsonNestedPastTheLimitIsRefused) {
  auto nested = [](int levels, const std::string& inner) {
    return std::string(size_t(levels), '[') + inner + std::string(size_t(levels), ']');
  };
  const std::string prompt = R"({"prompt": "p", "user": )";
  // The body is one level; "user" (ignored) holds the rest.
  EXPECT_NO_THROW(parse(Endpoint::kCompletions, prompt + nested(kMaxRequestNesting - 1, "1") + "}"));
  expect_refused(Endpoint::kCompletions, prompt + nested(kMaxRequestNesting, "1") + "}", 400, "");
  expect_refused(Endpoint::kCompletions, prompt + nested(100000, "") + "}", 400, "");
  EXPECT_NO_THROW(parse(Endpoint::kCompletions, R"({"prompt": ")" + nested(1000, "") + R"("})"));

  const std::string call = R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", )";
  auto arguments = [&](int levels) { return call + R"("arguments": "{\"a\": )" + nested(levels, "") + R"(}"}}]}]})"; };
  EXPECT_NO_THROW(parse(Endpoint::kChatCompletions, arguments(kMaxRequestNesting - 1)));
  expect_refused(Endpoint::kChatCompletions, arguments(kMaxRequestNesting), 400, "messages");
}

TEST(ServeProtocol, JsonNestingIsCountedOutsideStrings) {
  EXPECT_EQ(json_nesting("", 10), 0);
  EXPECT_EQ(json_nesting("3", 10), 0);
  EXPECT_EQ(json_nesting(R"({"a": [1, {"b": []}], "c": {}})", 10), 4);
  EXPECT_EQ(json_nesting(R"(["[[[", "\"[[", "\\", [])", 10), 2) << "brackets in strings, escaped quotes";
  EXPECT_EQ(json_nesting("]]]][", 10), 1) << "unbalanced closers count as nothing";
  EXPECT_EQ(json_nesting("[[[[[[", 3), 4) << "past the limit: limit + 1";
}

TEST(ServeProtocol, SamplingValidateMessagesNameTheirField) {
  SamplingParams sp;
  sp.temperature = -1;
  try {
    sp.validate();
    FAIL() << "temperature -1 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(sampling_param_in(e.what()), "temperature");
  }
  EXPECT_EQ(sampling_param_in("sampling: top_p must be in (0, 1]"), "top_p");
  EXPECT_EQ(sampling_param_in("sampling: stop token id 5 outside the vocabulary"), "stop_token_ids");
  EXPECT_EQ(sampling_param_in("sampling: stop string 0 is empty"), "stop");
  EXPECT_EQ(sampling_param_in("something else"), "");
}

TEST(ServeProtocol, ErrorJson) {
  const Json e = error_json(404, "the model 'x' does not exist", "model", "model_not_found");
  EXPECT_EQ(e["error"]["message"], "the model 'x' does not exist");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "model");
  EXPECT_EQ(e["error"]["code"], "model_not_found");
  const Json internal = error_json(500, "boom");
  EXPECT_EQ(internal["error"]["type"], "internal_server_error");
  EXPECT_TRUE(internal["error"]["param"].is_null());
  EXPECT_TRUE(internal["error"]["code"].is_null());
}

TEST(ServeProtocol, ReplyShapes) {
  ReplyHeader h{Endpoint::kChatCompletions, "chatcmpl-1", 1700000000, "tiny", true};
  const Json full = full_reply(h, {"thought", "answer", {}}, "stop", {10, 3});
  EXPECT_EQ(full["object"], "chat.completion");
  EXPECT_EQ(full["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(full["choices"][0]["message"]["content"], "answer");
  EXPECT_EQ(full["choices"][0]["message"]["reasoning_content"], "thought");
  EXPECT_EQ(full["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(full["usage"]["total_tokens"], 13);

  const Json chunk = delta_chunk(h, {"", "piece", {}}, "");
  EXPECT_EQ(chunk["object"], "chat.completion.chunk");
  EXPECT_EQ(chunk["choices"][0]["delta"]["content"], "piece");
  EXPECT_FALSE(chunk["choices"][0]["delta"].contains("reasoning_content"));
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(chunk.contains("usage") && chunk["usage"].is_null());  // include_usage: null until the last
  EXPECT_EQ(chat_role_chunk(h)["choices"][0]["delta"]["role"], "assistant");
  const Json usage = usage_chunk(h, {10, 3});
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 3);

  // Tool calls: arguments as JSON text; content null when there is no other text; in a stream,
  // each call whole with its index.
  ToolCall call;
  call.index = 1;
  call.id = "call_x_1";
  call.name = "get_weather";
  call.arguments = {{"city", "Paris"}, {"days", 2}};
  const Json with_call = full_reply(h, {"", "", {call}}, "tool_calls", {10, 3});
  const Json& message = with_call["choices"][0]["message"];
  EXPECT_TRUE(message["content"].is_null());
  ASSERT_EQ(message["tool_calls"].size(), 1u);
  EXPECT_EQ(message["tool_calls"][0],
            Json({{"id", "call_x_1"},
                  {"type", "function"},
                  {"function", {{"name", "get_weather"}, {"arguments", R"({"city":"Paris","days":2})"}}}}));
  EXPECT_EQ(with_call["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(full_reply(h, {"", "text", {call}}, "tool_calls", {1, 1})["choices"][0]["message"]["content"], "text");
  EXPECT_FALSE(full["choices"][0]["message"].contains("tool_calls"));
  const Json call_chunk = delta_chunk(h, {"", "", {call}}, "");
  EXPECT_FALSE(call_chunk["choices"][0]["delta"].contains("content"));
  EXPECT_EQ(call_chunk["choices"][0]["delta"]["tool_calls"][0]["index"], 1);
  EXPECT_EQ(call_chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "get_weather");

  h.endpoint = Endpoint::kCompletions;
  h.include_usage = false;
  const Json text = delta_chunk(h, {"", "abc", {}}, "length");
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "abc");
  EXPECT_EQ(text["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(text.contains("usage"));
  EXPECT_EQ(sse_event(Json{{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(dump_json(Json("\xff")), "\"\xef\xbf\xbd\"");  // invalid UTF-8 replaced, not thrown
}

}  // namespace
}  // namespace tpmoe::serve
