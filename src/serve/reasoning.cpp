#include "serve/reasoning.h"

#include <utility>

namespace tpmoe::serve {

ReasoningSplitter::ReasoningSplitter(bool starts_in_reasoning, ThinkTags tags)
    : tags_(std::move(tags)), phase_(starts_in_reasoning ? Phase::kReasoning : Phase::kBeforeReasoning) {}

void ReasoningSplitter::append(ReasoningDelta& delta, std::string_view text) const {
  (phase_ == Phase::kReasoning ? delta.reasoning : delta.content).append(text);
}

ReasoningDelta ReasoningSplitter::feed(std::string_view text) {
  ReasoningDelta delta;
  if (phase_ == Phase::kAnswer) {
    delta.content.append(text);
    return delta;
  }
  std::string buffer = std::move(held_);
  held_.clear();
  buffer.append(text);
  std::string_view rest = buffer;
  while (phase_ != Phase::kAnswer) {
    const std::string_view tag = phase_ == Phase::kReasoning ? tags_.close : tags_.open;
    const size_t at = rest.find(tag);
    if (at == std::string_view::npos) {
      const size_t keep = partial_tag_suffix(rest, tag);
      append(delta, rest.substr(0, rest.size() - keep));
      held_ = rest.substr(rest.size() - keep);
      return delta;
    }
    append(delta, rest.substr(0, at));
    rest.remove_prefix(at + tag.size());
    phase_ = phase_ == Phase::kReasoning ? Phase::kAnswer : Phase::kReasoning;
  }
  delta.content.append(rest);
  return delta;
}

ReasoningDelta ReasoningSplitter::flush() {
  ReasoningDelta delta;
  append(delta, held_);
  held_.clear();
  return delta;
}

bool prompt_opens_reasoning(std::string_view prompt, const ThinkTags& tags) {
  const size_t open = prompt.rfind(tags.open);
  if (open == std::string_view::npos) return false;
  const size_t close = prompt.rfind(tags.close);
  return close == std::string_view::npos || close < open;
}

}  // namespace tpmoe::serve
