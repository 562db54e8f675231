// The process-wide switch for programmatic dependent launch (launch_pdl in kernel_utils.cuh): on by
// default; `--pdl off` measures a step without it. Host code; read at every launch, so flipping it
// affects steps recorded afterwards.
#pragma once

#include <atomic>

namespace tpmoe::cuda {

inline std::atomic<bool> g_programmatic_launch{true};
inline void set_programmatic_launch(bool on) { g_programmatic_launch.store(on); }
inline bool programmatic_launch() { return g_programmatic_launch.load(std::memory_order_relaxed); }

}  // namespace tpmoe::cuda
