// Tool calls read out of replies (src/serve/tool_calls.h) and the reply format read off a chat
// template (src/serve/reply_format.h). The reader is checked against MiniMax-M3's own chat template:
// what the template renders for an assistant turn's tool_calls, read back, gives those calls, whole
// and streamed in every split. Then the values' typing by the tools' schemas, markup the template
// does not write but models do (no namespace token before a closing tag), and text that only looks
// like a call.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "serve/reasoning.h"
#include "serve/reply_format.h"
#include "serve/tool_calls.h"
#include "test_util.h"
#include "text/chat_template.h"

namespace tpmoe::serve {
namespace {

using Json = nlohmann::ordered_json;

const std::string kNs(kMiniMaxNamespace);

std::string m3_template() { return test::read_text_file(test::chat_template_path("minimax_m3.jinja")); }

const Json& weather_tools() {
  static const Json tools = Json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
      "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
      "zip": {"type": "string"}, "threshold": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "plan_trip", "parameters": {"type": "object", "properties": {
      "stops": {"type": "array", "items": {"type": "object", "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}}}},
      "budget": {"type": "object", "properties": {"amount": {"type": "number"}, "currency": {"type": "string"}}},
      "tags": {"type": "array", "items": {"type": "string"}},
      "note": {"type": "string"}}}}}
  ])");
  return tools;
}

// Calls as an assistant turn gives them to the template (arguments as objects).
const Json& assistant_calls() {
  static const Json calls = Json::parse(R"([
    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments":
      {"city": "Paris", "days": 3, "metric": true, "zip": "75001", "threshold": 21.5}}},
    {"id": "b", "type": "function", "function": {"name": "plan_trip", "arguments": {
      "stops": [{"city": "Lyon", "nights": 2}, {"city": "Nice", "nights": 1}],
      "budget": {"amount": 1200.5, "currency": "EUR"},
      "tags": ["food", "sea"],
      "note": "a < b, \"quoted\"\nand a second line"}}}
  ])");
  return calls;
}

// The reply text MiniMax-M3's template renders for an assistant turn with `calls` after `content`:
// the assistant turn of a rendered conversation, from after its think prefix to its end token.
std::string rendered_reply(const std::string& content, const Json& calls) {
  text::ChatRequest request;
  request.messages = Json::array({Json{{"role", "user"}, {"content", "Weather in Paris, then plan a trip."}},
                                  Json{{"role", "assistant"}, {"content", content}, {"tool_calls", calls}}});
  request.tools = weather_tools();
  request.add_generation_prompt = false;
  const std::string prompt =
      text::ChatTemplate::parse(m3_template()).render(text::make_chat_context(request, Json::object()));
  const std::string turn_start = "]~b]ai\n</mm:think>", turn_end = "[e~[";
  const size_t from = prompt.rfind(turn_start);
  EXPECT_NE(from, std::string::npos) << prompt;
  const size_t begin = from + turn_start.size(), end = prompt.find(turn_end, begin);
  return prompt.substr(begin, end - begin);
}

ToolCallDelta read_pieces(std::string_view text, const std::vector<size_t>& cuts, const Json& tools = weather_tools()) {
  ToolCallParser parser(ToolCallSyntax::kMiniMaxM3, tools, "call_t_");
  ToolCallDelta out;
  auto add = [&](ToolCallDelta d) {
    out.content += d.content;
    for (ToolCall& c : d.calls) out.calls.push_back(std::move(c));
  };
  size_t from = 0;
  for (size_t cut : cuts) {
    add(parser.feed(text.substr(from, cut - from)));
    from = cut;
  }
  add(parser.feed(text.substr(from)));
  add(parser.flush());
  return out;
}

void expect_calls(const ToolCallDelta& got, const Json& calls, const std::string& context) {
  ASSERT_EQ(got.calls.size(), calls.size()) << context;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(got.calls[i].index, int(i)) << context;
    EXPECT_EQ(got.calls[i].id, "call_t_" + std::to_string(i)) << context;
    EXPECT_EQ(got.calls[i].name, calls[i]["function"]["name"].get<std::string>()) << context;
    EXPECT_EQ(got.calls[i].arguments, calls[i]["function"]["arguments"]) << context;
    EXPECT_EQ(got.calls[i].arguments.dump(), calls[i]["function"]["arguments"].dump()) << context << ": key order";
  }
}

TEST(ToolCalls, ReadBackWhatTheM3TemplateRenders) {
  const std::string reply = rendered_reply("Let me check.", assistant_calls());
  ASSERT_NE(reply.find(kNs + "<tool_call>"), std::string::npos) << reply;
  const ToolCallDelta whole = read_pieces(reply, {});
  EXPECT_EQ(whole.content, "Let me check.");
  expect_calls(whole, assistant_calls(), "whole");
}

TEST(ToolCalls, EverySplitIntoTwoPiecesAndByteByByte) {
  const std::string reply = rendered_reply("Checking.", assistant_calls());
  for (size_t i = 0; i <= reply.size(); ++i) {
    const ToolCallDelta d = read_pieces(reply, {i});
    EXPECT_EQ(d.content, "Checking.") << "cut at " << i;
    expect_calls(d, assistant_calls(), "cut at " + std::to_string(i));
  }
  std::vector<size_t> every;
  for (size_t i = 1; i < reply.size(); ++i) every.push_back(i);
  const ToolCallDelta bytes = read_pieces(reply, every);
  EXPECT_EQ(bytes.content, "Checking.");
  expect_calls(bytes, assistant_calls(), "byte by byte");
}

TEST(ToolCalls, EachCallComesOutOnceItsInvokeCloses) {
  const std::string reply = rendered_reply("", assistant_calls());
  ToolCallParser parser(ToolCallSyntax::kMiniMaxM3, weather_tools(), "c");
  const size_t first_end = reply.find("</invoke>") + std::string("</invoke>").size();
  EXPECT_TRUE(parser.feed(reply.substr(0, first_end - 1)).calls.empty());
  const ToolCallDelta first = parser.feed(reply.substr(first_end - 1, 1));
  ASSERT_EQ(first.calls.size(), 1u);
  EXPECT_EQ(first.calls[0].name, "get_weather");
  const ToolCallDelta rest = parser.feed(reply.substr(first_end));
  ASSERT_EQ(rest.calls.size(), 1u);
  EXPECT_EQ(rest.calls[0].name, "plan_trip");
  EXPECT_EQ(rest.content, "");
  EXPECT_TRUE(parser.flush().content.empty());
}

TEST(ToolCalls, ValuesTypedByTheSchema) {
  const Json schema = Json::parse(R"({"type": "object", "properties": {
      "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
      "maybe": {"type": ["integer", "null"]}, "o": {"type": "object"}, "a": {"type": "array"},
      "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}})");
  auto read = [&](const std::string& body) { return read_tool_arguments(body, schema); };
  EXPECT_EQ(read("<s>007</s>"), Json({{"s", "007"}}));  // a string stays as written
  EXPECT_EQ(read("<s> padded \n</s>"), Json({{"s", " padded \n"}}));
  EXPECT_EQ(read("<i>42</i>"), Json({{"i", 42}}));
  EXPECT_EQ(read("<i>4.5</i>"), Json({{"i", "4.5"}}));  // not an integer: kept as text
  EXPECT_EQ(read("<n>-1e3</n>"), Json({{"n", -1000.0}}));
  EXPECT_EQ(read("<b>false</b>"), Json({{"b", false}}));
  EXPECT_EQ(read("<b>yes</b>"), Json({{"b", "yes"}}));
  EXPECT_EQ(read("<maybe>null</maybe>"), Json({{"maybe", nullptr}}));
  EXPECT_EQ(read("<o><k>v</k></o>"), Json({{"o", {{"k", "v"}}}}));
  EXPECT_EQ(read(R"(<o>{"k": [1, 2]}</o>)"), Json({{"o", {{"k", {1, 2}}}}}));  // JSON text for an object
  EXPECT_EQ(read("<a></a>"), Json({{"a", Json::array()}}));
  EXPECT_EQ(read("<o></o>"), Json({{"o", Json::object()}}));
  EXPECT_EQ(read("<a><item>1</item><item>x</item></a>"), Json({{"a", {1, "x"}}}));  // items untyped
  EXPECT_EQ(read("<any>12</any>"), Json({{"any", 12}}));
  // Undeclared: JSON where it reads as JSON, nested markup as objects and lists, else text.
  EXPECT_EQ(read("<u>3</u><v>Paris</v><w>true</w>"), Json({{"u", 3}, {"v", "Paris"}, {"w", true}}));
  EXPECT_EQ(read("<u><item><p>1</p></item></u>"), Json({{"u", Json::array({Json{{"p", 1}}})}}));
  EXPECT_EQ(read("<u><b>bold</b> text</u>"), Json({{"u", "<b>bold</b> text"}}));  // not all markup: text
  // The same name nested inside a value closes at its own level.
  EXPECT_EQ(read("<u><u>1</u></u>"), Json({{"u", {{"u", 1}}}}));
  EXPECT_EQ(read("<s>a <s>b</s> c</s>"), Json({{"s", "a <s>b</s> c"}}));
}

// A reply can nest its markup as deep as it is long. Values past 32 levels are kept as their text,
// and reading takes one pass over the text a level, whole or streamed: this reply took seconds at a
// few thousand levels when each level searched its text anew, and minutes streamed when every piece
// searched the whole block again.
TEST(ToolCalls, DeepNestingIsReadInBoundedTimeAndKeptAsTextPastTheLimit) {
  const int levels = 20000;
  std::string value;
  for (int i = 0; i < levels; ++i) value += "<a>";
  value += "x";
  for (int i = 0; i < levels; ++i) value += "</a>";
  const std::string reply = "before" + kNs + "<tool_call>" + kNs + "<invoke name=\"f\">" + kNs + "<v>" + value + kNs +
                            "</v>" + kNs + "</invoke>" + kNs + "</tool_call>after";
  std::vector<size_t> pieces;  // as a stream of 4-byte tokens
  for (size_t i = 4; i < reply.size(); i += 4) pieces.push_back(i);
  for (const std::vector<size_t>& cuts : {std::vector<size_t>{}, pieces}) {
    const ToolCallDelta d = read_pieces(reply, cuts);
    EXPECT_EQ(d.content, "beforeafter");
    ASSERT_EQ(d.calls.size(), 1u);
    // v (level 0) holds a, a, ...: 32 levels of objects, then the rest as it was written.
    const Json* at = &d.calls[0].arguments.at("v");
    int depth = 0;
    while (at->is_object() && at->contains("a")) {
      at = &at->at("a");
      ++depth;
    }
    EXPECT_EQ(depth, 32);
    ASSERT_TRUE(at->is_string());
    EXPECT_EQ(at->get<std::string>().size(), value.size() - 32 * 7);
  }
  // JSON text nested past the limit is kept as text too.
  const std::string deep_json = std::string(40, '[') + std::string(40, ']');
  EXPECT_EQ(read_tool_arguments("<v>" + deep_json + "</v>", Json()).at("v"), Json(deep_json));
  EXPECT_EQ(read_tool_arguments("<v>[[1]]</v>", Json()).at("v"), Json::parse("[[1]]"));
}

TEST(ToolCalls, ClosingTagsWithoutTheNamespaceToken) {
  // Seen from MiniMax-M3: the namespace token before the opening tags only.
  const std::string reply = "Searching." + kNs + "<tool_call>\n" + kNs + "<invoke name=\"search\">" + kNs +
                            "<query>AI news</query>" + kNs + "<limit>6</limit></invoke>\n</tool_call>";
  const ToolCallDelta d = read_pieces(reply, {});
  EXPECT_EQ(d.content, "Searching.");
  ASSERT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.calls[0].name, "search");
  EXPECT_EQ(d.calls[0].arguments, Json({{"query", "AI news"}, {"limit", 6}}));  // "search" is not in the tools
}

TEST(ToolCalls, TextThatIsNotACallStaysContent) {
  for (const std::string& text : {std::string("I would use <tool_call> here, and <invoke name=\"x\">."),
                                  std::string("a ]<]mini and ]<] and ] < ] <"), kNs + "<tool_cal", kNs}) {
    const ToolCallDelta d = read_pieces(text, {});
    EXPECT_EQ(d.content, text);
    EXPECT_TRUE(d.calls.empty()) << text;
  }
  // Content on both sides of a block, and a second block.
  const std::string call = kNs + "<invoke name=\"f\">" + kNs + "<x>1" + kNs + "</x>" + kNs + "</invoke>";
  const std::string two = "before" + kNs + "<tool_call>" + call + kNs + "</tool_call>middle" + kNs + "<tool_call>" +
                          call + kNs + "</tool_call>after";
  const ToolCallDelta d = read_pieces(two, {});
  EXPECT_EQ(d.content, "beforemiddleafter");
  ASSERT_EQ(d.calls.size(), 2u);
  EXPECT_EQ(d.calls[1].index, 1);
}

TEST(ToolCalls, AnUnfinishedBlockIsReturnedAsWritten) {
  const std::string call = kNs + "<invoke name=\"f\">" + kNs + "<x>1" + kNs + "</x>" + kNs + "</invoke>\n";
  const std::string cut = kNs + "<invoke name=\"g\">" + kNs + "<y>partial";
  // Cut inside its first invoke: the whole block is content.
  ToolCallDelta d = read_pieces("ok" + kNs + "<tool_call>\n" + cut, {});
  EXPECT_TRUE(d.calls.empty());
  EXPECT_EQ(d.content, "ok" + kNs + "<tool_call>\n" + cut);
  // Cut after a complete one: that call, and the rest as written (from the newline after it).
  d = read_pieces(kNs + "<tool_call>\n" + call + cut, {});
  ASSERT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.content, "\n" + cut);
  // Ended after its last invoke without the closing tag: the calls, no stray text.
  d = read_pieces(kNs + "<tool_call>\n" + call + kNs, {});
  EXPECT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.content, "");
}

TEST(ToolCalls, NoSyntaxPassesTextThrough) {
  const std::string reply = rendered_reply("x", assistant_calls());
  ToolCallParser parser(ToolCallSyntax::kNone, weather_tools(), "c");
  ToolCallDelta d = parser.feed(reply);
  EXPECT_EQ(d.content, reply);
  EXPECT_TRUE(d.calls.empty());
  EXPECT_TRUE(parser.flush().content.empty());
}

TEST(ReplyFormat, ReadOffTheTemplate) {
  const ReplyFormat m3 = reply_format_of_template(m3_template());
  EXPECT_EQ(m3.think.open, "<mm:think>");
  EXPECT_EQ(m3.think.close, "</mm:think>");
  EXPECT_EQ(m3.tool_calls, ToolCallSyntax::kMiniMaxM3);
  EXPECT_EQ(describe(m3), "reasoning in <mm:think>...</mm:think>, tool calls in MiniMax-M3's syntax");
  for (const char* name : {"minimax_m2.jinja", "qwen3.jinja", "chatml_plain.jinja"}) {
    const ReplyFormat f = reply_format_of_template(test::read_text_file(test::chat_template_path(name)));
    EXPECT_EQ(f.think.open, "<think>") << name;
    EXPECT_EQ(f.tool_calls, ToolCallSyntax::kNone) << name;
  }
}

TEST(ReplyFormat, M3ReasoningTags) {
  // The M3 template's generation prompt with thinking enabled opens <mm:think> for the reply.
  text::ChatRequest request;
  request.messages = Json::array({Json{{"role", "user"}, {"content", "hi"}}});
  request.extra = {{"thinking_mode", "enabled"}};
  const std::string prompt =
      text::ChatTemplate::parse(m3_template()).render(text::make_chat_context(request, Json::object()));
  const ThinkTags tags = reply_format_of_template(m3_template()).think;
  EXPECT_TRUE(prompt_opens_reasoning(prompt, tags));
  EXPECT_FALSE(prompt_opens_reasoning(prompt));  // <think> tags: not this model's
  // Adaptive (the default) leaves the reply to open the block itself; the system prompt's mention of
  // both tags does not open it.
  request.extra = Json::object();
  EXPECT_FALSE(prompt_opens_reasoning(
      text::ChatTemplate::parse(m3_template()).render(text::make_chat_context(request, Json::object())), tags));
  ReasoningSplitter s(false, tags);
  ReasoningDelta d = s.feed("<mm:think>hm</mm:think>Hi <think>");
  const ReasoningDelta tail = s.flush();
  EXPECT_EQ(d.reasoning + tail.reasoning, "hm");
  EXPECT_EQ(d.content + tail.content, "Hi <think>");
}

}  // namespace
}  // namespace tpmoe::serve
