// Tensor parallelism on GPUs over NCCL (SPEC §4): the CUDA engine for tp > 1, in either launch
// mode, and for tp 1 when asked to run through the NCCL communicator anyway.
//   thread per GPU: `tpmoe ... --device cuda --tp N` in one process; rank r on GPU r.
//   process per GPU: `mpirun -np N tpmoe ... --device cuda`; rank = MPI rank, GPU = local rank,
//     the ncclUniqueId broadcast over MPI, only rank 0 prints. Covers several hosts (the fused
//     kernels then give way to ncclAllReduce).
// TPMOE_FORCE_NCCL=1: tp 1 through the NCCL communicator (window, device communicator, the
// degenerate reduction) instead of the plain single-GPU engine; tests use it.
#pragma once

#include <cstdint>
#include <memory>

#include "io/checkpoint.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe::cuda {

// tp > 1, a launch under mpirun, or TPMOE_FORCE_NCCL=1.
bool use_nccl_engine(const EngineOptions& options);

std::unique_ptr<Engine> make_tp_engine(const io::Checkpoint& ckpt, const EngineOptions& options);
std::unique_ptr<Engine> make_tp_preset_engine(const ModelConfig& config, uint64_t seed, const EngineOptions& options);

}  // namespace tpmoe::cuda
