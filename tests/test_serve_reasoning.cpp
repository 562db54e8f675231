// The reasoning splitter (src/serve/reasoning.h): <think>...</think> goes to reasoning, the rest to
// content, whatever the pieces the text streams in (every split point of every case), and a prompt
// that opened the think block starts the reply inside it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "serve/reasoning.h"

namespace tpmoe::serve {
namespace {

ReasoningDelta split_whole(std::string_view text, bool starts_in_reasoning) {
  ReasoningSplitter s(starts_in_reasoning);
  ReasoningDelta d = s.feed(text);
  const ReasoningDelta tail = s.flush();
  d.reasoning += tail.reasoning;
  d.content += tail.content;
  return d;
}

// The text fed in pieces cut at `cuts` (increasing offsets), then flushed.
ReasoningDelta split_pieces(std::string_view text, const std::vector<size_t>& cuts, bool starts_in_reasoning) {
  ReasoningSplitter s(starts_in_reasoning);
  ReasoningDelta out;
  size_t from = 0;
  auto add = [&](const ReasoningDelta& d) {
    out.reasoning += d.reasoning;
    out.content += d.content;
  };
  for (size_t cut : cuts) {
    add(s.feed(text.substr(from, cut - from)));
    from = cut;
  }
  add(s.feed(text.substr(from)));
  add(s.flush());
  return out;
}

struct Case {
  std::string text;
  bool starts_in_reasoning;
  std::string reasoning, content;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"plain answer", false, "", "plain answer"},
      {"<think>step one\nstep two</think>\n\nThe answer is 4.", false, "step one\nstep two", "\n\nThe answer is 4."},
      {"step one</think>The answer", true, "step one", "The answer"},
      {"still thinking when the reply was cut", true, "still thinking when the reply was cut", ""},
      {"<think>unfinished <thi", false, "unfinished <thi", ""},  // a tag that never completed is text
      {"a < b and c </ d", false, "", "a < b and c </ d"},
      {"x</think>y<think>z</think>", true, "x", "y<think>z</think>"},  // one think block per reply
      {"Hello <think>hm</think>there", false, "hm", "Hello there"},
      {"</think>answer", true, "", "answer"},
      {"<think></think>", false, "", ""},
      {"<<think>>a</think>>", false, ">a", "<>"},
      {"caf\xc3\xa9 \xe2\x9c\x93</think>\xf0\x9f\x99\x82", true, "caf\xc3\xa9 \xe2\x9c\x93", "\xf0\x9f\x99\x82"},
  };
  return all;
}

TEST(ReasoningSplitter, WholeText) {
  for (const Case& c : cases()) {
    const ReasoningDelta d = split_whole(c.text, c.starts_in_reasoning);
    EXPECT_EQ(d.reasoning, c.reasoning) << c.text;
    EXPECT_EQ(d.content, c.content) << c.text;
  }
}

TEST(ReasoningSplitter, EverySplitIntoTwoAndThreePieces) {
  for (const Case& c : cases()) {
    const size_t n = c.text.size();
    for (size_t i = 0; i <= n; ++i)
      for (size_t j = i; j <= n; ++j) {
        const ReasoningDelta d = split_pieces(c.text, {i, j}, c.starts_in_reasoning);
        ASSERT_EQ(d.reasoning, c.reasoning) << c.text << " cut at " << i << ", " << j;
        ASSERT_EQ(d.content, c.content) << c.text << " cut at " << i << ", " << j;
      }
  }
}

TEST(ReasoningSplitter, ByteByByteHoldsBackOnlyAPossibleTag) {
  ReasoningSplitter s(false);
  EXPECT_EQ(s.feed("ab").content, "ab");
  EXPECT_EQ(s.feed("<").content, "");  // may start <think>
  EXPECT_EQ(s.feed("t").content, "");
  EXPECT_EQ(s.feed("x").content, "<tx");  // it did not
  EXPECT_FALSE(s.in_reasoning());
  EXPECT_EQ(s.feed("<think>").content, "");
  EXPECT_TRUE(s.in_reasoning());
  EXPECT_EQ(s.feed("why</").reasoning, "why");
  const ReasoningDelta d = s.feed("think>so");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "so");
  EXPECT_FALSE(s.in_reasoning());
}

TEST(ReasoningSplitter, PromptOpensReasoning) {
  EXPECT_TRUE(prompt_opens_reasoning("]~b]ai\n<think>\n"));
  EXPECT_TRUE(prompt_opens_reasoning("<think>a</think> then <think>"));
  EXPECT_FALSE(prompt_opens_reasoning("]~b]ai\n"));
  EXPECT_FALSE(prompt_opens_reasoning("<think>a</think>\n]~b]ai\n"));
  EXPECT_FALSE(prompt_opens_reasoning(""));
}

}  // namespace
}  // namespace tpmoe::serve
