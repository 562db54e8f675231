// The ranks' side of serving: every rank runs the StepPlans rank 0's scheduler makes. In one
// process the plans reach the other ranks' threads through a PlanChannel; under mpirun they travel
// as bytes (RankLaunch::broadcast_from_rank0).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/scheduler.h"
#include "model/model.h"

namespace tpmoe {

// Runs one plan's step on this rank and returns the id of every logit row (the same on every rank).
// Collective.
std::vector<int32_t> run_plan(Ops& ops, Model& model, const StepPlan& plan);

// Rank 0's plans, handed to the other local ranks' threads in order (receiver i: local rank i + 1).
class PlanChannel {
 public:
  explicit PlanChannel(size_t receivers) : queues_(receivers) {}
  void publish(const std::shared_ptr<const StepPlan>& plan);
  // The next plan for receiver i; throws PeerFailed once the channel is closed.
  std::shared_ptr<const StepPlan> receive(size_t i);
  // Wakes every receiver with an error (a rank failed).
  void close();

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::deque<std::shared_ptr<const StepPlan>>> queues_;
  bool closed_ = false;
};

}  // namespace tpmoe
