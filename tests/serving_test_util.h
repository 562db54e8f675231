// Helpers of the serving tests (CPU: test_serving.cpp, GPU: test_cuda_serving.cpp).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "tpmoe/tpmoe.h"

namespace tpmoe::test {

inline std::vector<int32_t> random_prompt(int len, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (auto& id : p) id = dist(rng);
  return p;
}

// What one request gets from generate, alone.
inline std::vector<int32_t> alone(Engine& engine, const std::vector<int32_t>& prompt, const SamplingParams& sp) {
  GenerateRequest req;
  req.prompts = {prompt};
  req.max_new_tokens = sp.max_tokens;
  req.sampling = sp;
  req.return_step_logits = false;
  return engine.generate(req).generated[0];
}

// Collects every request's updates; wait() returns once all have finished.
class Collector {
 public:
  std::function<void(const ServeUpdate&)> sink(int i) {
    return [this, i](const ServeUpdate& u) {
      std::lock_guard lock(mutex_);
      Reply& r = replies_[i];
      r.tokens.insert(r.tokens.end(), u.tokens.begin(), u.tokens.end());
      r.updates += 1;
      if (!u.finish_reason.empty()) {
        EXPECT_TRUE(r.finish_reason.empty()) << "request " << i << " got a second final update";
        r.finish_reason = u.finish_reason;
        r.completion_tokens = u.completion_tokens;
        ++finished_;
        done_.notify_all();
      }
    };
  }
  void wait(int n) {
    std::unique_lock lock(mutex_);
    ASSERT_TRUE(done_.wait_for(lock, std::chrono::seconds(300), [&] { return finished_ >= n; }))
        << finished_ << " of " << n << " requests finished";
  }
  struct Reply {
    std::vector<int32_t> tokens;
    std::string finish_reason;
    int completion_tokens = 0;
    int updates = 0;
  };
  std::map<int, Reply> replies() {
    std::lock_guard lock(mutex_);
    return replies_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  std::map<int, Reply> replies_;
  int finished_ = 0;
};

struct Case {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

// Serves `cases` all at once (submitted from 4 client threads) and returns every reply (by case
// index) and the scheduler's stats once all have finished.
inline std::map<int, Collector::Reply> serve_all(Engine& engine, const ServeOptions& options,
                                                 const std::vector<Case>& cases, ServeStats* stats_after = nullptr) {
  Collector collector;
  engine.serve(options, [&](Scheduler& s) {
    std::vector<std::thread> clients;
    for (int t = 0; t < 4; ++t)
      clients.emplace_back([&, t] {
        for (size_t i = size_t(t); i < cases.size(); i += 4) {
          ServeRequest r;
          r.prompt = cases[i].prompt;
          r.sampling = cases[i].sampling;
          r.on_update = collector.sink(int(i));
          s.submit(std::move(r));
        }
      });
    for (auto& c : clients) c.join();
    collector.wait(int(cases.size()));
    if (stats_after) *stats_after = s.stats();
  });
  return collector.replies();
}

inline std::vector<Case> greedy_cases(int n, int vocab, int max_tokens) {
  std::vector<Case> cases;
  for (int i = 0; i < n; ++i) {
    Case c;
    c.prompt = random_prompt(1 + (i * 7) % 23, vocab, 100 + uint64_t(i));
    c.sampling.max_tokens = max_tokens + i % 3;
    cases.push_back(c);
  }
  return cases;
}

}  // namespace tpmoe::test
