// Reasoning apart from the answer: MiniMax-M3 thinks between `<mm:think>` and `</mm:think>` before it
// answers (MiniMax-M2, DeepSeek-R1 and Qwen3 between `<think>` and `</think>`; the model's tags come
// from its chat template, reply_format.h). The chat API returns the thinking as `reasoning_content`
// (the field vLLM and SGLang use) and the answer as `content`; streamed, the text arrives in pieces
// that may split a tag anywhere, so the splitter holds back a tail that could still become one.
#pragma once

#include <string>
#include <string_view>

#include "serve/reply_format.h"

namespace tpmoe::serve {

// Text a piece of the reply adds to each field (either may be empty).
struct ReasoningDelta {
  std::string reasoning;
  std::string content;
};

// One reply's text, split as it streams. Text before an opening tag is content; from it to the
// closing tag is reasoning (the tags themselves go nowhere); after the closing tag everything is
// content, tags included: a model thinks once per reply, and an answer may well mention its tag.
class ReasoningSplitter {
 public:
  // `starts_in_reasoning`: the prompt already opened the think block (prompt_opens_reasoning), so
  // the reply starts inside it and ends its reasoning with the closing tag.
  explicit ReasoningSplitter(bool starts_in_reasoning, ThinkTags tags = {});

  ReasoningDelta feed(std::string_view text);
  // The reply ended: the held-back tail (a tag that never completed) is text of the current field.
  ReasoningDelta flush();

  bool in_reasoning() const { return phase_ == Phase::kReasoning; }

 private:
  enum class Phase { kBeforeReasoning, kReasoning, kAnswer };
  void append(ReasoningDelta& delta, std::string_view text) const;

  ThinkTags tags_;
  Phase phase_;
  std::string held_;  // a proper prefix of the tag being looked for, seen at the end of the text so far
};

// True when `prompt` (a rendered chat) ends inside an open think block: its last opening tag comes
// after its last closing tag. A template that opens the block for the reply does this.
bool prompt_opens_reasoning(std::string_view prompt, const ThinkTags& tags = {});

}  // namespace tpmoe::serve
