// The kernel timeline's arithmetic (kernel_timeline.h) on made-up kernel records: which replays
// count, what a link is, how names are shortened. Part of the CUDA build, but no GPU is needed.
#include <gtest/gtest.h>

#include "backends/cuda/kernel_timeline.h"

namespace tpmoe::cuda {
namespace {

// Replay r of a graph whose kernels run at the given (start, end) offsets from `t0`, in ns.
void add_replay(std::vector<KernelRun>& runs, uint32_t graph, uint64_t t0,
                const std::vector<std::pair<uint64_t, uint64_t>>& kernels) {
  for (size_t n = 0; n < kernels.size(); ++n)
    runs.push_back({"k" + std::to_string(n), t0 + kernels[n].first, t0 + kernels[n].second, graph, 100 + n});
}

TEST(KernelTimeline, TheFirstReplayIsLeftOutAndTheRestAveraged) {
  std::vector<KernelRun> runs;
  add_replay(runs, 7, 0, {{0, 50000}, {50000, 90000}});  // the first: slow, left out
  add_replay(runs, 7, 1000000, {{0, 1000}, {1000, 3000}});
  add_replay(runs, 7, 2000000, {{0, 3000}, {3000, 5000}});
  runs.push_back({"eager", 5, 10, 0, 0});  // launched outside a graph: not in the summary
  const std::vector<TimelineGraph> g = summarize_timeline(runs);
  ASSERT_EQ(g.size(), 1u);
  EXPECT_EQ(g[0].graph, 7u);
  EXPECT_EQ(g[0].replays, 2u);
  EXPECT_DOUBLE_EQ(g[0].span, 4000.0);
  ASSERT_EQ(g[0].nodes.size(), 2u);
  EXPECT_EQ(g[0].nodes[0].name, "k0");
  EXPECT_DOUBLE_EQ(g[0].nodes[0].end, 2000.0);
  EXPECT_DOUBLE_EQ(g[0].nodes[0].link, 2000.0);
  EXPECT_DOUBLE_EQ(g[0].nodes[1].start, 2000.0);
  EXPECT_DOUBLE_EQ(g[0].nodes[1].link, 2000.0);
}

TEST(KernelTimeline, LinksAddUpToTheSpanWithOverlapAndABranch) {
  // k1 starts before k0 ends (PDL) and ends later; k2, a branch, ends inside k1: no link of its own.
  std::vector<KernelRun> runs;
  for (int r = 0; r < 3; ++r) add_replay(runs, 3, uint64_t(r) * 100000, {{0, 1000}, {800, 2500}, {900, 1200}});
  const std::vector<TimelineGraph> g = summarize_timeline(runs);
  ASSERT_EQ(g.size(), 1u);
  ASSERT_EQ(g[0].nodes.size(), 3u);
  EXPECT_EQ(g[0].nodes[1].name, "k1");
  EXPECT_DOUBLE_EQ(g[0].nodes[1].link, 1500.0);
  EXPECT_EQ(g[0].nodes[2].name, "k2");
  EXPECT_DOUBLE_EQ(g[0].nodes[2].link, 0.0);
  double links = 0;
  for (const TimelineNode& n : g[0].nodes) links += n.link;
  EXPECT_DOUBLE_EQ(links, g[0].span);
  const std::string report = kernel_timeline_report(g);
  EXPECT_NE(report.find("3 kernels a replay, mean of 2 replays, span 2.5 us"), std::string::npos) << report;
}

TEST(KernelTimeline, AGraphReplayedTwiceIsNotSummarized) {
  std::vector<KernelRun> runs;
  add_replay(runs, 1, 0, {{0, 10}});
  add_replay(runs, 1, 100, {{0, 10}});
  EXPECT_TRUE(summarize_timeline(runs).empty());
  EXPECT_NE(kernel_timeline_report({}).find("no graph was replayed three times"), std::string::npos);
}

TEST(KernelTimeline, NamesLoseNamespacesReturnTypeAndParameters) {
  EXPECT_EQ(short_kernel_name("_ZN5tpmoe4cuda12_GLOBAL__N_111gemv_kernelILi1ELb0EEEvNS0_9GemvBatchE"),
            "gemv_kernel<1, false>");
  EXPECT_EQ(short_kernel_name("_ZN5tpmoe4cuda12_GLOBAL__N_118l2_prefetch_kernelENS0_16L2PrefetchRangesE"),
            "l2_prefetch_kernel");
  // Parameters of a type in an anonymous namespace, and of a function pointer type.
  EXPECT_EQ(short_kernel_name("_ZN5tpmoe4cuda12_GLOBAL__N_116attention_kernelENS1_6ParamsE"), "attention_kernel");
  EXPECT_EQ(short_kernel_name("_ZN5tpmoe4cuda12apply_kernelILi4EEEvPFviENS0_12_GLOBAL__N_16ParamsE"),
            "apply_kernel<4>");
  EXPECT_EQ(short_kernel_name("not_mangled"), "not_mangled");
}

}  // namespace
}  // namespace tpmoe::cuda
