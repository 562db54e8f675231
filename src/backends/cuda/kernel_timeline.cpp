#include "backends/cuda/kernel_timeline.h"

#include <cxxabi.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>

#include "core/error.h"

#ifdef TPMOE_WITH_CUPTI
#include <cupti.h>
#endif

namespace tpmoe::cuda {

namespace {

#ifdef TPMOE_WITH_CUPTI
void check_cupti(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  TPMOE_FAIL("CUPTI: {} failed: {}", what, text ? text : "unknown error");
}

// CUPTI hands finished buffers to process-wide callbacks; they append here.
std::mutex g_mutex;
std::vector<KernelRun> g_runs;
bool g_active = false;

constexpr size_t kBufferBytes = size_t(8) << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<KernelRun> runs;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    runs.push_back(
        {k->name ? short_kernel_name(k->name) : std::string("?"), k->start, k->end, k->graphId, k->graphNodeId});
  }
  std::free(buffer);
  std::lock_guard lock(g_mutex);
  g_runs.insert(g_runs.end(), runs.begin(), runs.end());
}

#endif

}  // namespace

#ifdef TPMOE_WITH_CUPTI
KernelTimeline::KernelTimeline() {
  std::lock_guard lock(g_mutex);
  TPMOE_CHECK(!g_active,
              "--kernel-timeline records one GPU a process (CUPTI's records go to process-wide callbacks): run one "
              "rank a process (mpirun) or on one GPU");
  check_cupti(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  g_active = true;
  g_runs.clear();
}

KernelTimeline::~KernelTimeline() {
  if (recording_) {
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  }
  std::lock_guard lock(g_mutex);
  g_active = false;
}

void KernelTimeline::start() {
  if (recording_) return;
  check_cupti(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enabling kernel records");
  recording_ = true;
}

void KernelTimeline::stop() {
  if (!recording_) return;
  check_cupti(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "flushing kernel records");
  check_cupti(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "disabling kernel records");
  recording_ = false;
}

const std::vector<KernelRun>& KernelTimeline::runs() const { return g_runs; }
#else
KernelTimeline::KernelTimeline() {
  TPMOE_FAIL("--kernel-timeline: this build has no CUPTI (the CUDA toolkit's profiling library was not found)");
}
KernelTimeline::~KernelTimeline() = default;
void KernelTimeline::start() {}
void KernelTimeline::stop() {}
const std::vector<KernelRun>& KernelTimeline::runs() const {
  static const std::vector<KernelRun> none;
  return none;
}
#endif

// "void tpmoe::cuda::(anonymous namespace)::gemv_kernel<1, false>(tpmoe::cuda::GemvBatch)" ->
// "gemv_kernel<1, false>". A name that does not demangle is shown as it is.
std::string short_kernel_name(const char* mangled) {
  int status = 0;
  char* full = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && full ? full : mangled;
  std::free(full);
  // Cut the parameter list: the '(' that balances the final ')' (the parameters' own types may hold
  // parentheses: "(anonymous namespace)", function pointers).
  if (!s.empty() && s.back() == ')') {
    int depth = 0;
    for (size_t i = s.size(); i-- > 0;) {
      if (s[i] == ')') ++depth;
      if (s[i] == '(' && --depth == 0) {
        s.resize(i);
        break;
      }
    }
  }
  // Drop the return type and the qualifiers: everything up to the last "::" or ' ' outside <> and ().
  int depth = 0;
  size_t begin = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<' || s[i] == '(') ++depth;
    if (s[i] == '>' || s[i] == ')') --depth;
    if (depth == 0 && s[i] == ' ') begin = i + 1;
    if (depth == 0 && s[i] == ':' && i + 1 < s.size() && s[i + 1] == ':') begin = i + 2;
  }
  return s.substr(begin);
}

std::vector<TimelineGraph> summarize_timeline(const std::vector<KernelRun>& runs) {
  // graph -> node -> its runs, in start order.
  std::map<uint32_t, std::map<uint64_t, std::vector<const KernelRun*>>> graphs;
  for (const KernelRun& r : runs)
    if (r.graph != 0) graphs[r.graph][r.graph_node].push_back(&r);
  std::vector<TimelineGraph> out;
  for (auto& [graph, nodes] : graphs) {
    size_t runs_each = SIZE_MAX;
    for (auto& [node, rs] : nodes) {
      std::sort(rs.begin(), rs.end(), [](const KernelRun* a, const KernelRun* b) { return a->start < b->start; });
      runs_each = std::min(runs_each, rs.size());
    }
    if (runs_each < 3) continue;
    TimelineGraph g;
    g.graph = graph;
    g.replays = runs_each - 1;
    for (auto& [node, rs] : nodes) g.nodes.push_back({rs[0]->name, 0, 0, 0});
    const double share = 1.0 / double(g.replays);
    for (size_t i = 1; i < runs_each; ++i) {
      uint64_t t0 = UINT64_MAX, t1 = 0;
      for (auto& [node, rs] : nodes) {
        t0 = std::min(t0, rs[i]->start);
        t1 = std::max(t1, rs[i]->end);
      }
      g.span += double(t1 - t0) * share;
      size_t n = 0;
      for (auto& [node, rs] : nodes) {
        g.nodes[n].start += double(rs[i]->start - t0) * share;
        g.nodes[n].end += double(rs[i]->end - t0) * share;
        ++n;
      }
    }
    std::stable_sort(g.nodes.begin(), g.nodes.end(),
                     [](const TimelineNode& a, const TimelineNode& b) { return a.start < b.start; });
    double latest_end = 0;
    for (TimelineNode& m : g.nodes) {
      m.link = std::max(0.0, m.end - latest_end);
      latest_end = std::max(latest_end, m.end);
    }
    out.push_back(std::move(g));
  }
  return out;
}

std::string kernel_timeline_report(const std::vector<TimelineGraph>& graphs, int first_nodes) {
  if (graphs.empty()) return "no graph was replayed three times while the timeline recorded\n";
  std::string out;
  for (const TimelineGraph& g : graphs) {
    struct ByName {
      int count = 0;
      double link = 0, duration = 0;
    };
    std::map<std::string, ByName> by_name;
    for (const TimelineNode& m : g.nodes) {
      ByName& b = by_name[m.name];
      ++b.count;
      b.link += m.link;
      b.duration += m.end - m.start;
    }
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [name, b] : by_name)
      rows.push_back({b.link, fmt::format("  {:>9.1f} {:>7.1f}% {:>6} {:>9.2f} {:>13.2f}  {}\n", b.link / 1e3,
                                          100 * b.link / g.span, b.count, b.link / 1e3 / b.count,
                                          b.duration / 1e3 / b.count, name)});
    std::sort(rows.rbegin(), rows.rend());
    out += fmt::format("graph {}: {} kernels a replay, mean of {} replays, span {:.1f} us\n", g.graph, g.nodes.size(),
                       g.replays, g.span / 1e3);
    out += "    link us  of span  count link each duration each  kernel (summed by name)\n";
    for (const auto& r : rows) out += r.second;
    const size_t shown = std::min(g.nodes.size(), size_t(std::max(0, first_nodes)));
    out += fmt::format("  the first {} kernels in start order: start, end, link (us)\n", shown);
    for (size_t i = 0; i < shown; ++i) {
      const TimelineNode& m = g.nodes[i];
      out += fmt::format("  {:>9.2f} {:>9.2f} {:>8.2f}  {}\n", m.start / 1e3, m.end / 1e3, m.link / 1e3, m.name);
    }
  }
  return out;
}

}  // namespace tpmoe::cuda
