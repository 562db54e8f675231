// libFuzzer target: the input is a model's reply, which the server reads for tool calls
// (ToolCallParser) and reasoning (ReasoningSplitter) as it streams. Model output is not to be
// trusted with the server: any bytes must parse without an exception, a crash or a sanitizer report,
// in time linear in their length (libFuzzer's -timeout catches a slow input). And streaming must not
// change the result: the reply fed in pieces (cut where the input's first bytes say) gives the same
// content, reasoning and calls as the reply fed whole.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "serve/reasoning.h"
#include "serve/tool_calls.h"

namespace {

using namespace tpmoe::serve;
using Json = nlohmann::ordered_json;

const Json& tools() {  // a schema of every type, so that the values' typing runs too
  static const Json t = Json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
    "b": {"type": "boolean"}, "z": {"type": "null"}, "a": {"type": "array", "items": {"type": "integer"}},
    "o": {"type": "object", "properties": {"x": {"type": "string"}, "y": {"anyOf": [{"type": "array"},
    {"type": "integer"}]}}}}}}}])");
  return t;
}

struct Result {
  std::string content, reasoning;
  std::vector<std::string> calls;  // name, then the arguments as JSON text
  bool operator==(const Result&) const = default;
};

Result read(std::string_view reply, const std::vector<size_t>& cuts, bool starts_in_reasoning) {
  ToolCallParser calls(ToolCallSyntax::kMiniMaxM3, tools(), "call_");
  ReasoningSplitter split(starts_in_reasoning, ThinkTags{"<mm:think>", "</mm:think>"});
  Result out;
  auto add = [&](const ToolCallDelta& d) {
    out.content += d.content;
    // Replies reach the parsers as valid UTF-8 (the detokenizer replaces ill-formed bytes); these
    // inputs need not be, so their dumps replace what is not.
    for (const ToolCall& c : d.calls)
      out.calls.push_back(c.name + c.id + c.arguments.dump(-1, ' ', false, Json::error_handler_t::replace));
  };
  auto piece = [&](std::string_view text) {
    const ReasoningDelta r = split.feed(text);
    out.reasoning += r.reasoning;
    add(calls.feed(r.content));
  };
  size_t from = 0;
  for (const size_t cut : cuts) {
    piece(reply.substr(from, cut - from));
    from = cut;
  }
  piece(reply.substr(from));
  const ReasoningDelta r = split.flush();
  out.reasoning += r.reasoning;
  add(calls.feed(r.content));
  add(calls.flush());
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // Byte 0: whether the reply starts inside the think block; byte 1: the piece length (1-16).
  const bool starts_in_reasoning = data[0] & 1;
  const size_t piece = 1 + data[1] % 16;
  const std::string_view reply(reinterpret_cast<const char*>(data + 2), size - 2);
  std::vector<size_t> cuts;
  for (size_t at = piece; at < reply.size(); at += piece) cuts.push_back(at);
  if (read(reply, {}, starts_in_reasoning) != read(reply, cuts, starts_in_reasoning)) __builtin_trap();
  return 0;
}
