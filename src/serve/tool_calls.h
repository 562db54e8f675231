// Tool calls read out of a reply's text, as the chat API returns them (`message.tool_calls`, and
// `delta.tool_calls` when streamed).
//
// MiniMax-M3 writes its calls as the inverse of what its chat template renders for an assistant
// turn's tool_calls: one block of invokes, every tag led by the namespace token ]<]minimax[>[ (NS):
//
//   NS<tool_call>
//   NS<invoke name="get_weather">NS<city>Paris NS</city>NS<days>3NS</days>NS</invoke>
//   NS</tool_call>
//
// A parameter is named by its tag; a value that is an object or a list is nested the same way
// (NS<key>...NS</key> per field, NS<item>...NS</item> per element); booleans are written as JSON,
// everything else as its plain text. Models do not always repeat NS before a closing tag, so inside a
// block NS is optional. The values are typed by the request's tool schemas: a parameter declared a
// string stays the text as written, an integer, number, boolean or null is read as one (kept as text
// when it does not read), an object or array from its nested tags (or from JSON text); an undeclared
// parameter is read as JSON where it is JSON, else kept as text.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "serve/reply_format.h"

namespace tpmoe::serve {

inline constexpr std::string_view kMiniMaxNamespace = "]<]minimax[>[";

struct ToolCall {
  int index = 0;   // its place among the reply's calls
  std::string id;  // "call_..." unique in this process
  std::string name;
  nlohmann::ordered_json arguments = nlohmann::ordered_json::object();  // as read, keys in order
};

// What a piece of the reply's content adds: text that stays content, and calls now complete.
struct ToolCallDelta {
  std::string content;
  std::vector<ToolCall> calls;
};

// One reply's content, read as it streams. Text outside a tool-call block is content; a block's
// invokes come out as calls, each once its closing tag has arrived. A tail that could still become a
// block's opening tag is held back until the next piece decides it. Text inside a block that is not
// an invoke (the newlines between them) is dropped. A call of a function the request did not list
// comes out all the same, its values untyped: the client decides what to do with it.
class ToolCallParser {
 public:
  // `tools`: the request's list (OpenAI's [{"type": "function", "function": {"name", "parameters"}}]),
  // whose parameter schemas type the values. `id_prefix`: call i gets the id id_prefix + i.
  ToolCallParser(ToolCallSyntax syntax, const nlohmann::ordered_json& tools, std::string id_prefix);

  ToolCallDelta feed(std::string_view text);
  // The reply ended. A held-back tail is content; so is a block the reply did not finish (its
  // completed calls came out already), as written, so that nothing the model wrote is lost.
  ToolCallDelta flush();

 private:
  // Takes the complete invokes out of the open block; returns where the block's closing tag starts in
  // block_ (npos: not yet written).
  size_t read_block(ToolCallDelta& out);
  void emit(std::string_view invoke, ToolCallDelta& out);
  void end_block();

  ToolCallSyntax syntax_;
  nlohmann::ordered_json tools_;
  std::string id_prefix_;
  int calls_ = 0;
  bool in_block_ = false;
  int block_calls_ = 0;  // calls read out of the open block
  std::string held_;     // outside a block: a tail that may be the start of an opening tag
  std::string block_;    // inside one: its text as written since its opening tag
  size_t read_ = 0;      // block_ before this is the invokes already read
  // Where the next search of block_ for the block's closing tag, and for an invoke's, starts.
  size_t block_close_from_ = 0, invoke_close_from_ = 0;
};

// The arguments of one invoke's body (NS removed), typed by `parameters` (the function's JSON schema;
// null: untyped). Exposed for tests.
nlohmann::ordered_json read_tool_arguments(std::string_view body, const nlohmann::ordered_json& parameters);

}  // namespace tpmoe::serve
