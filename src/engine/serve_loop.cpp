#include "engine/serve_loop.h"

#include "engine/next_tokens.h"
#include "model/communicator.h"

namespace tpmoe {

std::vector<int32_t> run_plan(Ops& ops, Model& model, const StepPlan& plan) {
  ops.begin_step(plan.tokens);
  auto forward = [&] { return model.forward(plan.tokens); };
  if (plan.graph_key > 0 && plan.greedy && !plan.tokens.logit_rows.empty()) {
    // A greedy decode step's ids follow from its logits by the same ops every step: recorded with
    // it (under minus its key: Ops::run_step), not launched after each replay.
    return ops.ids_to_host(ops.run_step(-plan.graph_key, [&] { return greedy_ids_on_device(ops, model, forward()); }));
  }
  Tensor logits = plan.graph_key > 0 ? ops.run_step(plan.graph_key, forward) : forward();
  if (plan.tokens.logit_rows.empty()) return {};
  return plan.greedy ? greedy_ids(ops, model, logits) : sampled_ids(ops, model, logits, plan.sampling);
}

void PlanChannel::publish(const std::shared_ptr<const StepPlan>& plan) {
  std::lock_guard lock(mutex_);
  for (auto& q : queues_) q.push_back(plan);
  changed_.notify_all();
}

std::shared_ptr<const StepPlan> PlanChannel::receive(size_t i) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return closed_ || !queues_[i].empty(); });
  if (closed_) throw PeerFailed("serving stopped: another rank failed", __FILE__, __LINE__);
  auto plan = queues_[i].front();
  queues_[i].pop_front();
  return plan;
}

void PlanChannel::close() {
  std::lock_guard lock(mutex_);
  closed_ = true;
  changed_.notify_all();
}

}  // namespace tpmoe
