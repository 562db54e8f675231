// Memory bandwidth of the current GPU (bandwidth.cu), the ceilings the benchmarks divide by.
#pragma once

namespace tpmoe::cuda {

// A read-only stream far larger than the L2, bytes read per second: the ceiling of a decode step,
// which only reads its weights.
double read_bandwidth();
// A device-to-device copy, bytes read + written per second (for reference).
double copy_bandwidth();

}  // namespace tpmoe::cuda
