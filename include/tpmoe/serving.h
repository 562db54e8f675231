// Serving many requests at once: requests join and leave one running batch at every step
// (continuous batching), prompts are prefilled in chunks interleaved with decode under a token
// budget per step, and the KV cache is paged (fixed-size pages, a page table per sequence), so a
// request holds only the pages its tokens fill and admission is limited by free pages.
//
//   engine->serve(options, [](Scheduler& scheduler) {
//     // runs on its own thread in the primary process (an HTTP server, a test); serving stops
//     // when this returns
//     scheduler.submit({.prompt = ids, .sampling = params, .on_update = [](const ServeUpdate& u) { ... }});
//   });
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tpmoe/sampling.h"

namespace tpmoe {

struct ServeOptions {
  int max_batch = 64;          // sequences in the running batch at most
  int max_step_tokens = 1024;  // tokens one step holds (decode rows + prefill chunks)
  int max_context = 4096;      // positions per sequence: prompt + generated tokens
  int page_size = 16;          // positions per KV-cache page
  // Pages in the pool (every rank holds the same count for its heads). 0: enough for max_batch
  // sequences of max_context, which never makes a request wait for memory.
  int kv_pages = 0;
};

// What a request has produced since its last update.
struct ServeUpdate {
  std::vector<int32_t> tokens;  // token ids added (the stopping token included, as in generate)
  std::string text;             // text now final (with ServeRequest::detokenize; stop strings cut off)
  // "" while the request runs; at its last update "stop" (EOS, a stop token or string), "length"
  // (max_tokens or the context is full) or "abort" (cancelled).
  std::string finish_reason;
  int prompt_tokens = 0;
  int completion_tokens = 0;  // generated so far
};

struct ServeRequest {
  std::vector<int32_t> prompt;
  // sampling.max_tokens bounds the reply; an unset seed is drawn at submit. The same prompt,
  // parameters and seed give the same tokens whatever else runs in the batch.
  SamplingParams sampling;
  std::vector<int32_t> eos_token_ids;  // the model's EOS ids (ends the reply unless ignore_eos)
  // Optional text: the text each generated token adds (a streaming decoder, called in order on the
  // scheduler's thread). Needed for stop strings; without it updates carry ids only.
  std::function<std::string(int32_t token)> detokenize;
  // Called on the scheduler's thread after every step that added to the request and once at the end
  // (finish_reason set; nothing after it). Must not block: hand the update to another thread.
  std::function<void(const ServeUpdate&)> on_update;
};

struct ServeStats {
  int running = 0;  // requests in the batch (prefilling or decoding)
  int waiting = 0;  // queued for memory or a batch slot
  int kv_pages_used = 0, kv_pages_total = 0, page_size = 0;
  uint64_t steps = 0;
  uint64_t prompt_tokens = 0, generated_tokens = 0;  // totals since start
  uint64_t finished = 0, aborted = 0;                // requests
  uint64_t preemptions = 0;                          // running requests sent back to the queue for want of pages
};

class Scheduler {
 public:
  virtual ~Scheduler() = default;
  // Queues a request and returns its id. Throws tpmoe::Error, naming the problem, for a request that
  // can never run: an empty prompt, an id outside the vocabulary, prompt + max_tokens longer than
  // max_context, more pages than the pool holds, bad sampling parameters.
  virtual uint64_t submit(ServeRequest request) = 0;
  // Ends a request (its client went away): it leaves the batch before the next step, its pages go
  // back to the pool, and it gets one last update with finish_reason "abort" (none if it had
  // already finished). Unknown or finished ids are ignored.
  virtual void cancel(uint64_t id) = 0;
  virtual ServeStats stats() const = 0;
  virtual const ServeOptions& options() const = 0;
  virtual int vocab_size() const = 0;
  // `handler` runs once (on another thread) if serving must end early, e.g. a rank failed: the
  // front should then return (an HTTP server stops listening). Later submits throw.
  virtual void set_stop_handler(std::function<void()> handler) = 0;
};

}  // namespace tpmoe
