#include "backends/cpu/local_comm.h"

#include <cstring>

#include "backends/cpu/cpu_ops.h"
#include "core/error.h"

namespace tpmoe::cpu {

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(LocalCommGroup& group, int rank) : g_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_.size_; }

  void all_reduce(Tensor data) override {
    TPMOE_CHECK(data.dtype == DType::kF32, "local all_reduce: fp32 only, got {}", dtype_name(data.dtype));
    if (g_.size_ == 1) return;
    std::vector<float> sum(static_cast<size_t>(data.numel()));
    sum_peers(data, sum.data());
    g_.barrier();  // every peer has read every buffer: now each may overwrite its own
    std::memcpy(data.data, sum.data(), data.nbytes());
  }

  void all_gather(Tensor local, Tensor gathered) override {
    const size_t n = local.nbytes();
    TPMOE_CHECK(gathered.nbytes() == n * size_t(g_.size_), "local all_gather: {} bytes for {} ranks of {} bytes",
                gathered.nbytes(), g_.size_, n);
    {
      std::lock_guard lock(g_.mutex_);
      g_.published_[rank_] = local.data;
    }
    if (g_.size_ > 1) g_.barrier();  // every rank's buffer is published and final
    for (int r = 0; r < g_.size_; ++r)
      std::memcpy(static_cast<std::byte*>(gathered.data) + size_t(r) * n, g_.published_[r], n);
    if (g_.size_ > 1) g_.barrier();  // peers may still be reading our buffer
  }

  void allreduce_add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor y) override {
    const int64_t H = weight.dim(0), T = partial.numel() / H;
    std::vector<float> sum(static_cast<size_t>(partial.numel()));
    if (g_.size_ == 1)
      std::memcpy(sum.data(), partial.data, partial.nbytes());
    else
      sum_peers(partial, sum.data());
    float* res = residual.as<float>();
    // residual + (p0 + p1 + ...): the same order as all_reduce followed by add, so the fused and
    // unfused paths agree bitwise.
    for (int64_t i = 0; i < T * H; ++i) res[i] += sum[i];
    for (int64_t t = 0; t < T; ++t)
      gemma_rmsnorm_row(res + t * H, weight.as<float>(), int(H), eps, y.as<float>() + t * H);
    if (g_.size_ > 1) g_.barrier();  // peers may still be reading our partial
  }

 private:
  // out = sum over ranks (in rank order) of each rank's `mine`-shaped buffer.
  void sum_peers(Tensor mine, float* out) {
    {
      std::lock_guard lock(g_.mutex_);
      g_.published_[rank_] = mine.data;
    }
    g_.barrier();  // after this: every rank's buffer pointer is published and its data final
    const int64_t n = mine.numel();
    std::memcpy(out, g_.published_[0], size_t(n) * sizeof(float));
    for (int r = 1; r < g_.size_; ++r) {
      const float* peer = static_cast<const float*>(g_.published_[r]);
      for (int64_t i = 0; i < n; ++i) out[i] += peer[i];
    }
  }

  LocalCommGroup& g_;
  int rank_;
};

LocalCommGroup::LocalCommGroup(int size) : size_(size), published_(size_t(size), nullptr) {
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<LocalCommunicator>(*this, r));
}

LocalCommGroup::~LocalCommGroup() = default;

Communicator& LocalCommGroup::rank(int r) { return *ranks_.at(size_t(r)); }

void LocalCommGroup::abort() {
  std::lock_guard lock(mutex_);
  aborted_ = true;
  cv_.notify_all();
}

void LocalCommGroup::barrier() {
  std::unique_lock lock(mutex_);
  if (aborted_) throw PeerFailed("another tensor-parallel rank failed", __FILE__, __LINE__);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
  if (aborted_) throw PeerFailed("another tensor-parallel rank failed", __FILE__, __LINE__);
}

}  // namespace tpmoe::cpu
