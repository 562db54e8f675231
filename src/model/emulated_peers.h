// A stand-in for the other ranks of a tensor-parallel group, so that one device can run exactly
// what rank 0 of a tp-N deployment runs (its shard, the tp-N fusion plan) and time it: `tpmoe bench
// --emulate-tp N`. It reports size N, and every collective does rank 0's local share of the work
// through a communicator of one rank (`inner`): the fused all-reduce + residual add + RMSNorm runs
// its real kernel over one rank's partial, a plain all-reduce leaves the partial as it is, and an
// all-gather fills every rank's slot with rank 0's data. The numbers it produces are not the
// model's (the peers' partial sums are missing); the work and the bytes per rank are.
#pragma once

#include <cstddef>
#include <functional>

#include "core/error.h"
#include "model/communicator.h"

namespace tpmoe {

class EmulatedPeers final : public Communicator {
 public:
  // `copy(dst, src, bytes)` copies within the backend's memory.
  EmulatedPeers(Communicator& inner, int emulated_size, std::function<void(void*, const void*, size_t)> copy)
      : inner_(inner), size_(emulated_size), copy_(std::move(copy)) {
    TPMOE_CHECK(inner.size() == 1 && emulated_size >= 1, "emulated peers: need a one-rank communicator, got {}",
                inner.size());
  }
  int rank() const override { return 0; }
  int size() const override { return size_; }
  void all_reduce(Tensor data) override { inner_.all_reduce(data); }
  void allreduce_add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor y) override {
    inner_.allreduce_add_rmsnorm(partial, residual, weight, eps, y);
  }
  void all_gather(Tensor local, Tensor gathered) override {
    const size_t n = local.nbytes();
    TPMOE_CHECK(gathered.nbytes() == n * size_t(size_), "emulated all_gather: {} bytes for {} ranks of {} bytes",
                gathered.nbytes(), size_, n);
    for (int r = 0; r < size_; ++r) copy_(static_cast<std::byte*>(gathered.data) + size_t(r) * n, local.data, n);
  }

 private:
  Communicator& inner_;
  int size_;
  std::function<void(void*, const void*, size_t)> copy_;
};

}  // namespace tpmoe
