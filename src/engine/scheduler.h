// Continuous batching (tpmoe/serving.h): the host-side policy that decides, before every step,
// which requests run and which of their tokens the step computes, and that turns each step's ids
// into replies. It runs in the primary process only; every rank executes the StepPlans it makes
// (serve_loop.cpp).
//
// A request is the list of its known tokens (prompt, then every generated token) and how many of
// them the KV cache holds (num_computed). Each step feeds a running request its next uncomputed
// tokens: a chunk of the prompt (chunked prefill), or the one token it generated last (decode); a
// step whose chunk reaches the last known token asks for that row's logits, and the id drawn there
// becomes the next known token. Prefill, chunked prefill, decode and recomputation after
// preemption are all that one rule.
//
// Policy:
//   - admission first-come first-served, while the batch has a slot and the pool has the pages
//     for the request's known tokens (taken at admission, so a prefill never waits for memory);
//   - a decode row that crosses into a new page takes one; when the pool is empty the newest
//     running request is preempted (pages freed, back to the front of the queue, recomputed from
//     its known tokens when readmitted: its reply continues where it was);
//   - each step holds every decode row first, then prefill chunks in arrival order, up to
//     max_step_tokens;
//   - a step of decode rows only is padded to a bucket size on a backend that records steps, the
//     padding rows in a page-table row of their own (one page kept aside for it), so a few
//     recorded graphs serve every batch;
//   - a plan's slots are the step's own numbering (0, 1, ... in the order requests join the step)
//     and its page table holds only those rows: a request's keys are wherever its pages are.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/sampling.h"
#include "model/ops.h"
#include "tpmoe/serving.h"

namespace tpmoe {

// What every rank runs for one step: the tokens, how the next ids are chosen, whether the step may
// be recorded. Rank 0 makes it; under mpirun it travels to the other processes as bytes.
struct StepPlan {
  bool shutdown = false;  // no step: the serving loop ends
  StepTokens tokens;
  bool greedy = true;    // every logit row is plain greedy (the distributed argmax)
  SampleBatch sampling;  // otherwise one row per logit row
  int graph_key = 0;     // > 0: a padded decode step a recording backend may record under this key

  std::vector<std::byte> serialize() const;
  static StepPlan deserialize(const std::vector<std::byte>& bytes);
};

// Sizes of the paged cache a scheduler drives, fixed when serving starts.
struct ServeLayout {
  int max_seqs = 0;   // rows of a step's page table: max_batch, plus one the padding rows share
  int num_pages = 0;  // pool pages, the padding page included
  int padding_page = 0;
  int pages_per_seq = 0;
};

class BatchScheduler final : public Scheduler {
 public:
  BatchScheduler(const ServeOptions& options, int vocab_size);
  // The backend records steps: decode steps are then padded to buckets. Set before serving starts.
  void set_records_steps(bool records) { records_steps_ = records; }

  // The cache layout for `options` (kv_pages 0: a page for every position of every slot).
  static ServeLayout layout_for(const ServeOptions& options);
  const ServeLayout& layout() const { return layout_; }

  uint64_t submit(ServeRequest request) override;
  void cancel(uint64_t id) override;
  ServeStats stats() const override;
  const ServeOptions& options() const override { return options_; }
  int vocab_size() const override { return vocab_size_; }
  void set_stop_handler(std::function<void()> handler) override;

  // The serving loop (rank 0's thread). next_plan blocks until there is work or serving stops;
  // complete takes the plan's ids (one per logit row) and delivers the updates.
  StepPlan next_plan();
  void complete(const std::vector<int32_t>& ids);
  // Stop: running and queued requests end with "abort"; next_plan returns a shutdown plan.
  // `failure` non-empty: serving cannot go on (a rank failed): the stop handler runs and later
  // submits are refused with it.
  void shutdown(const std::string& failure = "");

 private:
  struct Request {
    uint64_t id = 0;
    ServeRequest req;
    uint64_t seed = 0;
    std::vector<int32_t> tokens;  // prompt, then generated
    int prompt_len = 0;
    int num_computed = 0;
    int slot = -1;
    std::vector<int32_t> pages;
    std::optional<SequencePenalties> penalties;
    std::optional<StopMatcher> stop;
    bool cancelled = false;
    int generated() const { return int(tokens.size()) - prompt_len; }
  };
  using RequestPtr = std::shared_ptr<Request>;
  // One request's share of the plan in flight.
  struct Scheduled {
    RequestPtr request;
    int num_tokens = 0;
    bool logit_row = false;
  };
  // An update to deliver once the lock is released (callbacks may call back into the scheduler).
  struct Pending {
    std::function<void(const ServeUpdate&)> callback;
    ServeUpdate update;
  };

  int pages_for(int positions) const { return (positions + options_.page_size - 1) / options_.page_size; }
  void admit();
  void release(Request& r);
  void finish(const RequestPtr& r, FinishReason reason, std::vector<Pending>& out, ServeUpdate update = {});
  void abort(const RequestPtr& r, std::vector<Pending>& out);
  void drop_cancelled(std::vector<Pending>& out);
  bool take_page(Request& r);
  void preempt_newest();
  void build(StepPlan& plan);
  static void deliver(std::vector<Pending>& pending);

  const ServeOptions options_;
  const int vocab_size_;
  bool records_steps_ = false;
  const ServeLayout layout_;

  mutable std::mutex mutex_;
  std::condition_variable work_;
  uint64_t next_id_ = 1;
  std::deque<RequestPtr> waiting_;
  std::list<RequestPtr> running_;  // in admission order
  std::vector<int32_t> free_pages_, free_slots_;
  std::vector<Scheduled> in_flight_;
  bool stopping_ = false;
  std::string failure_;
  std::function<void()> stop_handler_;
  ServeStats totals_;
};

}  // namespace tpmoe
