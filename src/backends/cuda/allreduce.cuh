// Fused all-reduce + residual add + Gemma RMSNorm across tensor-parallel ranks (SPEC §4), on
// symmetric memory: every rank's window is load/store accessible to every peer (NVLink P2P).
//
//   residual[T,H] (fp32, identical on every rank) += sum over ranks, in rank order, of partial[T,H]
//   (bf16, one per rank); y[T,H] (bf16) = residual / sqrt(mean(residual^2) + eps) * (1 + w).
//
// The arithmetic core is driven either by real peers (NCCL's LSA pointers and LSA barrier: see
// nccl_comm.cpp) or by N windows on one GPU with no barrier (the emulated ranks of the tests, which
// launch each phase of every rank in turn). Both run the same kernels.
//
// Window layout of one rank (WindowLayout): [partial bf16 rows x H][residual fp32 rows x H].
//
// one-shot (small T): phase copy: this rank's partial rows -> its window; barrier; phase reduce:
//   every rank reads all peers' rows, sums in rank order, adds, normalises, writes residual and y;
//   barrier (completion: no rank rewrites its window while a peer may still read it).
//   Peer bytes read per rank: N*T*H*2.
// two-shot (larger T): rows are split in N contiguous ranges; phase copy; barrier; phase reduce:
//   the owner of a row sums it, adds the residual and publishes the new residual row (fp32) in its
//   window; barrier; phase gather: every rank copies every other owner's residual rows and
//   normalises all rows itself (the same code on the same fp32 values: bitwise the same y on every
//   rank); barrier. Peer bytes read per rank: T*H*2 + (N-1)/N*T*H*4.
//
// push (the smallest T, latency-bound): no barrier at all. Every rank stores its partial rows
//   straight into a mailbox in every peer's window (slot [buffer][source rank][row]); the data carry
//   their own arrival flag: a mailbox slot holds -0.0 (bf16 0x8000) in every element until written,
//   and a sender turns its own -0.0 into +0.0 (the sums do not change; only a sum of nothing but
//   -0.0 would have had its sign). Each rank spins on its own mailbox until every source's row has
//   arrived, sums in rank order, resets the slots it read to -0.0, and normalises. Two buffers,
//   alternating per call (a counter in the window, advanced by the launch's last CTA), make an exit
//   barrier unnecessary: a peer can run at most one call ahead (it needs this rank's rows for each
//   call), so it writes the other buffer while this rank still reads; and it writes this buffer
//   again only after this rank's next push, which follows the reset. Peer bytes written per rank:
//   N*T*H*2; at most kPushMaxRows rows. (The design of the fastest published one-shot kernels.)
//
// Invariants against the failure modes SPEC §4 names: the grid depends only on (T, N), so it is the
// same on every rank (CTA b of one rank meets CTA b of every peer at each barrier, and only ever
// exchanges rows assigned to CTA b); the last barrier comes after the last read of a peer window.
// The math is fp32 and mirrors launch_add_rmsnorm's per-thread order, so at N = 1 the fused kernels
// give bitwise its result. Needs H % 8 == 0, H <= kMaxFusedHidden and 16-byte aligned pointers;
// the communicator falls back to ncclAllReduce + launch_add_rmsnorm otherwise.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>

#include "backends/cuda/kernel_stream.h"

struct ncclDevComm;

namespace tpmoe::cuda {

constexpr int kMaxRanks = 8;
constexpr int kMaxAllreduceBlocks = 128;  // LSA barriers the device communicator reserves, one per CTA
constexpr int kMaxFusedHidden = 32768;    // 1024 threads x 4 chunks of 8 elements
constexpr int kPushMaxRows = 64;          // rows of the push mailbox (the decode batches it serves)

enum class AllreduceAlgo { kOneShot, kTwoShot, kPush };

// Phases of the fused kernels; the real communicator runs them all in one launch with barriers
// between, the emulated ranks one phase at a time.
enum AllreducePhase : int { kPhaseCopy = 1, kPhaseReduce = 2, kPhaseGather = 4, kPhasesAll = 7 };

// [partial bf16 max_rows x H][residual fp32 max_rows x H][mailbox bf16 2 x kMaxRanks x push_rows x H]
// [control: the push call counter and the launch's CTA arrival count].
struct WindowLayout {
  size_t partial_offset = 0, residual_offset = 0, mailbox_offset = 0, control_offset = 0, bytes = 0;
  int max_rows = 0, hidden = 0, push_rows = 0;
  static WindowLayout make(int max_rows, int hidden) {
    auto round = [](size_t b) { return (b + 255) / 256 * 256; };
    WindowLayout w;
    w.max_rows = max_rows;
    w.hidden = hidden;
    w.push_rows = max_rows < kPushMaxRows ? max_rows : kPushMaxRows;
    const size_t n = size_t(max_rows) * size_t(hidden);
    w.partial_offset = 0;
    w.residual_offset = round(n * 2);
    w.mailbox_offset = w.residual_offset + round(n * 4);
    w.control_offset = w.mailbox_offset + round(size_t(2) * kMaxRanks * size_t(w.push_rows) * size_t(hidden) * 2);
    w.bytes = w.control_offset + 256;
    return w;
  }
};

struct AllreduceNormParams {
  const __nv_bfloat16* partial = nullptr;  // [rows, hidden] this rank's partial sum
  float* residual = nullptr;               // [rows, hidden] in/out, the same on every rank
  const float* weight = nullptr;           // [hidden]
  __nv_bfloat16* out = nullptr;            // [rows, hidden]
  int rows = 0, hidden = 0;
  float eps = 1e-6f;
  int rank = 0, nranks = 1;
  WindowLayout window;
};

// Whether the fused kernels take these sizes and pointers (else use NCCL + launch_add_rmsnorm);
// the push algorithm also needs rows <= window.push_rows.
bool allreduce_fused_supported(const AllreduceNormParams& p);
bool allreduce_push_supported(const AllreduceNormParams& p);

// Makes a window's push mailbox empty (every element -0.0) and its counters zero. Every rank does
// it once, before any peer can push (the communicator follows it with a collective).
void launch_allreduce_window_init(void* window, const WindowLayout& layout, cudaStream_t stream);

// N ranks emulated on the current GPU: `windows[r]` is rank r's window (WindowLayout bytes). Runs
// the given phases of rank p.rank only; the caller runs each phase for every rank before the next
// (push: kPhaseCopy pushes into every peer's mailbox, kPhaseReduce reads this rank's).
void launch_allreduce_norm_emulated(const AllreduceNormParams& p, AllreduceAlgo algo, int phases, void* const* windows,
                                    KernelStream on);

// The real thing: peers through NCCL's LSA pointers into `window`, LSA barrier `blockIdx.x` of
// `dev_comm` between phases (dev_comm created with at least kMaxAllreduceBlocks LSA barriers).
void launch_allreduce_norm_nccl(const AllreduceNormParams& p, AllreduceAlgo algo, ncclWindow_t window,
                                const ncclDevComm& dev_comm, KernelStream on);

}  // namespace tpmoe::cuda
