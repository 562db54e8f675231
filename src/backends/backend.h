// What a backend supplies to the engine (src/engine/engine.cpp), for the CPU oracle and the CUDA
// backend alike: the ranks of a tensor-parallel group that this process drives, each with its
// weights, its communicator and, per request, the Ops that run the forward. The engine owns the
// policy (which requests run, how many tokens a step holds, how ranks are launched and fail); a
// backend only sizes what it is told to (a StepBudget), never looks at a request.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "io/checkpoint.h"
#include "model/communicator.h"
#include "model/config.h"
#include "model/fusion_plan.h"
#include "model/ops.h"
#include "model/parallel.h"
#include "model/weights.h"

namespace tpmoe {

// The most one generate asks of a rank: the backend reserves scratch and KV cache from it.
struct StepBudget {
  int max_tokens = 0;      // tokens in one forward step (a prefill, or a padded decode batch)
  int max_logit_rows = 0;  // rows of logits one step returns
  int max_seqs = 0;        // KV-cache slots
  int max_len = 0;         // positions per slot
};

// Where a rank's weights come from: a checkpoint, or a built-in preset's random weights (which a
// backend may generate where they will live, e.g. on the GPU).
struct WeightSource {
  const io::Checkpoint* checkpoint = nullptr;
  uint64_t preset_seed = 0;  // used when checkpoint is null
};

// How this process takes part in the group: the ranks it drives (all of them as threads, or its own
// under mpirun) and the bootstrap exchange with the other processes (identity within one process).
struct RankLaunch {
  int tp = 1;
  std::vector<int> local_ranks;    // global rank ids this process drives
  std::vector<int> local_devices;  // device index per local rank (GPU; ignored on the CPU)
  bool multi_process = false;
  // One device stands in for a whole tp-`tp` group: local_ranks is {0}, and its communicator is
  // EmulatedPeers (model/emulated_peers.h) over a group of one. For measuring one rank's step.
  bool emulated = false;
  // Bootstrap collectives across processes, before any communicator exists (MPI; identity or
  // unused within one process): rank 0's `bytes` at `data` reach every process; all[r] <- rank r's.
  std::function<void(void* data, size_t bytes)> broadcast_from_rank0;
  std::function<void(const void* mine, void* all, size_t bytes)> allgather;
  // Runs f(i) for every local rank i at once, each on its own thread, under the engine's failure
  // policy (a rank that fails alone does not leave its peers hanging): for collective set-up.
  std::function<void(const std::function<void(size_t local_index)>& f)> on_local_ranks;
};

// One rank of the group.
class RankBackend {
 public:
  virtual ~RankBackend() = default;
  virtual int rank() const = 0;
  // Called first on the thread that runs this rank (makes its GPU current).
  virtual void activate() {}
  virtual const ModelWeights& weights() const = 0;
  virtual Communicator& comm() = 0;
  // Ops for one generate, with every buffer `budget` needs reserved up front; collectives of comm()
  // are bound to these ops' stream until the ops are destroyed.
  virtual std::unique_ptr<Ops> make_ops(const StepBudget& budget) = 0;
};

// The ranks this process drives. Collective calls (construction, teardown) are made by every
// process of the group.
class RankGroup {
 public:
  virtual ~RankGroup() = default;
  virtual std::vector<RankBackend*> local_ranks() = 0;
  // After a rank failed: make its peers that are blocked in a collective fail too. False when they
  // cannot be woken (a GPU kernel spinning on a peer's flag): the engine then ends the process.
  virtual bool wake_blocked_peers() = 0;
  // Bytes of weights rank 0 holds (every rank holds the same amount, up to replication).
  virtual size_t weight_bytes_per_rank() const = 0;
};

}  // namespace tpmoe
