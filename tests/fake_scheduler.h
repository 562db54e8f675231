// A scripted Scheduler for the serving tests: the HTTP layer is tested against it, without a model.
// It keeps the interface's contract (tpmoe/serving.h) the way the real one does: submit checks what
// can never run, a thread steps every running request by one token per step, the stop checks of
// generate (EOS / stop ids silent, stop strings cut by the StopMatcher on the detokenized text,
// max_tokens), cancel ends a request with "abort" and frees its pages, stats count pages and totals,
// fail() ends serving early through the stop handler.
// What a request generates is its script: `script(prompt)`, then EOS ids once the script runs out.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"
#include "engine/sampling.h"
#include "tpmoe/serving.h"

namespace tpmoe::test {

class FakeScheduler : public Scheduler {
 public:
  using Script = std::function<std::vector<int32_t>(const std::vector<int32_t>& prompt)>;

  FakeScheduler(ServeOptions options, int vocab_size, Script script,
                std::chrono::microseconds step = std::chrono::milliseconds(2))
      : options_(options), vocab_size_(vocab_size), script_(std::move(script)), step_(step) {
    stats_.kv_pages_total =
        options_.kv_pages > 0 ? options_.kv_pages : options_.max_batch * pages_for(options_.max_context);
    stats_.page_size = options_.page_size;
    thread_ = std::thread([this] { loop(); });
  }
  ~FakeScheduler() override {
    {
      std::lock_guard lock(mutex_);
      quit_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  // A prompt holding this id is refused by submit, as a request that can never run.
  static constexpr int32_t kRefusedId = 7;

  uint64_t submit(ServeRequest r) override {
    TPMOE_CHECK(!failed_, "submit: serving has stopped");
    TPMOE_CHECK(!r.prompt.empty(), "submit: empty prompt");
    for (int32_t id : r.prompt) TPMOE_CHECK(id >= 0 && id < vocab_size_, "submit: id {} outside the vocabulary", id);
    TPMOE_CHECK(std::find(r.prompt.begin(), r.prompt.end(), kRefusedId) == r.prompt.end(),
                "submit: the prompt holds id {}, which this fake refuses", kRefusedId);
    TPMOE_CHECK(int(r.prompt.size()) + r.sampling.max_tokens <= options_.max_context,
                "submit: prompt + max_tokens over max_context");
    r.sampling.validate(vocab_size_);
    std::lock_guard lock(mutex_);
    const uint64_t id = next_id_++;
    Running run{std::move(r), {}, StopMatcher({}), 0, false};
    run.stop = StopMatcher(run.request.sampling.stop);
    run.reply = script_(run.request.prompt);
    running_.emplace(id, std::move(run));
    wake_.notify_all();
    return id;
  }

  void cancel(uint64_t id) override {
    std::lock_guard lock(mutex_);
    cancel_calls_.push_back(id);
    if (auto it = running_.find(id); it != running_.end()) it->second.cancelled = true;
  }

  ServeStats stats() const override {
    std::lock_guard lock(mutex_);
    ServeStats s = stats_;
    s.running = int(running_.size());
    s.kv_pages_used = 0;
    for (const auto& [id, run] : running_) s.kv_pages_used += pages_for(int(run.request.prompt.size()) + run.generated);
    return s;
  }
  const ServeOptions& options() const override { return options_; }
  int vocab_size() const override { return vocab_size_; }
  void set_stop_handler(std::function<void()> handler) override {
    std::lock_guard lock(mutex_);
    stop_handler_ = std::move(handler);
  }

  // What the real scheduler does when serving must end early (a rank failed): every request ends
  // with "abort", later submits throw, and the stop handler runs.
  void fail() {
    std::function<void()> handler;
    {
      std::lock_guard lock(mutex_);
      failed_ = true;
      for (auto& [id, run] : running_) run.cancelled = true;
      handler = stop_handler_;
    }
    if (handler) handler();
  }

  // Every id cancel() was called with, in order.
  std::vector<uint64_t> cancel_calls() const {
    std::lock_guard lock(mutex_);
    return cancel_calls_;
  }
  // The most requests that were running at once.
  int peak_running() const { return peak_running_; }

 private:
  struct Running {
    ServeRequest request;
    std::vector<int32_t> reply;
    StopMatcher stop;
    int generated = 0;
    bool cancelled = false;
  };

  int pages_for(int positions) const { return (positions + options_.page_size - 1) / options_.page_size; }

  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return quit_ || !running_.empty(); });
      if (quit_) return;
      lock.unlock();
      std::this_thread::sleep_for(step_);
      lock.lock();
      peak_running_ = std::max(peak_running_.load(), int(running_.size()));
      ++stats_.steps;
      for (auto it = running_.begin(); it != running_.end();) it = step(it) ? running_.erase(it) : std::next(it);
    }
  }

  // One token for one request; true when it ended.
  bool step(std::map<uint64_t, Running>::iterator it) {
    Running& run = it->second;
    ServeUpdate u;
    u.prompt_tokens = int(run.request.prompt.size());
    if (run.cancelled) {
      u.finish_reason = "abort";
      u.completion_tokens = run.generated;
      ++stats_.aborted;
      run.request.on_update(u);
      return true;
    }
    if (run.generated == 0) stats_.prompt_tokens += run.request.prompt.size();
    const int32_t token =
        run.generated < int(run.reply.size()) ? run.reply[size_t(run.generated)] : run.request.eos_token_ids.at(0);
    ++run.generated;
    ++stats_.generated_tokens;
    u.tokens = {token};
    u.completion_tokens = run.generated;
    const FinishReason f = check_token_stop(run.request.sampling, token, run.request.eos_token_ids, run.generated);
    const bool silent = f == FinishReason::kEos || f == FinishReason::kStopToken;
    if (run.request.detokenize && !silent) u.text = run.stop.feed(run.request.detokenize(token));
    if (run.stop.stopped())
      u.finish_reason = "stop";
    else if (f != FinishReason::kNone)
      u.finish_reason = finish_reason_name(f);
    if (!u.finish_reason.empty() && !run.stop.stopped()) u.text += run.stop.flush();
    if (!u.finish_reason.empty()) ++stats_.finished;
    run.request.on_update(u);
    return !u.finish_reason.empty();
  }

  ServeOptions options_;
  int vocab_size_;
  Script script_;
  std::chrono::microseconds step_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::map<uint64_t, Running> running_;
  ServeStats stats_;
  uint64_t next_id_ = 1;
  bool quit_ = false, failed_ = false;
  std::function<void()> stop_handler_;
  std::vector<uint64_t> cancel_calls_;
  std::atomic<int> peak_running_{0};
  std::thread thread_;
};

}  // namespace tpmoe::test
