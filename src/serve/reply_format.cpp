#include "serve/reply_format.h"

#include <fmt/format.h>

#include <algorithm>

#include "serve/tool_calls.h"

namespace tpmoe::serve {

ReplyFormat reply_format_of_template(std::string_view source) {
  ReplyFormat format;
  if (source.find("<mm:think>") != std::string_view::npos) format.think = {"<mm:think>", "</mm:think>"};
  // MiniMax-M3's template spells the namespace token once, in a variable, and the tags after it.
  if (source.find(kMiniMaxNamespace) != std::string_view::npos &&
      source.find("<tool_call>") != std::string_view::npos && source.find("<invoke name=") != std::string_view::npos)
    format.tool_calls = ToolCallSyntax::kMiniMaxM3;
  return format;
}

std::string describe(const ReplyFormat& format) {
  return fmt::format("reasoning in {}...{}, {}", format.think.open, format.think.close,
                     format.tool_calls == ToolCallSyntax::kMiniMaxM3 ? "tool calls in MiniMax-M3's syntax"
                                                                     : "no tool-call syntax (tool calls stay text)");
}

size_t partial_tag_suffix(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n)
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  return 0;
}

}  // namespace tpmoe::serve
