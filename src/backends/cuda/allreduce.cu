// Fused all-reduce + residual + RMSNorm kernels: one-shot and two-shot (see allreduce.cuh for the
// algorithms, the window layout and the bytes each moves).
//
// One CTA per row at a time (rows strided over the grid), H/8 threads rounded up to a warp (at most
// 1024), each thread owning up to kMaxChunks 16-byte chunks of the row in registers: the row is
// read from the peers once, normalised from registers, written once. The per-thread order of the
// sum of squares and the block reduction mirror norm.cu's add_rmsnorm, so N = 1 reproduces it.
//
// The peer policy decides where rank r's window is and what a barrier is:
//   NcclPeers:     ncclGetLsaPointer(window, 0, r); ncclLsaBarrierSession<ncclCoopCta> #blockIdx.x
//                  with acquire-release order (a rank's window writes before the barrier are seen by
//                  every peer after it; its reads of peers before it are done before peers rewrite).
//   EmulatedPeers: N windows on one GPU; no barrier (the host runs phases one launch at a time).
#include "backends/cuda/allreduce.cuh"

#include "backends/cuda/kernel_utils.cuh"

#include <nccl_device.h>

#include <algorithm>

#include "backends/cuda/cuda_check.h"

namespace tpmoe::cuda {

namespace {

constexpr int kMaxThreads = kMaxBlockThreads;
constexpr int kMaxChunks = kMaxFusedHidden / 8 / kMaxThreads;  // 16-byte chunks per thread (1, 2 or 4)

struct EmulatedPeers {
  char* base[kMaxRanks];
  __device__ char* peer(int r) const { return base[r]; }
  struct Barrier {
    __device__ explicit Barrier(const EmulatedPeers&) {}
    __device__ void sync() {}
  };
};

struct NcclPeers {
  ncclWindow_t window;
  ncclDevComm comm;
  __device__ char* peer(int r) const { return static_cast<char*>(ncclGetLsaPointer(window, 0, r)); }
  struct Barrier {
    ncclLsaBarrierSession<ncclCoopCta> session;
    __device__ explicit Barrier(const NcclPeers& p) : session(ncclCoopCta(), p.comm, ncclTeamTagLsa(), blockIdx.x) {}
    __device__ void sync() { session.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel); }
  };
};

__device__ __forceinline__ void add_bf16x8(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 t = __bfloat1622float2(h[j]);
    f[2 * j] += t.x;
    f[2 * j + 1] += t.y;
  }
}

__device__ __forceinline__ int64_t rows_begin(int q, const AllreduceNormParams& p) {
  return int64_t(q) * p.rows / p.nranks;
}

// Rank order sum of every rank's window partial, chunk c (8 elements) of `row`: ((p0 + p1) + p2)...
template <class Peers>
__device__ __forceinline__ void sum_partials(const Peers& peers, const AllreduceNormParams& p, int64_t row, int c,
                                             float (&s)[8]) {
  const int64_t chunk = row * (p.hidden / 8) + c;
  const uint4 first = reinterpret_cast<const uint4*>(peers.peer(0) + p.window.partial_offset)[chunk];
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&first);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 t = __bfloat1622float2(h[j]);
    s[2 * j] = t.x;
    s[2 * j + 1] = t.y;
  }
  for (int r = 1; r < p.nranks; ++r)
    add_bf16x8(reinterpret_cast<const uint4*>(peers.peer(r) + p.window.partial_offset)[chunk], s);
}

// The norm weights of a thread's chunks (c = threadIdx.x + k * blockDim.x: the same for every row).
// Loaded before the PDL wait where a thread has at most two chunks (hidden <= 16384 at 1024
// threads): weights are what no kernel of the step writes (kernel_utils.cuh), so their latency
// overlaps the kernel before instead of following the row's sum of squares. Wider rows load them
// where they multiply, as the row's values already take the registers (64 a thread at 1024).
template <int kChunks>
struct NormWeights {
  static constexpr bool kEarly = kChunks <= 2;
  float4 w[kEarly ? kChunks : 1][2];
  __device__ explicit NormWeights(const AllreduceNormParams& p) {
    if constexpr (kEarly) {
      const float4* w4 = reinterpret_cast<const float4*>(p.weight);
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < p.hidden / 8) {
          w[k][0] = __ldg(&w4[2 * c]);
          w[k][1] = __ldg(&w4[2 * c + 1]);
        }
      }
    }
  }
  // Chunk c, the thread's k-th.
  __device__ void get(const AllreduceNormParams& p, int k, int c, float4& w0, float4& w1) const {
    if constexpr (kEarly) {
      w0 = w[k][0];
      w1 = w[k][1];
    } else {
      const float4* w4 = reinterpret_cast<const float4*>(p.weight);
      w0 = __ldg(&w4[2 * c]);
      w1 = __ldg(&w4[2 * c + 1]);
    }
  }
};

// Normalises one row whose new residual chunks `load(c, v)` produces (fp32, 8 at a time); writes the
// residual and y of this rank and, when `publish` is set, the residual into this rank's window too.
template <int kChunks, class Load>
__device__ __forceinline__ void norm_row(const AllreduceNormParams& p, const NormWeights<kChunks>& weights, int64_t row,
                                         Load load, float* publish) {
  const int H = p.hidden, nvec = H / 8;
  float v[kChunks][8];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c < nvec) {
      load(c, v[k]);
      ss += v[k][0] * v[k][0] + v[k][1] * v[k][1] + v[k][2] * v[k][2] + v[k][3] * v[k][3];
      ss += v[k][4] * v[k][4] + v[k][5] * v[k][5] + v[k][6] * v[k][6] + v[k][7] * v[k][7];
    }
  }
  ss = block_sum(ss);
  const float inv = 1.f / sqrtf(ss / float(H) + p.eps);
  float4* res4 = reinterpret_cast<float4*>(p.residual + row * H);
  float4* pub4 = publish ? reinterpret_cast<float4*>(publish + row * H) : nullptr;
  uint4* out = reinterpret_cast<uint4*>(p.out + row * H);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c < nvec) {
      const float4 r0{v[k][0], v[k][1], v[k][2], v[k][3]}, r1{v[k][4], v[k][5], v[k][6], v[k][7]};
      res4[2 * c] = r0;
      res4[2 * c + 1] = r1;
      if (pub4) {
        pub4[2 * c] = r0;
        pub4[2 * c + 1] = r1;
      }
      float4 w0, w1;
      weights.get(p, k, c, w0, w1);
      const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
      float y[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = v[k][j] * inv * (1.f + w[j]);
      out[c] = pack_bf16x8(y);
    }
  }
}

// residual chunk + rank-order sum of the partials.
template <class Peers>
struct LoadSum {
  const Peers& peers;
  const AllreduceNormParams& p;
  int64_t row;
  __device__ void operator()(int c, float (&v)[8]) const {
    float s[8];
    sum_partials(peers, p, row, c, s);
    const float4* res4 = reinterpret_cast<const float4*>(p.residual + row * p.hidden);
    const float4 r0 = res4[2 * c], r1 = res4[2 * c + 1];
    v[0] = r0.x + s[0], v[1] = r0.y + s[1], v[2] = r0.z + s[2], v[3] = r0.w + s[3];
    v[4] = r1.x + s[4], v[5] = r1.y + s[5], v[6] = r1.z + s[6], v[7] = r1.w + s[7];
  }
};

// Copies this rank's partial row into its window (where peers read it).
template <class Peers>
__device__ __forceinline__ void publish_partial(const Peers& peers, const AllreduceNormParams& p, int64_t row) {
  const int nvec = p.hidden / 8;
  const uint4* src = reinterpret_cast<const uint4*>(p.partial) + row * nvec;
  uint4* dst = reinterpret_cast<uint4*>(peers.peer(p.rank) + p.window.partial_offset) + row * nvec;
  for (int c = threadIdx.x; c < nvec; c += blockDim.x) dst[c] = src[c];
}

template <int kChunks, class Peers>
__global__ void __launch_bounds__(kMaxThreads) oneshot_kernel(AllreduceNormParams p, Peers peers, int phases) {
  const NormWeights<kChunks> weights(p);  // before the wait (see NormWeights)
  pdl_wait();
  pdl_trigger();
  typename Peers::Barrier barrier(peers);
  if (phases & kPhaseCopy) {
    for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) publish_partial(peers, p, row);
    barrier.sync();  // after this: every rank's rows of this CTA are in its window
  }
  if (phases & kPhaseReduce) {
    for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x)
      norm_row<kChunks>(p, weights, row, LoadSum<Peers>{peers, p, row}, nullptr);
    barrier.sync();  // completion: no peer reads this rank's window any more
  }
}

template <int kChunks, class Peers>
__global__ void __launch_bounds__(kMaxThreads) twoshot_kernel(AllreduceNormParams p, Peers peers, int phases) {
  const NormWeights<kChunks> weights(p);  // before the wait (see NormWeights)
  pdl_wait();
  pdl_trigger();
  typename Peers::Barrier barrier(peers);
  // CTA b handles local row j of every owner's range where j % gridDim.x == b, in every phase.
  if (phases & kPhaseCopy) {
    for (int q = 0; q < p.nranks; ++q) {
      const int64_t begin = rows_begin(q, p), count = rows_begin(q + 1, p) - begin;
      for (int64_t j = blockIdx.x; j < count; j += gridDim.x) publish_partial(peers, p, begin + j);
    }
    barrier.sync();  // after this: every rank's partial rows of this CTA are in its window
  }
  if (phases & kPhaseReduce) {
    const int64_t begin = rows_begin(p.rank, p), count = rows_begin(p.rank + 1, p) - begin;
    float* publish = reinterpret_cast<float*>(peers.peer(p.rank) + p.window.residual_offset);
    for (int64_t j = blockIdx.x; j < count; j += gridDim.x)
      norm_row<kChunks>(p, weights, begin + j, LoadSum<Peers>{peers, p, begin + j}, publish);
    barrier.sync();  // after this: every owner's new residual rows of this CTA are in its window
  }
  if (phases & kPhaseGather) {
    for (int q = 0; q < p.nranks; ++q) {
      if (q == p.rank) continue;
      const int64_t begin = rows_begin(q, p), count = rows_begin(q + 1, p) - begin;
      const float* owner = reinterpret_cast<const float*>(peers.peer(q) + p.window.residual_offset);
      for (int64_t j = blockIdx.x; j < count; j += gridDim.x) {
        const float4* src = reinterpret_cast<const float4*>(owner + (begin + j) * p.hidden);
        norm_row<kChunks>(
            p, weights, begin + j,
            [&](int c, float(&v)[8]) {
              const float4 r0 = src[2 * c], r1 = src[2 * c + 1];
              v[0] = r0.x, v[1] = r0.y, v[2] = r0.z, v[3] = r0.w, v[4] = r1.x, v[5] = r1.y, v[6] = r1.z, v[7] = r1.w;
            },
            nullptr);
      }
    }
    barrier.sync();  // completion: no peer reads this rank's window any more
  }
}

// ---- push (see allreduce.cuh) -------------------------------------------------------------------

constexpr uint32_t kEmptyHalf = 0x8000u;  // bf16 -0.0: a mailbox element not yet written

__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void store_volatile(uint4* p, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ bool word_has_empty(uint32_t w) {
  return (w & 0xffffu) == kEmptyHalf || (w >> 16) == kEmptyHalf;
}
__device__ __forceinline__ bool has_empty(const uint4& v) {
  return word_has_empty(v.x) || word_has_empty(v.y) || word_has_empty(v.z) || word_has_empty(v.w);
}
// -0.0 -> +0.0 in each half: a sent element can never look empty.
__device__ __forceinline__ uint32_t word_no_neg_zero(uint32_t w) {
  if ((w & 0xffffu) == kEmptyHalf) w &= 0xffff0000u;
  if ((w >> 16) == kEmptyHalf) w &= 0x0000ffffu;
  return w;
}

// Chunk c (16 bytes) of `row` in the mailbox slot [buffer][source] of the window at `base`.
__device__ __forceinline__ uint4* mailbox_chunk(char* base, const AllreduceNormParams& p, int buffer, int source,
                                                int64_t row, int c) {
  const int64_t slot = (int64_t(buffer) * kMaxRanks + source) * p.window.push_rows + row;
  return reinterpret_cast<uint4*>(base + p.window.mailbox_offset) + slot * (p.hidden / 8) + c;
}

// residual chunk + rank-order sum of the mailbox rows, waiting for each to arrive and emptying it
// after reading: the same arithmetic as LoadSum, so the result equals the one-shot's bit for bit.
template <class Peers>
struct LoadMailbox {
  const Peers& peers;
  const AllreduceNormParams& p;
  int64_t row;
  int buffer;
  __device__ void operator()(int c, float (&v)[8]) const {
    char* mine = peers.peer(p.rank);
    // The residual first: its load is in flight while the peers' rows are awaited.
    const float4* res4 = reinterpret_cast<const float4*>(p.residual + row * p.hidden);
    const float4 r0 = res4[2 * c], r1 = res4[2 * c + 1];
    float s[8];
    for (int r = 0; r < p.nranks; ++r) {
      uint4* slot = mailbox_chunk(mine, p, buffer, r, row, c);
      uint4 x = load_volatile(slot);
      while (has_empty(x)) x = load_volatile(slot);
      store_volatile(slot, make_uint4(kEmptyHalf | (kEmptyHalf << 16), kEmptyHalf | (kEmptyHalf << 16),
                                      kEmptyHalf | (kEmptyHalf << 16), kEmptyHalf | (kEmptyHalf << 16)));
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 t = __bfloat1622float2(h[j]);
        if (r == 0) {
          s[2 * j] = t.x;
          s[2 * j + 1] = t.y;
        } else {
          s[2 * j] += t.x;
          s[2 * j + 1] += t.y;
        }
      }
    }
    v[0] = r0.x + s[0], v[1] = r0.y + s[1], v[2] = r0.z + s[2], v[3] = r0.w + s[3];
    v[4] = r1.x + s[4], v[5] = r1.y + s[5], v[6] = r1.z + s[6], v[7] = r1.w + s[7];
  }
};

template <int kChunks, class Peers>
__global__ void __launch_bounds__(kMaxThreads) push_kernel(AllreduceNormParams p, Peers peers, int phases) {
  const NormWeights<kChunks> weights(p);  // before the wait (see NormWeights)
  pdl_wait();
  pdl_trigger();
  uint32_t* control = reinterpret_cast<uint32_t*>(peers.peer(p.rank) + p.window.control_offset);
  // Every CTA reads the call counter before it arrives below; only the last to arrive advances it.
  const int buffer = int(*reinterpret_cast<volatile uint32_t*>(control) & 1u);
  const int nvec = p.hidden / 8;
  if (phases & kPhaseCopy) {
    for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
      const uint4* src = reinterpret_cast<const uint4*>(p.partial) + row * nvec;
      for (int c = threadIdx.x; c < nvec; c += blockDim.x) {
        uint4 v = src[c];
        v = make_uint4(word_no_neg_zero(v.x), word_no_neg_zero(v.y), word_no_neg_zero(v.z), word_no_neg_zero(v.w));
        for (int q = 0; q < p.nranks; ++q) store_volatile(mailbox_chunk(peers.peer(q), p, buffer, p.rank, row, c), v);
      }
    }
  }
  if (phases & kPhaseReduce) {
    for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x)
      norm_row<kChunks>(p, weights, row, LoadMailbox<Peers>{peers, p, row, buffer}, nullptr);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(control + 1, 1u) == gridDim.x - 1) {  // the launch's last CTA: next call, next buffer
        control[1] = 0;
        __threadfence();
        atomicAdd(control, 1u);
      }
    }
  }
}

__global__ void window_init_kernel(char* window, WindowLayout layout) {
  const size_t words = (layout.control_offset - layout.mailbox_offset) / 4;
  uint32_t* mailbox = reinterpret_cast<uint32_t*>(window + layout.mailbox_offset);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x)
    mailbox[i] = kEmptyHalf | (kEmptyHalf << 16);
  if (blockIdx.x == 0 && threadIdx.x < 64) reinterpret_cast<uint32_t*>(window + layout.control_offset)[threadIdx.x] = 0;
}

// Depends only on (algo, rows, nranks): the same grid on every rank.
int grid_size(AllreduceAlgo algo, int rows, int nranks) {
  const int rows_per_cta = algo == AllreduceAlgo::kTwoShot ? (rows + nranks - 1) / nranks : rows;
  return std::max(1, std::min(rows_per_cta, kMaxAllreduceBlocks));
}

int block_size(int hidden) {
  const int threads = (hidden / 8 + kWarp - 1) / kWarp * kWarp;
  return std::min(threads, kMaxThreads);
}

template <int kChunks, class Peers>
void launch_chunks(const AllreduceNormParams& p, AllreduceAlgo algo, int phases, const Peers& peers, int grid,
                   int threads, KernelStream on) {
  // With PDL, as the kernels around it (kernel_utils.cuh): each waits before it reads the partial or
  // touches its window, so only its launch overlaps its predecessor; its successor may launch once
  // every CTA of it is running, so waiting successors never hold SMs it needs for its barriers.
  const dim3 g{unsigned(grid)}, b{unsigned(threads)};
  if (algo == AllreduceAlgo::kOneShot)
    launch_pdl(oneshot_kernel<kChunks, Peers>, g, b, 0, on, p, peers, phases);
  else if (algo == AllreduceAlgo::kTwoShot)
    launch_pdl(twoshot_kernel<kChunks, Peers>, g, b, 0, on, p, peers, phases);
  else
    launch_pdl(push_kernel<kChunks, Peers>, g, b, 0, on, p, peers, phases);
}

template <class Peers>
void launch(const AllreduceNormParams& p, AllreduceAlgo algo, int phases, const Peers& peers, KernelStream on) {
  check_arg(allreduce_fused_supported(p), "allreduce_add_rmsnorm: sizes or pointers the fused kernels do not take");
  check_arg(algo != AllreduceAlgo::kPush || allreduce_push_supported(p),
            "allreduce_add_rmsnorm: more rows than the push mailbox holds");
  const int grid = grid_size(algo, p.rows, p.nranks), threads = block_size(p.hidden);
  const int chunks = (p.hidden / 8 + threads - 1) / threads;
  switch (chunks) {
    case 1: launch_chunks<1>(p, algo, phases, peers, grid, threads, on); break;
    case 2: launch_chunks<2>(p, algo, phases, peers, grid, threads, on); break;
    case 3:
    case 4: launch_chunks<kMaxChunks>(p, algo, phases, peers, grid, threads, on); break;
    default: check_arg(false, "allreduce_add_rmsnorm: hidden size above kMaxFusedHidden");
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool allreduce_fused_supported(const AllreduceNormParams& p) {
  return p.hidden > 0 && p.hidden % 8 == 0 && p.hidden <= kMaxFusedHidden && p.rows >= 0 &&
         p.rows <= p.window.max_rows && p.hidden == p.window.hidden && p.nranks >= 1 && p.nranks <= kMaxRanks &&
         p.rank >= 0 && p.rank < p.nranks && p.partial && p.residual && p.weight && p.out && aligned16(p.partial) &&
         aligned16(p.residual) && aligned16(p.weight) && aligned16(p.out);
}

bool allreduce_push_supported(const AllreduceNormParams& p) {
  return allreduce_fused_supported(p) && p.rows <= p.window.push_rows;
}

void launch_allreduce_window_init(void* window, const WindowLayout& layout, cudaStream_t stream) {
  check_arg(window != nullptr && aligned16(window), "allreduce window init: a 16-byte aligned window");
  window_init_kernel<<<256, 256, 0, stream>>>(static_cast<char*>(window), layout);
  CUDA_CHECK_LAUNCH();
}

void launch_allreduce_norm_emulated(const AllreduceNormParams& p, AllreduceAlgo algo, int phases, void* const* windows,
                                    KernelStream on) {
  if (p.rows == 0) return;
  EmulatedPeers peers{};
  for (int r = 0; r < p.nranks && r < kMaxRanks; ++r) peers.base[r] = static_cast<char*>(windows[r]);
  launch(p, algo, phases, peers, on);
}

void launch_allreduce_norm_nccl(const AllreduceNormParams& p, AllreduceAlgo algo, ncclWindow_t window,
                                const ncclDevComm& dev_comm, KernelStream on) {
  // rows == 0 on every rank alike (the same step): nobody enters a barrier.
  if (p.rows == 0) return;
  launch(p, algo, kPhasesAll, NcclPeers{window, dev_comm}, on);
}

}  // namespace tpmoe::cuda
