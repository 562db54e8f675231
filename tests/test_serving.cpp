// Continuous batching (src/engine/scheduler.cpp, serve_loop.cpp) on the CPU oracle: requests that
// join and leave one running batch, prefilled in chunks next to other requests' decode rows, over a
// paged KV cache, must each get exactly the tokens that request gets alone from Engine::generate
// (the CPU forward is batch-invariant: every row is computed the same way whatever shares the
// step). Also: preemption when the page pool runs dry, cancellation, sampling with a seed, tp 2,
// bad requests, and the plan's byte form.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "core/error.h"
#include "engine/scheduler.h"
#include "serving_test_util.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe::test {
namespace {

constexpr uint64_t kSeed = 7;

EngineOptions cpu_options(int tp = 1) {
  EngineOptions o;
  o.tp = tp;
  o.threads = 2;
  return o;
}

// Serves `cases` all at once (submitted from several threads) and checks each reply against
// generate's for that request alone.
// Serves `cases` all at once and checks each reply against generate's for that request alone.
ServeStats expect_each_as_alone(Engine& engine, const ServeOptions& options, const std::vector<Case>& cases) {
  std::vector<std::vector<int32_t>> want;
  for (const Case& c : cases) want.push_back(alone(engine, c.prompt, c.sampling));
  ServeStats after;
  const auto replies = serve_all(engine, options, cases, &after);
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& r = replies.at(int(i));
    EXPECT_EQ(r.tokens, want[i]) << "request " << i << " (prompt of " << cases[i].prompt.size() << ")";
    EXPECT_EQ(r.finish_reason, "length") << "request " << i;
    EXPECT_EQ(r.completion_tokens, cases[i].sampling.max_tokens) << "request " << i;
  }
  EXPECT_EQ(after.running, 0);
  EXPECT_EQ(after.waiting, 0);
  EXPECT_EQ(after.kv_pages_used, 0) << "pages not returned to the pool";
  EXPECT_EQ(after.finished, cases.size());
  return after;
}

TEST(Serving, ConcurrentGreedyRequestsEachGetWhatTheyGetAlone) {
  auto engine = Engine::from_preset("tiny", 2, kSeed, cpu_options());
  ServeOptions o;
  o.max_batch = 6;        // fewer slots than requests: some wait for a slot
  o.max_step_tokens = 9;  // prompts longer than this are prefilled in chunks beside decode rows
  o.max_context = 64;
  o.page_size = 4;  // sequences cross several pages
  expect_each_as_alone(*engine, o, greedy_cases(16, engine->vocab_size(), 6));
}

TEST(Serving, PreemptionWhenThePoolRunsDryKeepsEveryReplyIntact) {
  auto engine = Engine::from_preset("tiny", 2, kSeed, cpu_options());
  ServeOptions o;
  o.max_batch = 8;
  o.max_step_tokens = 64;
  o.max_context = 48;
  o.page_size = 4;
  o.kv_pages = 14;  // one long request needs 10: the running batch must give pages back
  const ServeStats stats = expect_each_as_alone(*engine, o, greedy_cases(8, engine->vocab_size(), 14));
  EXPECT_GT(stats.preemptions, 0u) << "the pool never ran dry: the test does not test preemption";
}

TEST(Serving, SampledRequestsWithASeedRepeatWhateverShareTheBatch) {
  auto engine = Engine::from_preset("tiny", 2, kSeed, cpu_options());
  ServeOptions o;
  o.max_batch = 4;
  o.max_step_tokens = 16;
  o.max_context = 64;
  std::vector<Case> cases = greedy_cases(6, engine->vocab_size(), 5);
  for (size_t i = 0; i < cases.size(); i += 2) {  // half sampled (penalties too), half greedy
    cases[i].sampling.temperature = 0.9f;
    cases[i].sampling.top_p = 0.9f;
    cases[i].sampling.presence_penalty = 0.5f;
    cases[i].sampling.seed = 1234 + i;
  }
  expect_each_as_alone(*engine, o, cases);
}

TEST(Serving, TensorParallelServingMatchesTensorParallelGenerate) {
  auto engine = Engine::from_preset("tiny", 2, kSeed, cpu_options(2));
  ServeOptions o;
  o.max_batch = 4;
  o.max_step_tokens = 8;
  o.max_context = 64;
  o.page_size = 8;
  expect_each_as_alone(*engine, o, greedy_cases(6, engine->vocab_size(), 4));
}

TEST(Serving, CancelledRequestsEndWithAbortAndFreeTheirPages) {
  auto engine = Engine::from_preset("tiny", 2, kSeed, cpu_options());
  ServeOptions o;
  o.max_batch = 2;
  o.max_context = 256;
  o.page_size = 4;
  const int vocab = engine->vocab_size();
  Collector collector;
  ServeStats during, after;
  engine.get()->serve(o, [&](Scheduler& s) {
    std::atomic<uint64_t> running_id{0};
    std::mutex m;
    std::condition_variable cv;
    // Updates seen per request: the snapshot below waits until both long requests have produced a
    // token, so it cannot land while the second one is still waiting for its first step (on a busy
    // machine the first request can run several steps before the second is even submitted).
    int updates[2] = {0, 0};
    auto counting = [&](int i) {
      return [&, i, sink = collector.sink(i)](const ServeUpdate& u) {
        sink(u);
        std::lock_guard lock(m);
        ++updates[i];
        cv.notify_all();
      };
    };
    ServeRequest r;
    r.prompt = random_prompt(10, vocab, 1);
    r.sampling.max_tokens = 200;
    r.sampling.ignore_eos = true;
    r.on_update = counting(0);
    running_id = s.submit(std::move(r));
    // A second long request, and a third that waits for a slot and is cancelled while waiting.
    ServeRequest r2;
    r2.prompt = random_prompt(5, vocab, 2);
    r2.sampling.max_tokens = 200;
    r2.sampling.ignore_eos = true;
    r2.on_update = counting(1);
    const uint64_t other_id = s.submit(std::move(r2));
    ServeRequest r3;
    r3.prompt = random_prompt(5, vocab, 3);
    r3.sampling.max_tokens = 20;
    r3.on_update = collector.sink(2);
    const uint64_t waiting_id = s.submit(std::move(r3));
    {
      std::unique_lock lock(m);
      EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(300), [&] { return updates[0] >= 3 && updates[1] >= 1; }))
          << "the two long requests did not both start";
    }
    during = s.stats();
    s.cancel(running_id);
    s.cancel(waiting_id);
    s.cancel(987654);  // unknown: ignored
    collector.wait(2);
    // The other request keeps going; end it too and wait for its pages.
    s.cancel(other_id);
    collector.wait(3);
    after = s.stats();
  });
  const auto replies = collector.replies();
  EXPECT_EQ(replies.at(0).finish_reason, "abort");
  EXPECT_EQ(replies.at(2).finish_reason, "abort");
  EXPECT_TRUE(replies.at(2).tokens.empty()) << "a request cancelled while waiting generated tokens";
  EXPECT_GT(during.kv_pages_used, 0);
  EXPECT_EQ(during.running, 2);
  EXPECT_EQ(during.waiting, 1);
  EXPECT_EQ(after.kv_pages_used, 0) << "cancelled requests kept their pages";
  EXPECT_EQ(after.running + after.waiting, 0);
  EXPECT_EQ(after.aborted, 3u);
}

TEST(Serving, RequestsThatCanNeverRunAreRefusedNamingTheProblem) {
  auto engine = Engine::from_preset("tiny", 2, kSeed, cpu_options());
  ServeOptions o;
  o.max_context = 32;
  o.max_batch = 2;
  const int vocab = engine->vocab_size();
  engine->serve(o, [&](Scheduler& s) {
    auto refused = [&](ServeRequest r, const std::string& what) {
      try {
        s.submit(std::move(r));
        ADD_FAILURE() << "accepted a request with " << what;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      }
    };
    ServeRequest ok;
    ok.prompt = {1, 2, 3};
    ok.sampling.max_tokens = 4;
    ServeRequest r = ok;
    r.prompt.clear();
    refused(r, "prompt is empty");
    r = ok;
    r.prompt = {1, vocab};
    refused(r, "outside the vocabulary");
    r = ok;
    r.sampling.max_tokens = 30;
    refused(r, "longer than the context");
    r = ok;
    r.sampling.max_tokens = 0;
    refused(r, "max_tokens");
    r = ok;
    r.sampling.temperature = -1;
    refused(r, "temperature");
    r = ok;
    r.sampling.stop = {"x"};
    refused(r, "stop strings");
    // The scheduler still serves.
    Collector c;
    ok.on_update = c.sink(0);
    s.submit(ok);
    c.wait(1);
  });
  ServeOptions bad = o;
  bad.page_size = 6;
  EXPECT_THROW(engine->serve(bad, [](Scheduler&) {}), Error);
}

TEST(Serving, AFrontThatFailsEndsServingWithItsError) {
  auto engine = Engine::from_preset("tiny", 2, kSeed, cpu_options());
  ServeOptions o;
  o.max_context = 32;
  try {
    engine->serve(o, [](Scheduler&) { TPMOE_FAIL("port 8000 is taken"); });
    ADD_FAILURE() << "serve returned normally";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("port 8000 is taken"), std::string::npos) << e.what();
  }
  // The engine still serves afterwards.
  engine->serve(o, [&](Scheduler& s) {
    Collector c;
    ServeRequest r;
    r.prompt = {1, 2};
    r.sampling.max_tokens = 2;
    r.on_update = c.sink(0);
    s.submit(r);
    c.wait(1);
  });
}

TEST(Serving, StepPlansSurviveTheirByteForm) {
  StepPlan p;
  p.tokens.token_ids = {1, 2, 3};
  p.tokens.positions = {0, 1, 5};
  p.tokens.seq_slots = {0, 0, 2};
  p.tokens.logit_rows = {1, 2};
  p.tokens.num_padding = 1;
  p.tokens.page_table = {0, -1, 3, 4};
  p.greedy = false;
  p.sampling.rows.resize(2);
  p.sampling.rows[1].temperature = 0.5f;
  p.sampling.rows[1].seed = 42;
  p.sampling.penalty_offsets = {0, 1, 1};
  p.sampling.penalty_token_ids = {7};
  p.sampling.penalty_counts = {2};
  p.graph_key = 4;
  const StepPlan q = StepPlan::deserialize(p.serialize());
  EXPECT_EQ(q.tokens.token_ids, p.tokens.token_ids);
  EXPECT_EQ(q.tokens.positions, p.tokens.positions);
  EXPECT_EQ(q.tokens.seq_slots, p.tokens.seq_slots);
  EXPECT_EQ(q.tokens.logit_rows, p.tokens.logit_rows);
  EXPECT_EQ(q.tokens.num_padding, 1);
  EXPECT_EQ(q.tokens.page_table, p.tokens.page_table);
  EXPECT_FALSE(q.greedy);
  ASSERT_EQ(q.sampling.rows.size(), 2u);
  EXPECT_EQ(q.sampling.rows[1].temperature, 0.5f);
  EXPECT_EQ(q.sampling.rows[1].seed, 42u);
  EXPECT_EQ(q.sampling.penalty_token_ids, p.sampling.penalty_token_ids);
  EXPECT_EQ(q.graph_key, 4);
  std::vector<std::byte> cut = p.serialize();
  cut.resize(cut.size() - 3);
  EXPECT_THROW(StepPlan::deserialize(cut), Error);
}

}  // namespace
}  // namespace tpmoe::test
