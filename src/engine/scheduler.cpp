#include "engine/scheduler.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/error.h"
#include "engine/generation.h"

namespace tpmoe {

namespace {

// Plain bytes in, plain bytes out: a plan only holds vectors of trivially copyable values.
class ByteWriter {
 public:
  template <typename T>
  void value(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void vector(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    value(uint64_t(v.size()));
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    bytes_.insert(bytes_.end(), p, p + v.size() * sizeof(T));
  }
  std::vector<std::byte> take() { return std::move(bytes_); }

 private:
  std::vector<std::byte> bytes_;
};

class ByteReader {
 public:
  explicit ByteReader(const std::vector<std::byte>& bytes) : bytes_(bytes) {}
  template <typename T>
  T value() {
    T v;
    read(&v, sizeof(T));
    return v;
  }
  template <typename T>
  std::vector<T> vector() {
    const auto n = value<uint64_t>();
    TPMOE_CHECK(n <= (bytes_.size() - at_) / sizeof(T), "step plan: truncated ({} elements announced)", n);
    std::vector<T> v(n);
    read(v.data(), n * sizeof(T));
    return v;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  void read(void* out, size_t n) {
    TPMOE_CHECK(n <= bytes_.size() - at_, "step plan: truncated at byte {}", at_);
    std::memcpy(out, bytes_.data() + at_, n);
    at_ += n;
  }
  const std::vector<std::byte>& bytes_;
  size_t at_ = 0;
};

}  // namespace

std::vector<std::byte> StepPlan::serialize() const {
  ByteWriter w;
  w.value(uint8_t(shutdown));
  w.vector(tokens.token_ids);
  w.vector(tokens.positions);
  w.vector(tokens.seq_slots);
  w.vector(tokens.logit_rows);
  w.value(int32_t(tokens.num_padding));
  w.vector(tokens.page_table);
  w.value(uint8_t(greedy));
  w.vector(sampling.rows);
  w.vector(sampling.penalty_offsets);
  w.vector(sampling.penalty_token_ids);
  w.vector(sampling.penalty_counts);
  w.value(int32_t(graph_key));
  return w.take();
}

StepPlan StepPlan::deserialize(const std::vector<std::byte>& bytes) {
  ByteReader r(bytes);
  StepPlan p;
  p.shutdown = r.value<uint8_t>() != 0;
  p.tokens.token_ids = r.vector<int32_t>();
  p.tokens.positions = r.vector<int32_t>();
  p.tokens.seq_slots = r.vector<int32_t>();
  p.tokens.logit_rows = r.vector<int32_t>();
  p.tokens.num_padding = r.value<int32_t>();
  p.tokens.page_table = r.vector<int32_t>();
  p.greedy = r.value<uint8_t>() != 0;
  p.sampling.rows = r.vector<SampleRowParams>();
  p.sampling.penalty_offsets = r.vector<int32_t>();
  p.sampling.penalty_token_ids = r.vector<int32_t>();
  p.sampling.penalty_counts = r.vector<int32_t>();
  p.graph_key = r.value<int32_t>();
  TPMOE_CHECK(r.done(), "step plan: {} bytes left over", bytes.size());
  return p;
}

ServeLayout BatchScheduler::layout_for(const ServeOptions& o) {
  TPMOE_CHECK(o.max_batch >= 1, "serve: max_batch must be at least 1, got {}", o.max_batch);
  TPMOE_CHECK(o.max_step_tokens >= 1, "serve: max_step_tokens must be at least 1, got {}", o.max_step_tokens);
  TPMOE_CHECK(o.max_context >= 2, "serve: max_context must be at least 2, got {}", o.max_context);
  TPMOE_CHECK(o.page_size > 0 && (o.page_size & (o.page_size - 1)) == 0,
              "serve: page_size must be a power of two, got {}", o.page_size);
  TPMOE_CHECK(o.kv_pages >= 0, "serve: kv_pages must be >= 0, got {}", o.kv_pages);
  ServeLayout l;
  l.max_seqs = o.max_batch + 1;
  l.pages_per_seq = (o.max_context + o.page_size - 1) / o.page_size;
  l.num_pages = (o.kv_pages > 0 ? o.kv_pages : o.max_batch * l.pages_per_seq) + 1;
  l.padding_page = l.num_pages - 1;
  return l;
}

BatchScheduler::BatchScheduler(const ServeOptions& options, int vocab_size)
    : options_(options), vocab_size_(vocab_size), layout_(layout_for(options)) {
  // Lowest ids first out of the free lists (back of the vector), for readable page tables.
  for (int p = layout_.padding_page - 1; p >= 0; --p) free_pages_.push_back(p);
  for (int s = options_.max_batch - 1; s >= 0; --s) free_slots_.push_back(s);
  totals_.kv_pages_total = layout_.num_pages - 1;
  totals_.page_size = options_.page_size;
}

uint64_t BatchScheduler::submit(ServeRequest request) {
  const SamplingParams& sp = request.sampling;
  const int P = int(request.prompt.size());
  TPMOE_CHECK(P > 0, "the prompt is empty");
  for (int32_t id : request.prompt)
    TPMOE_CHECK(id >= 0 && id < vocab_size_, "prompt token id {} is outside the vocabulary (size {})", id, vocab_size_);
  sp.validate(vocab_size_);
  for (int32_t id : request.eos_token_ids)
    TPMOE_CHECK(id >= 0 && id < vocab_size_, "EOS token id {} is outside the vocabulary (size {})", id, vocab_size_);
  TPMOE_CHECK(sp.max_tokens >= 1, "max_tokens must be at least 1, got {}", sp.max_tokens);
  TPMOE_CHECK(int64_t(P) + sp.max_tokens <= options_.max_context,
              "the prompt ({} tokens) plus max_tokens ({}) is longer than the context ({} tokens)", P, sp.max_tokens,
              options_.max_context);
  TPMOE_CHECK(pages_for(P + sp.max_tokens) <= layout_.num_pages - 1,
              "the prompt plus max_tokens needs {} KV-cache pages, the pool holds {}", pages_for(P + sp.max_tokens),
              layout_.num_pages - 1);
  TPMOE_CHECK(sp.stop.empty() || request.detokenize, "stop strings need the reply's text (give detokenize)");

  auto r = std::make_shared<Request>();
  r->seed = resolve_seed(sp);
  r->prompt_len = P;
  r->tokens = request.prompt;
  r->penalties.emplace(sp, request.prompt);
  if (request.detokenize) r->stop.emplace(sp.stop);
  r->req = std::move(request);
  std::lock_guard lock(mutex_);
  TPMOE_CHECK(failure_.empty(), "serving stopped: {}", failure_);
  TPMOE_CHECK(!stopping_, "the server is shutting down");
  r->id = next_id_++;
  waiting_.push_back(r);
  totals_.prompt_tokens += uint64_t(P);
  work_.notify_all();
  return r->id;
}

void BatchScheduler::cancel(uint64_t id) {
  std::lock_guard lock(mutex_);
  // Marked here, ended by the serving loop before its next step (or as its step completes).
  for (auto& r : waiting_)
    if (r->id == id) r->cancelled = true;
  for (auto& r : running_)
    if (r->id == id) r->cancelled = true;
  work_.notify_all();
}

void BatchScheduler::set_stop_handler(std::function<void()> handler) {
  std::lock_guard lock(mutex_);
  stop_handler_ = std::move(handler);
}

ServeStats BatchScheduler::stats() const {
  std::lock_guard lock(mutex_);
  ServeStats s = totals_;
  s.running = int(running_.size());
  s.waiting = int(waiting_.size());
  s.kv_pages_used = s.kv_pages_total - int(free_pages_.size());
  return s;
}

void BatchScheduler::shutdown(const std::string& failure) {
  std::vector<Pending> out;
  std::function<void()> handler;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    if (!failure.empty() && failure_.empty()) {
      failure_ = failure;
      handler = stop_handler_;
      // The serving loop may be gone: end every request here.
      while (!running_.empty()) abort(running_.front(), out);
      while (!waiting_.empty()) abort(waiting_.front(), out);
    }
    work_.notify_all();
  }
  deliver(out);
  if (handler) handler();
}

void BatchScheduler::deliver(std::vector<Pending>& pending) {
  for (auto& p : pending)
    if (p.callback) p.callback(p.update);
  pending.clear();
}

void BatchScheduler::release(Request& r) {
  free_pages_.insert(free_pages_.end(), r.pages.rbegin(), r.pages.rend());
  r.pages.clear();
  if (r.slot >= 0) free_slots_.push_back(r.slot);
  r.slot = -1;
}

void BatchScheduler::finish(const RequestPtr& r, FinishReason reason, std::vector<Pending>& out, ServeUpdate update) {
  if (r->stop && reason != FinishReason::kStopString) update.text += r->stop->flush();
  update.finish_reason = finish_reason_name(reason);
  update.prompt_tokens = r->prompt_len;
  update.completion_tokens = r->generated();
  release(*r);
  running_.remove(r);
  ++totals_.finished;
  out.push_back({r->req.on_update, std::move(update)});
}

void BatchScheduler::abort(const RequestPtr& r, std::vector<Pending>& out) {
  ServeUpdate update;
  update.finish_reason = "abort";
  update.prompt_tokens = r->prompt_len;
  update.completion_tokens = r->generated();
  release(*r);
  running_.remove(r);
  std::erase(waiting_, r);
  ++totals_.aborted;
  out.push_back({r->req.on_update, std::move(update)});
}

void BatchScheduler::drop_cancelled(std::vector<Pending>& out) {
  std::vector<RequestPtr> gone;
  for (auto& r : running_)
    if (r->cancelled) gone.push_back(r);
  for (auto& r : waiting_)
    if (r->cancelled) gone.push_back(r);
  for (auto& r : gone) abort(r, out);
}

void BatchScheduler::admit() {
  while (!waiting_.empty() && !free_slots_.empty()) {
    const RequestPtr& r = waiting_.front();
    const int need = pages_for(int(r->tokens.size()));
    if (int(free_pages_.size()) < need) break;  // first come, first served: no overtaking
    r->slot = free_slots_.back();
    free_slots_.pop_back();
    for (int i = 0; i < need; ++i) {
      r->pages.push_back(free_pages_.back());
      free_pages_.pop_back();
    }
    r->num_computed = 0;
    running_.push_back(r);
    waiting_.pop_front();
  }
}

bool BatchScheduler::take_page(Request& r) {
  if (free_pages_.empty()) return false;
  r.pages.push_back(free_pages_.back());
  free_pages_.pop_back();
  return true;
}

void BatchScheduler::preempt_newest() {
  RequestPtr r = running_.back();
  running_.pop_back();
  release(*r);
  r->num_computed = 0;  // recomputed from its known tokens when readmitted
  waiting_.push_front(r);
  ++totals_.preemptions;
}

void BatchScheduler::build(StepPlan& plan) {
  StepTokens& st = plan.tokens;
  SampleBatchBuilder sampling;
  plan.greedy = true;
  int budget = options_.max_step_tokens;
  // The step's rows of the page table: one per request in the step, in the order they join it (a
  // request appears once per step), so the table the backend uploads is as small as the step.
  const int pps = layout_.pages_per_seq;
  auto add_tokens = [&](const RequestPtr& r, int n) {
    const int row = int(in_flight_.size());
    st.page_table.resize(size_t(row + 1) * pps, -1);
    std::copy(r->pages.begin(), r->pages.end(), st.page_table.begin() + size_t(row) * pps);
    for (int i = 0; i < n; ++i) {
      st.token_ids.push_back(r->tokens[size_t(r->num_computed + i)]);
      st.positions.push_back(r->num_computed + i);
      st.seq_slots.push_back(row);
    }
    const bool logit_row = r->num_computed + n == int(r->tokens.size());
    if (logit_row) {
      st.logit_rows.push_back(st.num_tokens() - 1);
      const SamplingParams& sp = r->req.sampling;
      sampling.add_row(sp, sequence_seed(r->seed, 0), uint32_t(r->generated()), *r->penalties);
      plan.greedy = plan.greedy && plain_greedy(sp);
    }
    in_flight_.push_back({r, n, logit_row});
    budget -= n;
  };

  const std::vector<RequestPtr> order(running_.begin(), running_.end());
  // Decode rows: one uncomputed token, which may need a fresh page.
  for (const RequestPtr& r : order) {
    if (budget == 0) break;
    if (r->slot < 0 || int(r->tokens.size()) - r->num_computed != 1) continue;
    bool has_page = pages_for(r->num_computed + 1) <= int(r->pages.size());
    while (!has_page && r->slot >= 0) {
      has_page = take_page(*r);
      if (!has_page) preempt_newest();  // possibly r itself
    }
    if (r->slot >= 0) add_tokens(r, 1);
  }
  const bool decode_only = !in_flight_.empty();
  // Prefill chunks (their pages were taken at admission), oldest first.
  for (const RequestPtr& r : order) {
    if (budget == 0) break;
    const int remaining = int(r->tokens.size()) - r->num_computed;
    if (r->slot < 0 || remaining <= 1) continue;
    add_tokens(r, std::min(remaining, budget));
  }
  if (in_flight_.empty()) return;

  const bool pad = records_steps_ && decode_only && int(in_flight_.size()) == st.num_tokens();
  if (pad) {  // the padding rows share one more table row, which maps position 0 to the padding page
    const int rows = st.num_tokens(), bucket = decode_bucket(rows);
    if (bucket > rows) {
      st.page_table.resize(size_t(rows + 1) * pps, -1);
      st.page_table[size_t(rows) * pps] = layout_.padding_page;
    }
    for (int i = rows; i < bucket; ++i) {
      st.token_ids.push_back(0);
      st.positions.push_back(0);
      st.seq_slots.push_back(rows);
      st.logit_rows.push_back(i);
      sampling.add_greedy_row();
    }
    st.num_padding = bucket - rows;
    plan.graph_key = bucket;
  }
  if (!plan.greedy) plan.sampling = sampling.batch();
}

StepPlan BatchScheduler::next_plan() {
  std::vector<Pending> out;
  StepPlan plan;
  {
    std::unique_lock lock(mutex_);
    for (;;) {
      drop_cancelled(out);
      if (stopping_) {
        while (!running_.empty()) abort(running_.front(), out);
        while (!waiting_.empty()) abort(waiting_.front(), out);
        plan.shutdown = true;
        break;
      }
      admit();
      build(plan);
      if (!in_flight_.empty()) break;
      if (!out.empty()) {  // aborts to deliver while idle
        lock.unlock();
        deliver(out);
        lock.lock();
        continue;
      }
      work_.wait(lock);
    }
    ++totals_.steps;
  }
  deliver(out);
  return plan;
}

void BatchScheduler::complete(const std::vector<int32_t>& ids) {
  std::vector<Pending> out;
  {
    std::lock_guard lock(mutex_);
    size_t row = 0;
    for (const Scheduled& s : in_flight_) {
      const RequestPtr& r = s.request;
      const int32_t token = s.logit_row ? ids.at(row++) : -1;
      if (r->slot < 0) continue;  // ended meanwhile (a failure shut serving down)
      r->num_computed += s.num_tokens;
      if (r->cancelled) {
        abort(r, out);
        continue;
      }
      if (!s.logit_row) continue;
      r->tokens.push_back(token);
      r->penalties->add_generated(token);
      ++totals_.generated_tokens;
      const SamplingParams& sp = r->req.sampling;
      FinishReason reason = check_token_stop(sp, token, r->req.eos_token_ids, r->generated());
      ServeUpdate update;
      update.tokens = {token};
      // The text of an EOS or stop token is not part of the reply (as in generate); its id is.
      const bool silent = reason == FinishReason::kEos || reason == FinishReason::kStopToken;
      if (r->stop && !silent) {
        update.text = r->stop->feed(r->req.detokenize(token));
        if (r->stop->stopped()) reason = FinishReason::kStopString;
      }
      if (reason != FinishReason::kNone) {
        finish(r, reason, out, std::move(update));
      } else {
        update.prompt_tokens = r->prompt_len;
        update.completion_tokens = r->generated();
        out.push_back({r->req.on_update, std::move(update)});
      }
    }
    in_flight_.clear();
  }
  deliver(out);
}

}  // namespace tpmoe
