// Runs one function on every rank this process drives, with one failure policy for every backend
// and launch mode:
//   - each local rank runs on its own thread (the first on the caller's);
//   - when a rank fails, its peers may be blocked in a collective waiting for it. The runner asks
//     the backend to wake them (the CPU communicator can: they then fail with PeerFailed); if they
//     cannot be woken (a GPU kernel spinning on a peer's flag), they get kPeerGraceSeconds to finish
//     or fail, and then the process prints the first error and ends, instead of hanging;
//   - under mpirun the peers are in other processes: the job is aborted (MPI_Abort) with the error;
//   - otherwise the error of the lowest failing rank is rethrown (not a peer's PeerFailed).
#pragma once

#include <cstddef>
#include <functional>

namespace tpmoe {

class RankRunner {
 public:
  static constexpr int kPeerGraceSeconds = 30;

  // `multi_process`: the group spans processes (mpirun); `grouped`: there are peers to wait for.
  RankRunner(bool multi_process, bool grouped) : multi_process_(multi_process), grouped_(grouped) {}

  // f(i) for i < n, concurrently. `wake_peers` (may be empty: cannot) is called once, after the
  // first failure, and says whether blocked peers were woken. `rank_of(i)` names rank i in messages.
  void run(size_t n, const std::function<void(size_t)>& f, const std::function<bool()>& wake_peers,
           const std::function<int(size_t)>& rank_of) const;

 private:
  bool multi_process_, grouped_;
};

}  // namespace tpmoe
