// What one link of a decode step's chain of kernels costs, against one phase of a persistent kernel.
//
// A decode step at batch 1 is a chain of dependent kernels, ~10 a layer, each waiting for the one
// before it (docs/PERF.md: "a step's fixed cost is its chain"). A persistent kernel would replace
// each kernel boundary with a grid barrier inside one launch. This measures both on the same GPU,
// with the same work per link, so the choice between them rests on numbers:
//   chain       a recorded CUDA graph of N kernels of G blocks, launched with PDL as the engine's are
//               (kernel_utils.cuh's launch_pdl): every block waits for its predecessor (pdl_wait),
//               reads the word the predecessor wrote and its share of the link's bytes, block 0
//               writes the next word, then the block triggers its successor;
//   chain -pdl  the same graph without the PDL attribute;
//   persistent  one cooperative kernel of the same G blocks and N phases, each ending in a grid
//               barrier (an arrival count in global memory, release/acquire).
// `--chase R` adds R dependent loads a link (each at the address the last returned, from L2), done
// by each block's first thread: the cost of one step of a kernel's own dependent chain.
// Each link or phase reads `--bytes` fresh bytes (distinct every link, like a GEMV's weights; 0: the
// dependency alone), split evenly over the blocks with 16-byte loads. Those loads are not tuned for
// bandwidth (128 threads a block, no unrolling): with bytes, the rows compare the two handovers
// under the same work, not the memory. The time per link is the median replay over N; the word
// chain is checked at the end (a wrong count is an error).
//
//   bench_cuda_chain [--links N] [--bytes B] [--chase R] [--blocks G,G,...]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_utils.cuh"
#include "bench_args.h"

namespace tpmoe::cuda {
namespace {

using bench::parse_count;
using bench::require;

constexpr int kThreads = 128;
constexpr size_t kBufferBytes = size_t(1) << 30;  // the links' bytes come from here, wrapping around

struct LinkArgs {
  const uint4* data = nullptr;      // kBufferBytes
  size_t words_per_link = 0;        // 16-byte words each link reads, over all blocks
  unsigned* words = nullptr;        // the chain: link i reads words[i], block 0 writes words[i + 1]
  unsigned* sink = nullptr;         // written only when the loads fold to an unlikely value: keeps them
  const unsigned* cycle = nullptr;  // kCycleLength indices forming one cycle (--chase)
  int chase = 0;                    // dependent loads a link, one after another, by each block's first thread
};

constexpr unsigned kCycleLength = 4096;  // 16 KiB: in L2 after the first link

// `a.chase` loads, each at the index the one before returned (ld.global.cg: from L2, not L1): what a
// kernel's chain of dependent memory accesses costs, one access at a time.
__device__ unsigned chase(const LinkArgs& a, int link) {
  unsigned i = unsigned(link) % kCycleLength;
  if (threadIdx.x == 0)
    for (int k = 0; k < a.chase; ++k) i = __ldcg(a.cycle + i);
  return i;
}

// Block b's share of link i's bytes, folded into one word.
__device__ unsigned read_share(const LinkArgs& a, int link) {
  const size_t total_words = kBufferBytes / 16;
  const size_t first = (size_t(link) * a.words_per_link) % (total_words - a.words_per_link + 1);
  unsigned acc = 0;
  for (size_t w = size_t(blockIdx.x) * kThreads + threadIdx.x; w < a.words_per_link;
       w += size_t(gridDim.x) * kThreads) {
    const uint4 v = __ldcg(a.data + first + w);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

__global__ void __launch_bounds__(kThreads) link_kernel(LinkArgs a, int link) {
  pdl_wait();
  const unsigned prev = *reinterpret_cast<volatile unsigned*>(a.words + link);
  const unsigned acc = read_share(a, link) ^ chase(a, link);
  if (acc == 0x9e3779b9u) atomicXor(a.sink, acc);
  if (blockIdx.x == 0 && threadIdx.x == 0) a.words[link + 1] = prev + 1;
  pdl_trigger();
}

// A grid barrier: each block adds one to a count that only grows (zeroed before the launch) and
// waits until it reaches the blocks of every phase so far. One atomic a block (gpu scope, release)
// and a spin (acquire), so every write before the barrier is visible to every block after it: the
// leanest software grid barrier we know (no reset, no generation word).
__device__ void grid_barrier(unsigned* count, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
    unsigned now = 0;
    do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(count) : "memory");
    while (now < target);
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) persistent_kernel(LinkArgs a, int links, unsigned* count) {
  for (int link = 0; link < links; ++link) {
    const unsigned prev = *reinterpret_cast<volatile unsigned*>(a.words + link);
    const unsigned acc = read_share(a, link) ^ chase(a, link);
    if (acc == 0x9e3779b9u) atomicXor(a.sink, acc);
    if (blockIdx.x == 0 && threadIdx.x == 0) a.words[link + 1] = prev + 1;
    grid_barrier(count, unsigned(link + 1) * gridDim.x);
  }
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median time of `reps` runs of `run` (after one warm-up), in milliseconds.
template <class Run>
float time_ms(cudaStream_t s, int reps, Run run) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  run();
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaEventRecord(start, s));
    run();
    CUDA_CHECK(cudaEventRecord(stop, s));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(ms);
}

void check_chain(const unsigned* words, int links, const char* what, int blocks) {
  unsigned last = 0;
  CUDA_CHECK(cudaMemcpy(&last, words + links, sizeof(unsigned), cudaMemcpyDeviceToHost));
  require(last == unsigned(links), std::string(what) + " with " + std::to_string(blocks) +
                                       " blocks: the chain counted " + std::to_string(last) + " of " +
                                       std::to_string(links) + " links");
}

struct Row {
  int blocks;
  float chain_us, chain_nopdl_us, persistent_us;
};

Row measure(const LinkArgs& a, int links, int blocks, cudaStream_t s) {
  Row row{blocks, 0, 0, 0};
  for (const bool pdl : {true, false}) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < links; ++i)
      launch_pdl(link_kernel, dim3(blocks), dim3(kThreads), 0, KernelStream(s, pdl), a, i);
    CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const float ms = time_ms(s, 20, [&] {
      CUDA_CHECK(cudaMemsetAsync(a.words, 0, sizeof(unsigned), s));
      CUDA_CHECK(cudaGraphLaunch(exec, s));
    });
    CUDA_CHECK(cudaStreamSynchronize(s));
    check_chain(a.words, links, pdl ? "chain" : "chain -pdl", blocks);
    (pdl ? row.chain_us : row.chain_nopdl_us) = 1e3f * ms / float(links);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  unsigned* count = nullptr;  // grid_barrier's
  CUDA_CHECK(cudaMalloc(&count, sizeof(unsigned)));
  int links_arg = links;
  LinkArgs args = a;
  void* params[] = {&args, &links_arg, &count};
  const float ms = time_ms(s, 20, [&] {
    CUDA_CHECK(cudaMemsetAsync(a.words, 0, sizeof(unsigned), s));
    CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned), s));
    CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persistent_kernel), dim3(blocks), dim3(kThreads),
                                           params, 0, s));
  });
  CUDA_CHECK(cudaStreamSynchronize(s));
  check_chain(a.words, links, "persistent", blocks);
  row.persistent_us = 1e3f * ms / float(links);
  cudaFree(count);
  return row;
}

int run(int argc, char** argv) {
  int links = 200, chase_loads = 0;
  size_t bytes = 0;
  std::vector<int> blocks;  // default: 1 to 4 an SM, below
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    require(i + 1 < argc, arg + " needs a value");
    if (arg == "--links")
      links = int(std::min(parse_count(arg, argv[++i]), 1000000LL));
    else if (arg == "--bytes")
      bytes = size_t(parse_count(arg, argv[++i]));
    else if (arg == "--blocks")
      blocks = bench::parse_list(arg, argv[++i], 1000000);
    else if (arg == "--chase")
      chase_loads = int(std::min(parse_count(arg, argv[++i]), 1000000LL));
    else
      require(false, "unknown argument '" + arg +
                         "' (bench_cuda_chain [--links N] [--bytes B] [--chase R] [--blocks G,G,...])");
  }
  require(links > 0 && links <= 100000, "--links must be 1..100000, not " + std::to_string(links));
  require(chase_loads >= 0 && chase_loads <= 10000, "--chase must be 0..10000, not " + std::to_string(chase_loads));
  require(bytes % 16 == 0 && bytes <= kBufferBytes / 2,
          "--bytes must be a multiple of 16 up to " + std::to_string(kBufferBytes / 2));
  const int sms = sm_count();
  if (blocks.empty()) blocks = {1, 4, 16, sms / 2, sms, 2 * sms, 4 * sms};
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel, kThreads, 0));

  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  LinkArgs a;
  void* data = nullptr;
  CUDA_CHECK(cudaMalloc(&data, kBufferBytes));
  CUDA_CHECK(cudaMemset(data, 0x5A, kBufferBytes));
  a.data = static_cast<const uint4*>(data);
  a.words_per_link = bytes / 16;
  CUDA_CHECK(cudaMalloc(&a.words, sizeof(unsigned) * size_t(links + 1)));
  CUDA_CHECK(cudaMalloc(&a.sink, sizeof(unsigned)));
  // One cycle through every index (a stride coprime with the length), so no load can be guessed.
  std::vector<unsigned> cycle(kCycleLength);
  for (unsigned i = 0; i < kCycleLength; ++i) cycle[i] = (i + 1237u) % kCycleLength;
  unsigned* cycle_device = nullptr;
  CUDA_CHECK(cudaMalloc(&cycle_device, sizeof(unsigned) * kCycleLength));
  CUDA_CHECK(cudaMemcpy(cycle_device, cycle.data(), sizeof(unsigned) * kCycleLength, cudaMemcpyHostToDevice));
  a.cycle = cycle_device;
  a.chase = chase_loads;

  cudaDeviceProp prop;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("%s, %d SMs; %d links, %zu bytes read a link, %d dependent loads a link, %d threads a block\n", prop.name,
              sms, links, bytes, chase_loads, kThreads);
  std::printf("%8s %14s %18s %18s\n", "blocks", "chain us/link", "chain -pdl us/link", "persistent us/phase");
  for (int g : blocks) {
    if (g > per_sm * sms) {
      std::printf("%8d   (more blocks than can be resident together: %d an SM)\n", g, per_sm);
      continue;
    }
    const Row r = measure(a, links, g, s);
    std::printf("%8d %14.2f %18.2f %18.2f\n", r.blocks, r.chain_us, r.chain_nopdl_us, r.persistent_us);
  }
  cudaFree(data);
  cudaFree(a.words);
  cudaFree(a.sink);
  cudaFree(cycle_device);
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace
}  // namespace tpmoe::cuda

int main(int argc, char** argv) { return tpmoe::bench::guarded_main("bench_cuda_chain", tpmoe::cuda::run, argc, argv); }
