// The collective operations tensor parallelism needs, behind one interface: the in-process CPU
// communicator (ranks as threads over shared memory) and the NCCL one implement it.
//
// Every collective is called by every rank in the same order with the same shapes. Results are
// bitwise identical on every rank (peers are summed in rank order), so ranks that compute the same
// argmax from the same logits never diverge.
#pragma once

#include "core/error.h"
#include "model/tensor.h"

namespace tpmoe {

// What a rank blocked in a collective throws when a peer failed: the peer's own error is the one
// to report.
class PeerFailed : public Error {
 public:
  using Error::Error;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[T, H] <- sum over ranks of data[T, H].
  virtual void all_reduce(Tensor data) = 0;
  // residual[T, H] <- residual + sum over ranks of partial; y[T, H] <- gemma_rmsnorm(residual) * (1 + w).
  // One pass: the partial is never materialised reduced on its own.
  virtual void allreduce_add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor y) = 0;
  // gathered <- every rank's `local`, rank-major: bytes [r * local.nbytes(), (r+1) * local.nbytes())
  // hold rank r's. gathered has size() times local's bytes; any dtype (copied as bytes).
  virtual void all_gather(Tensor local, Tensor gathered) = 0;
};

}  // namespace tpmoe
