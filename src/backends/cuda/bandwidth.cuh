// Memory bandwidth of the current GPU (bandwidth.cu), the ceilings the benchmarks divide by.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tpmoe::cuda {

// A read-only stream far larger than the L2, bytes read per second: the ceiling of a decode step,
// which only reads its weights.
double read_bandwidth();
// A device-to-device copy, bytes read + written per second (for reference).
double copy_bandwidth();

// One launch of read_bandwidth's stream over `bytes` at `data` (16-byte aligned, a multiple of 16):
// what reading that many bytes takes a kernel with nothing else to do. A benchmark times it next
// to a kernel that must read the same bytes (bench_moe). `sink`: read_stream_sink_words() words.
size_t read_stream_sink_words();
void launch_read_stream(const void* data, size_t bytes, uint32_t* sink, cudaStream_t stream);

}  // namespace tpmoe::cuda
