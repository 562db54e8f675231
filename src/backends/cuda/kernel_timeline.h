// Where a recorded step's time goes, kernel by kernel, as the GPU ran it (--kernel-timeline): the
// start and end of every kernel of every replayed graph, from CUPTI's activity records (the CUDA
// toolkit's profiling interface; no profiler process, PDL overlap kept). Per graph, each kernel node
// gets its mean start and end within a replay, and its "link": how much later than the kernel
// before it (in start order) it ends. The links add up to the step; a kernel's link is what the
// step would lose without it, its duration includes the time it waited for its predecessor. Host code.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tpmoe::cuda {

// One kernel as the GPU ran it (ns, the GPU's clock).
struct KernelRun {
  std::string name;  // demangled, without arguments
  uint64_t start = 0, end = 0;
  uint32_t graph = 0;       // the graph that launched it (0: launched directly)
  uint64_t graph_node = 0;  // its node in that graph
};

// A kernel's mangled name as the report shows it: the function's own name and template arguments
// ("gemv_kernel<1, false>"), without namespaces, return type and parameters.
std::string short_kernel_name(const char* mangled);

// Records the kernels that run between start() and stop(), in this process (one timeline at a time:
// CUPTI delivers its records to process-wide callbacks).
class KernelTimeline {
 public:
  KernelTimeline();  // throws naming the CUPTI error where CUPTI is unavailable
  ~KernelTimeline();
  KernelTimeline(const KernelTimeline&) = delete;
  KernelTimeline& operator=(const KernelTimeline&) = delete;

  void start();
  // Flushes what the GPU has finished (call after a synchronisation) and stops recording.
  void stop();
  const std::vector<KernelRun>& runs() const;

 private:
  bool recording_ = false;
};

// One graph's replays, averaged: every replay but the first (which also loads the graph onto the
// device), of a graph replayed three times or more. Times in ns from the replay's first start.
struct TimelineNode {
  std::string name;
  double start = 0, end = 0;
  double link = 0;  // how much later it ends than every node before it in start order (0 if not later)
};
struct TimelineGraph {
  uint32_t graph = 0;
  size_t replays = 0;               // averaged over
  double span = 0;                  // mean first start to last end
  std::vector<TimelineNode> nodes;  // in start order; their links add up to the span
};
std::vector<TimelineGraph> summarize_timeline(const std::vector<KernelRun>& runs);

// The graphs as text: the kernels summed by name (largest link first) and the first `first_nodes`
// kernels in start order.
std::string kernel_timeline_report(const std::vector<TimelineGraph>& graphs, int first_nodes = 24);

}  // namespace tpmoe::cuda
