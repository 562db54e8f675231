#include "engine/generation.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "core/error.h"
#include "engine/next_tokens.h"
#include "engine/sampling.h"

namespace tpmoe {

namespace {

int max_prompt_length(const GenerateRequest& req) {
  size_t n = 0;
  for (const auto& p : req.prompts) n = std::max(n, p.size());
  return int(n);
}

}  // namespace

void validate_request(const GenerateRequest& req, int vocab_size) {
  const int B = int(req.prompts.size()), G = req.max_new_tokens;
  TPMOE_CHECK(B > 0, "generate: no prompts");
  TPMOE_CHECK(G >= 1, "generate: max_new_tokens must be at least 1, got {}", G);
  for (int b = 0; b < B; ++b) {
    TPMOE_CHECK(!req.prompts[b].empty(), "generate: prompt {} is empty", b);
    for (int32_t id : req.prompts[b])
      TPMOE_CHECK(id >= 0 && id < vocab_size, "generate: prompt {} has token id {}, outside the vocabulary (size {})",
                  b, id, vocab_size);
  }
  req.sampling.validate(vocab_size);
  for (int32_t id : req.eos_token_ids)
    TPMOE_CHECK(id >= 0 && id < vocab_size, "generate: EOS token id {} outside the vocabulary (size {})", id,
                vocab_size);
  TPMOE_CHECK(req.sampling.stop.empty() || req.detokenize,
              "generate: stop strings need the generated text (a tokenizer): give detokenize, or use stop token ids");
  if (req.forced_tokens.empty()) return;
  TPMOE_CHECK(int(req.forced_tokens.size()) == B, "teacher forcing: {} rows of forced tokens for {} prompts",
              req.forced_tokens.size(), B);
  for (const auto& f : req.forced_tokens) {
    TPMOE_CHECK(int(f.size()) >= G - 1, "teacher forcing: {} forced tokens, need {} for {} new tokens", f.size(), G - 1,
                G);
    for (int32_t id : f)
      TPMOE_CHECK(id >= 0 && id < vocab_size, "teacher forcing: token id {} outside the vocabulary (size {})", id,
                  vocab_size);
  }
}

int decode_bucket(int batch) {
  int bucket = 1;
  while (bucket < batch) bucket *= 2;
  return bucket;
}

CacheShape request_cache_shape(const Model& model, const GenerateRequest& req, bool padded) {
  const int B = int(req.prompts.size());
  return model.cache_shape(padded ? decode_bucket(B) : B, max_prompt_length(req) + req.max_new_tokens);
}

namespace {

// What decides each sequence's next token and when it ends: its sampling state, its stop checks
// and (primary rank, when the caller streams text) its text. Every rank keeps the same state from
// the same ids, so every rank takes the same decisions; only stop strings need text, which only
// the primary rank has, and the ranks then agree through the communicator (decide_stops).
class Sequences {
 public:
  Sequences(const GenerateRequest& req, uint64_t seed, bool primary)
      : req_(req), params_(req.sampling), primary_(primary), seed_(seed) {
    params_.max_tokens = req.max_new_tokens;  // the request's length is the one bound
    const int B = int(req.prompts.size());
    plain_greedy_ = tpmoe::plain_greedy(params_);
    for (int b = 0; b < B; ++b) {
      penalties_.emplace_back(params_, req.prompts[b]);
      stops_.emplace_back(params_.stop);
    }
    finish_.assign(size_t(B), FinishReason::kNone);
    texts_.resize(size_t(B));
    generated_.resize(size_t(B));
  }

  bool finished(int b) const { return finish_[b] != FinishReason::kNone; }
  // Greedy without penalties: a step's ids follow from its logits alone (the same ops every step).
  bool plain_greedy() const { return plain_greedy_; }
  bool all_finished() const {
    return std::all_of(finish_.begin(), finish_.end(), [](FinishReason f) { return f != FinishReason::kNone; });
  }
  const std::vector<std::vector<int32_t>>& generated() const { return generated_; }

  // The next ids of the step's logit rows (`row_seq[r]`: the sequence of row r, or -1: a row whose
  // token nobody uses). Collective.
  std::vector<int32_t> next_ids(Ops& ops, Model& model, Tensor logits, const std::vector<int>& row_seq) {
    if (plain_greedy_) return greedy_ids(ops, model, logits);
    return sampled_ids(ops, model, logits, sample_batch(row_seq, std::nullopt));
  }

  // True when nothing the host decides about a step depends on the ids of the step before, other
  // than which sequences have ended: no penalties (they count the generated ids), no stop strings
  // (they need the text, and the ranks agree on them between steps), no forced tokens. Then decode
  // step i+1 may be queued before the host has read step i's ids (generate_on_rank).
  bool steps_may_overlap() const {
    return !penalties_.front().active() && params_.stop.empty() && req_.forced_tokens.empty();
  }

  // next_ids for a sampled step queued before the host has read the ids of the step before: they
  // stay on the device. Every sequence still running has generated `generated_so_far` tokens before
  // this step (the host may have appended fewer of them yet); the draw of a row is keyed by that count.
  Tensor sampled_ids_on_device(Ops& ops, Model& model, Tensor logits, const std::vector<int>& row_seq,
                               uint32_t generated_so_far) {
    return tpmoe::sampled_ids_on_device(ops, model, logits, sample_batch(row_seq, generated_so_far));
  }

  // Appends sequence b's next token (forced, or drawn) and applies the stop checks that need no
  // text. Teacher-forced runs never stop early: their length is the request's.
  void append(int b, int32_t token) {
    if (finished(b)) return;
    generated_[b].push_back(token);
    penalties_[b].add_generated(token);
    const FinishReason f = check_token_stop(params_, token, req_.eos_token_ids, int(generated_[b].size()));
    // The text of an EOS or stop token is not part of the reply (as vLLM returns it); its id is.
    const bool silent = f == FinishReason::kEos || f == FinishReason::kStopToken;
    if (primary_ && req_.detokenize && !silent) emit(b, stops_[b].feed(req_.detokenize(b, token)));
    if (f != FinishReason::kNone && (req_.forced_tokens.empty() || f == FinishReason::kLength)) finish(b, f);
  }

  // Stop strings are matched on the primary rank's text; every rank adopts its decisions (one
  // small all-gather per step, only when the request has stop strings). Collective.
  void decide_stops(Ops& ops, Model& model) {
    if (params_.stop.empty() || !req_.forced_tokens.empty()) return;
    const int B = int(finish_.size());
    Tensor mine = ops.alloc_typed(B, 1, DType::kI32),
           all = ops.alloc_typed(int64_t(model.comm().size()) * B, 1, DType::kI32);
    std::vector<int32_t> flags(size_t(B), 0);
    if (primary_)
      for (int b = 0; b < B; ++b) flags[b] = stops_[b].stopped();
    ops.upload_ids(flags, mine);
    model.comm().all_gather(mine, all);
    const std::vector<int32_t> decided = ops.ids_to_host(all);
    for (int b = 0; b < B; ++b)  // rank 0's slot (the primary rank's under mpirun too)
      if (decided[b] && !finished(b)) finish(b, FinishReason::kStopString);
  }

  void fill(GenerateResult& out) {
    for (int b = 0; b < int(finish_.size()); ++b) {
      if (!finished(b)) finish(b, FinishReason::kLength);
      out.finish_reasons.push_back(finish_reason_name(finish_[b]));
    }
    out.generated = generated_;
    if (req_.detokenize) out.texts = texts_;
  }

 private:
  SampleBatch sample_batch(const std::vector<int>& row_seq, std::optional<uint32_t> generated_so_far) const {
    SampleBatchBuilder builder;
    for (int b : row_seq) {
      if (b < 0 || finished(b))
        builder.add_greedy_row();
      else
        builder.add_row(params_, sequence_seed(seed_, uint32_t(b)),
                        generated_so_far.value_or(uint32_t(generated_[b].size())), penalties_[b]);
    }
    return builder.batch();
  }

  void finish(int b, FinishReason f) {
    finish_[b] = f;
    if (primary_ && req_.detokenize && f != FinishReason::kStopString) emit(b, stops_[b].flush());
  }
  void emit(int b, const std::string& text) {
    if (text.empty()) return;
    texts_[b] += text;
    if (req_.on_text) req_.on_text(b, text);
  }

  const GenerateRequest& req_;
  SamplingParams params_;
  bool primary_;
  uint64_t seed_;
  bool plain_greedy_ = true;
  std::vector<SequencePenalties> penalties_;
  std::vector<StopMatcher> stops_;
  std::vector<FinishReason> finish_;
  std::vector<std::string> texts_;
  std::vector<std::vector<int32_t>> generated_;
};

}  // namespace

void generate_on_rank(Ops& ops, Model& model, int V, const GenerateRequest& req, uint64_t seed, GenerateResult* out) {
  const int B = int(req.prompts.size()), G = req.max_new_tokens;
  Sequences seqs(req, seed, out != nullptr);
  // Prefill: every prompt in one step. Logits only where they are wanted: the last prompt token of
  // each sequence, or every position when prefill logits are asked for.
  StepTokens step;
  std::vector<int> last_row(static_cast<size_t>(B)), row_seq;
  for (int b = 0; b < B; ++b) {
    const auto& p = req.prompts[b];
    for (int i = 0; i < int(p.size()); ++i) {
      const bool last = i + 1 == int(p.size());
      if (req.return_prefill_logits || last) {
        step.logit_rows.push_back(step.num_tokens());
        row_seq.push_back(last ? b : -1);
      }
      step.token_ids.push_back(p[i]);
      step.positions.push_back(i);
      step.seq_slots.push_back(b);
    }
    last_row[b] = int(step.logit_rows.size()) - 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (req.record_routing) ops.enable_routing_stats(model.num_layers(), model.num_experts());
  ops.begin_step(step);
  Tensor logits = model.forward(step);
  std::vector<int32_t> next = seqs.next_ids(ops, model, logits, row_seq);  // one id per logit row
  for (int b = 0; b < B; ++b) seqs.append(b, next[last_row[b]]);
  seqs.decide_stops(ops, model);
  // Logits reach the host only when asked for (every rank gathers; rank 0 keeps them).
  if (req.return_step_logits || req.return_prefill_logits) {
    const std::vector<float> host = full_logits_to_host(ops, model, logits);
    std::vector<float> step_logits(size_t(B) * V);
    for (int b = 0; b < B; ++b) std::copy_n(&host[size_t(last_row[b]) * V], V, &step_logits[size_t(b) * V]);
    if (out && req.return_step_logits) out->step_logits.push_back(std::move(step_logits));
    if (out && req.return_prefill_logits) {
      size_t row = 0;
      for (int b = 0; b < B; ++b) {
        const size_t n = req.prompts[b].size() * size_t(V);
        out->prefill_logits.emplace_back(host.begin() + row * V, host.begin() + row * V + n);
        row += req.prompts[b].size();
      }
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  if (req.record_routing) ops.take_routed_experts();  // the prefill's choices are not a decode step's

  // Decode: one token per sequence per step, until every sequence has finished. A recording
  // backend gets the batch padded to its bucket; the padding rows (and finished sequences) decode
  // token 0 at position 0 in slots of their own and are ignored.
  const int rows = ops.records_steps() ? decode_bucket(B) : B;
  std::vector<int> decode_row_seq;
  for (int b = 0; b < rows; ++b) decode_row_seq.push_back(b < B ? b : -1);
  // Step i's tokens: a running sequence feeds its token of step i - 1 at position P_b + i - 1; with
  // `fed_back` that token stays on the device (StepTokens::kFedBackId).
  auto decode_tokens = [&](int i, bool fed_back) {
    StepTokens d;
    for (int b = 0; b < rows; ++b) {
      const bool live = b < B && !seqs.finished(b);
      d.token_ids.push_back(!live                       ? 0
                            : fed_back                  ? StepTokens::kFedBackId
                            : req.forced_tokens.empty() ? seqs.generated()[b][i - 1]
                                                        : req.forced_tokens[b][i - 1]);
      d.positions.push_back(live ? int(req.prompts[b].size()) + i - 1 : 0);
      d.seq_slots.push_back(b);
      d.logit_rows.push_back(b);
    }
    d.num_padding = rows - B;
    return d;
  };
  std::vector<double> step_seconds;
  step_seconds.reserve(size_t(std::max(0, G - 1)));
  const bool overlap = req.overlap_decode && seqs.steps_may_overlap() && !req.return_step_logits && !req.record_routing;
  const bool overlapped = overlap && G > 1 && !seqs.all_finished();  // decode steps ran, overlapped
  if (overlapped) {
    // Step i + 1 is queued before the host reads step i's ids, so the device never waits for the
    // host between steps: a running sequence's token reaches the next step on the device. A sequence
    // that ends at step i still runs in step i + 1 (its result is dropped); after the last step one
    // queued step is run for nothing. A step's time is the time between the arrivals of two steps' ids.
    StepTokens queued[2];  // the step running and the one behind it outlive their begin_step
    struct KeptIds {       // what is kept and not taken is taken on the way out, an error's way too
      Ops& ops;
      int pending = 0;
      ~KeptIds() {
        try {
          for (; pending > 0; --pending) ops.take_kept_ids();
        } catch (...) {
        }
      }
    } kept{ops};
    auto queue_step = [&](int i) {
      StepTokens& d = queued[i % 2];
      d = decode_tokens(i, /*fed_back=*/i > 1);
      ops.begin_step(d);
      Tensor ids;
      if (seqs.plain_greedy()) {  // the argmax (and a vocab-parallel rank's gather) recorded with the step
        ids = ops.run_step(-rows, [&] { return greedy_ids_on_device(ops, model, model.forward(d)); });
      } else {  // the draw uploads its rows' parameters every step: not recorded
        logits = ops.run_step(rows, [&] { return model.forward(d); });
        ids = seqs.sampled_ids_on_device(ops, model, logits, decode_row_seq, uint32_t(i));
      }
      ops.keep_ids(ids);
      ++kept.pending;
    };
    auto last = std::chrono::steady_clock::now();
    queue_step(1);
    for (int i = 1; i < G; ++i) {
      if (i + 1 < G) queue_step(i + 1);
      const std::vector<int32_t> ids = ops.take_kept_ids();
      --kept.pending;
      for (int b = 0; b < B; ++b) seqs.append(b, ids[b]);
      const auto now = std::chrono::steady_clock::now();
      step_seconds.push_back(std::chrono::duration<double>(now - last).count());
      last = now;
      if (seqs.all_finished()) break;  // a step queued behind this one is taken by `kept`
    }
  }
  for (int i = 1; !overlap && i < G && !seqs.all_finished(); ++i) {
    const auto step_start = std::chrono::steady_clock::now();
    const StepTokens d = decode_tokens(i, /*fed_back=*/false);
    ops.begin_step(d);
    logits = ops.run_step(rows, [&] { return model.forward(d); });
    next = seqs.next_ids(ops, model, logits, decode_row_seq);
    for (int b = 0; b < B; ++b) seqs.append(b, next[b]);
    seqs.decide_stops(ops, model);
    if (req.return_step_logits) {
      std::vector<float> host = full_logits_to_host(ops, model, logits);
      host.resize(size_t(B) * V);
      if (out) out->step_logits.push_back(std::move(host));
    }
    step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count());
    if (req.record_routing) {  // outside the timed step: it waits for the device
      std::vector<int> routed = ops.take_routed_experts();
      if (out) out->step_routed_experts.push_back(std::move(routed));
    }
  }
  const auto t2 = std::chrono::steady_clock::now();
  if (out) {
    out->vocab_size = V;
    seqs.fill(*out);
    out->prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
    out->decode_seconds = std::chrono::duration<double>(t2 - t1).count();
    out->step_seconds = std::move(step_seconds);
    out->launches_per_step = ops.last_step_launches();
    out->overlapped_decode = overlapped;
  }
}

}  // namespace tpmoe
