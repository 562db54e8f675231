// How a model marks up its replies: the tags around its thinking and the syntax of its tool calls.
// Both belong to the model, not to the API: MiniMax-M2 thinks between `<think>` and `</think>`,
// MiniMax-M3 between `<mm:think>` and `</mm:think>`, and M3 writes tool calls as XML whose every tag
// carries its namespace token (serve/tool_calls.h). The server reads them off the model's chat
// template, which renders the same markup back into a conversation's earlier turns.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tpmoe::serve {

struct ThinkTags {
  std::string open = "<think>";
  std::string close = "</think>";
};

enum class ToolCallSyntax {
  kNone,       // the template renders no tool calls the server knows how to read back
  kMiniMaxM3,  // ]<]minimax[>[<tool_call> ... <invoke name="f"> <param>value</param> ... (tool_calls.h)
};

struct ReplyFormat {
  ThinkTags think;
  ToolCallSyntax tool_calls = ToolCallSyntax::kNone;
};

// The format a chat template's own rendering of assistant turns uses: `<mm:think>` tags where the
// template writes them (else `<think>`), MiniMax-M3 tool calls where it writes their namespace token
// and `<tool_call>` tag.
ReplyFormat reply_format_of_template(std::string_view template_source);

// One line for the server's start-up message, e.g. "reasoning in <mm:think>...</mm:think>, tool calls
// in MiniMax-M3's syntax".
std::string describe(const ReplyFormat& format);

// Length of the longest suffix of `text` that is a proper prefix of `tag`: text a streaming reader
// holds back, since it may become the tag when more arrives.
size_t partial_tag_suffix(std::string_view text, std::string_view tag);

}  // namespace tpmoe::serve
