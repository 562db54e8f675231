// step_keeps_earlier_keys (model/ops.h): when a step's cache writes leave every key its tokens
// attend to below their own positions as earlier steps wrote it, so that a backend may read those
// keys before the step's writes are done (the GPU's attention kernel does).
#include <gtest/gtest.h>

#include "model/ops.h"

namespace tpmoe {
namespace {

CacheShape shape(int max_seqs, int max_len, int page_size, int num_pages) {
  CacheShape c;
  c.num_layers = 1;
  c.sparse_layer = {false};
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.max_seqs = max_seqs;
  c.max_len = max_len;
  c.page_size = page_size;
  c.num_pages = num_pages;
  return c;
}

// step_keeps_earlier_keys with fresh scratch, which it must leave as it found it.
bool keeps(const StepTokens& step, const CacheShape& c) {
  EarlierKeysScratch scratch(c.num_pages);
  const bool answer = step_keeps_earlier_keys(step, c, scratch);
  EXPECT_EQ(scratch.page_writer, std::vector<int32_t>(size_t(c.num_pages), -1)) << "the scratch was not left all -1";
  return answer;
}

StepTokens tokens(std::vector<int32_t> slots, std::vector<int32_t> positions, std::vector<int32_t> page_table = {}) {
  StepTokens st;
  st.token_ids.assign(slots.size(), 0);
  st.seq_slots = std::move(slots);
  st.positions = std::move(positions);
  st.page_table = std::move(page_table);
  return st;
}

TEST(StepKeepsEarlierKeys, ADecodeStepDoes) {
  const CacheShape c = shape(4, 64, 16, 16);
  EXPECT_TRUE(keeps(tokens({0, 1, 3}, {17, 3, 40}), c)) << "identity page table";
  // Slots 0 and 1, 4 pages a slot, pages shuffled but each named once.
  const std::vector<int32_t> table = {5, 2, 9, -1, 7, 0, -1, -1};
  EXPECT_TRUE(keeps(tokens({0, 1}, {40, 20}, table), c));
  EXPECT_TRUE(keeps(tokens({}, {}, table), c)) << "a step without tokens";
}

TEST(StepKeepsEarlierKeys, PaddingRowsSharingASlotAtOnePositionDo) {
  // The scheduler pads a decode batch with rows that share one more slot at position 0.
  const CacheShape c = shape(4, 64, 16, 16);
  const std::vector<int32_t> table = {5, 2, -1, -1, 7, -1, -1, -1, 11, -1, -1, -1};
  EXPECT_TRUE(keeps(tokens({0, 1, 2, 2, 2}, {20, 9, 0, 0, 0}, table), c));
}

TEST(StepKeepsEarlierKeys, ASequenceAtTwoPositionsDoesNot) {
  // A prefill (or a chunk of one) writes keys that its own later tokens attend to.
  const CacheShape c = shape(4, 64, 16, 16);
  EXPECT_FALSE(keeps(tokens({2, 2, 2}, {0, 1, 2}), c));
  EXPECT_FALSE(keeps(tokens({0, 1, 0}, {30, 12, 31}), c)) << "decode rows and a chunk";
}

TEST(StepKeepsEarlierKeys, AWrittenPageNamedTwiceDoesNot) {
  const CacheShape c = shape(4, 64, 16, 16);
  // Slot 1 reads page 2 at its positions 0-15 while slot 0 writes its position 17 there.
  const std::vector<int32_t> shared = {5, 2, -1, -1, 2, 7, -1, -1};
  EXPECT_FALSE(keeps(tokens({0, 1}, {17, 20}, shared), c));
  // One slot naming its written page twice.
  const std::vector<int32_t> twice = {3, 3, -1, -1};
  EXPECT_FALSE(keeps(tokens({0}, {20}, twice), c));
  // Two slots writing one page.
  const std::vector<int32_t> both_write = {4, -1, -1, -1, 4, -1, -1, -1};
  EXPECT_FALSE(keeps(tokens({0, 1}, {3, 5}, both_write), c));
  // A page named twice that no token writes does not matter here.
  const std::vector<int32_t> read_only = {5, 9, -1, -1, 5, 7, -1, -1};
  EXPECT_TRUE(keeps(tokens({0, 1}, {17, 20}, read_only), c));
  // Nor a written page that another slot maps only past its own position, where it reads nothing.
  const std::vector<int32_t> past = {5, 2, -1, -1, 7, 2, -1, -1};
  EXPECT_TRUE(keeps(tokens({0, 1}, {17, 3}, past), c));
}

// CudaOps keeps one scratch for every step: reused across steps of other sizes and answers, it gives
// what fresh scratch gives.
TEST(StepKeepsEarlierKeys, OneScratchForManySteps) {
  const CacheShape c = shape(4, 64, 16, 16);
  const std::vector<int32_t> shared = {5, 2, -1, -1, 2, 7, -1, -1}, past = {5, 2, -1, -1, 7, 2, -1, -1};
  const std::vector<StepTokens> steps = {tokens({0, 1}, {17, 20}, shared), tokens({0, 1, 2, 3}, {3, 4, 5, 6}),
                                         tokens({0, 1}, {17, 3}, past), tokens({2}, {9}), tokens({0, 0}, {1, 2})};
  EarlierKeysScratch scratch(c.num_pages);
  for (size_t i = 0; i < steps.size(); ++i)
    EXPECT_EQ(step_keeps_earlier_keys(steps[i], c, scratch), keeps(steps[i], c)) << "step " << i;
  EXPECT_EQ(scratch.page_writer, std::vector<int32_t>(size_t(c.num_pages), -1));
}

}  // namespace
}  // namespace tpmoe
