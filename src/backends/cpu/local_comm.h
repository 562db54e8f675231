// Tensor-parallel ranks as threads of one process, talking through shared memory: the CPU
// implementation of the Communicator interface (the NCCL communicator implements the same one).
//
// A collective publishes each rank's buffer pointer, waits at a barrier, lets every rank read all
// peers' buffers, and waits at a second barrier before anyone may write its buffer again. Peers are
// summed in rank order, so every rank computes bitwise the same result.
//
// If one rank fails, abort() wakes every rank blocked in a collective with an error instead of
// leaving it to wait forever.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "model/communicator.h"

namespace tpmoe::cpu {

class LocalCommGroup {
 public:
  explicit LocalCommGroup(int size);
  ~LocalCommGroup();
  Communicator& rank(int r);
  // Makes every current and future collective throw; called by a rank that failed.
  void abort();

 private:
  friend class LocalCommunicator;
  void barrier();  // throws once aborted

  int size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::vector<const void*> published_;  // one buffer pointer per rank
  std::vector<std::unique_ptr<Communicator>> ranks_;
};

}  // namespace tpmoe::cpu
