// Engine constructors per backend (engine.cpp dispatches on EngineOptions::device).
#pragma once

#include <memory>

#include "io/checkpoint.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {

std::unique_ptr<Engine> make_cpu_engine(const io::Checkpoint& ckpt, const EngineOptions& options);

#ifdef TPMOE_WITH_CUDA
std::unique_ptr<Engine> make_cuda_engine(const io::Checkpoint& ckpt, const EngineOptions& options);
// A preset generated directly in GPU memory.
std::unique_ptr<Engine> make_cuda_preset_engine(const ModelConfig& config, uint64_t seed, const EngineOptions& options);
// Whether a CUDA GPU is visible to this process.
bool cuda_device_present();
// Device-to-device copy bandwidth of the current GPU, bytes read + written per second.
double cuda_copy_bandwidth();
// `tpmoe bench-op allreduce`: fused all-reduce + RMSNorm vs NCCL per step size (allreduce_bench.cpp).
void run_allreduce_bench(int tp);
#endif

}  // namespace tpmoe
