// `tpmoe bench-op`: single-operation benchmarks that need the engine's launch (ranks as threads,
// or one process per rank under mpirun).
#pragma once

namespace tpmoe {

// Fused all-reduce + residual + RMSNorm against ncclAllReduce (+ norm) per step size, at tp ranks.
void run_allreduce_bench(int tp);

}  // namespace tpmoe
