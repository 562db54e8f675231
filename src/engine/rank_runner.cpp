#include "engine/rank_runner.h"

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/launch.h"
#include "model/communicator.h"

namespace tpmoe {

void RankRunner::run(size_t n, const std::function<void(size_t)>& f, const std::function<bool()>& wake_peers,
                     const std::function<int(size_t)>& rank_of) const {
  std::vector<std::exception_ptr> errors(n);
  std::mutex mutex;
  std::condition_variable changed;
  size_t finished = 0;
  bool peers_woken = false;
  std::string first_error;
  auto run_one = [&](size_t i) {
    std::exception_ptr error;
    std::string message;
    try {
      f(i);
    } catch (const std::exception& e) {
      error = std::current_exception();
      message = fmt::format("rank {}: {}", rank_of(i), e.what());
    } catch (...) {
      error = std::current_exception();
      message = fmt::format("rank {} failed", rank_of(i));
    }
    bool wake = false;
    {
      std::lock_guard lock(mutex);
      errors[i] = error;
      if (error && first_error.empty()) {
        first_error = message;
        wake = true;
      }
      ++finished;
    }
    if (wake && grouped_) {
      // Peers in other processes cannot be reached from here: end the job with the error.
      if (multi_process_) mpi_abort(message.c_str());
      const bool woken = wake_peers && wake_peers();
      std::lock_guard lock(mutex);
      peers_woken = woken;
    }
    changed.notify_all();
  };
  std::thread watchdog;
  if (n > 1) {
    watchdog = std::thread([&] {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] { return finished == n || !first_error.empty(); });
      if (finished == n || peers_woken) return;
      if (changed.wait_for(lock, std::chrono::seconds(kPeerGraceSeconds), [&] { return finished == n; })) return;
      std::fprintf(stderr, "error: %s (the other ranks are blocked in a collective; ending the process)\n",
                   first_error.c_str());
      std::fflush(stderr);
      std::_Exit(1);
    });
  }
  std::vector<std::thread> threads;
  for (size_t i = 1; i < n; ++i) threads.emplace_back(run_one, i);
  if (n > 0) run_one(0);
  for (auto& t : threads) t.join();
  if (watchdog.joinable()) watchdog.join();
  // Report the rank that failed, not the peers it woke with PeerFailed.
  std::exception_ptr peer_failed;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const PeerFailed&) {
      peer_failed = e;
    } catch (...) {
      throw;
    }
  }
  if (peer_failed) std::rethrow_exception(peer_failed);
}

}  // namespace tpmoe
