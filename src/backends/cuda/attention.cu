// Attention over the bf16 KV cache (SPEC §1.3-1.4), in up to three launches on one stream, each with
// PDL (kernel_utils.cuh):
//
// 1. cache_write_kernel, one block per token: copies the step's k, v rows (and index_k on sparse
//    layers) into the cache row of (seq_slots[t], positions[t]) with 16-byte vectors. A launch of its
//    own, so every key of the step is in the cache before any query reads (prefill sees itself).
//    Bytes: T * (2*nkv*hd + ihd) * 2 read and written. Skipped when the caller says the rows are
//    already there (cache_written): the model's path (CudaOps::rotate_and_attend) stores them from
//    the head norm + RoPE kernel (norm.cu), one launch fewer a layer. That kernel runs before the
//    launches below and each of them waits for its predecessor to finish (pdl_wait), so the
//    property holds there too: every key of the step is in the cache before any query reads.
// 2. select_blocks_kernel (sparse layers), one block per (token, index head g), or a cluster of up
//    to 8 splitting the key scan where the step has few tokens (select_cluster): fp32 scores
//    iq[g]·ik[s] for s <= pos (bf16 inputs, no scale; 8 lanes per key), block max by atomicMax on
//    order-preserving uint32 keys in shared memory (order-independent, hence exact), the local
//    blocks held at +inf, then the top min(topk, pos/bs + 1) blocks over (score desc, block index
//    asc): ties go to the lower block, as in the CPU oracle. Up to 32 kept blocks are ranked by
//    warps with at most one block barrier (rank_by_warps), more by repeated block-wide argmax. A
//    chosen -inf block ends the selection (it and everything after it are dropped). Output: kept-block
//    list int32 [T][nih][topk] in the workspace, ascending, -1 padded. In a decode step the first
//    round of keys (below the local blocks, so an earlier step's) is loaded before the PDL wait.
//    Shared memory holds one uint32 per block of max_len: ceil(max_len/bs)*4 bytes (16 KiB at 256k
//    keys, bs 64).
//    Bytes: up to T * nih * pos * ihd * 2 (the index keys before the local blocks, once an index head).
//    Not launched where the step's context bound has no more blocks than topk_blocks: every
//    visible block would be kept, so the layer runs as a full one (attention_keeps_every_block).
// 3. attention_split_kernel<HD> (flash-decoding), grid (token, kv head x head chunk, split):
//    one block serves up to 16 query heads of one KV group (one warp per query head: a key group of
//    warps), so a K/V tile is read once for the group. Splits cut [0, context bound) into fixed
//    chunks (the grid depends on num_tokens and the bound only: graph-capturable); a split starting
//    past the query's position exits at once. A block walks its visible keys (full layers:
//    [chunk_lo, min(chunk_hi, pos+1)); sparse layers: the kept blocks of index head g = kv head,
//    intersected with the chunk and [0, pos]) in tiles of 32 keys: K and V rows land in shared
//    memory by 16-byte loads (rows of invisible tile slots are zero-filled, never read), lane r
//    scores key r, online softmax in fp32 (exp2 with the scale folded into log2 units), lane l
//    accumulates head dims [l*HD/32, (l+1)*HD/32). A block may hold several key groups (up to 32
//    warps in all): group g takes tiles g, g + G, ... of the block's keys, all groups one tile a
//    step between block barriers, and group 0 merges the groups' (m, l, acc) in group order at
//    the end, as the splits' merge below does. That is the split-KV parallelism of a short context
//    inside one block, where a KV group's query heads are few and narrow (choose_key_groups: a
//    block's tile reads from shared memory bound it; MiniMax-M3's 8-16 heads of 128 a KV group take
//    one group). A block of one key group pipelines its walk instead: two tile buffers, tile j + 1's
//    pool rows looked up and its K/V rows copied by cp.async (zero-filled where invisible) while
//    tile j is scored, one barrier a tile (a tile's lookup, loads and two barriers one after
//    another measured ~3 us a tile; the pipelined walk took a batch-1 step of the tp-8 rank 2%
//    shorter, docs/PERF.md). Before its PDL wait a full layer's pipelined walk looks up its first
//    tile's pool rows (the page table is a step input) and, in a decode step (the caller's
//    decode_step: every key below a query's position is an earlier step's), copies the keys below
//    the query's position of its first two tiles, one a buffer; after the wait, only the query's
//    own row.
//    With one split the block writes the bf16 output directly. With 2-16 splits (a short context:
//    decode at small batches; above 8 only where the launch's clusters all fit the GPU at once) a
//    (token, block row)'s splits are one thread-block cluster: split 0 sets up an mbarrier before the
//    PDL wait that counts the bytes the other splits that ran (split s ran iff s*chunk <= pos) will
//    push; each of them pushes its partial state (m, l, acc[HD], fp32) into a slot of split 0's
//    shared memory (st.async, counted off that barrier) and leaves; split 0 waits for the bytes and
//    merges the states with its own in split order. With more splits (long contexts; or
//    merge_splits_in_cluster off) each split writes its partials to the workspace and counts itself
//    in on the row's arrival counter; the block that arrives last - all
//    the splits that ran are in then - merges them the same way from L2, writes bf16 and sets the
//    counter back to zero for the next launch. Either merge rides in the split kernel instead of a
//    launch of its own (a launch fewer a layer; the combine's 5.1 us link in a batch-1 step mostly
//    moved into the last block's merge, docs/PERF.md), and both give the same bits. A query that
//    sees no key at all (only possible with topk_blocks = 0) gets zeros (the CPU oracle gives NaN
//    there).
//
// Workspace layout (attention_workspace_bytes): [arrivals int32 kMaxPartialRows: zero between
//   launches][kept int32 T*nih*topk][pad to 256 B][ml float2 T*nq*S][acc float T*nq*S*HD], the
//   partials only when S > 1. Its owner zeroes the arrivals once (attention_workspace_zeroed_bytes);
//   every launch leaves them zero. plan_splits chooses S0
//   chunks of >= kMinChunk (64) keys (32 for few rows and short contexts: kOneTileRows) with
//   T*nq*S0 <= kMaxPartialRows (16384); a block's G key
//   groups take G of them (choose_key_groups), so S = ceil(S0 / G) splits run and the workspace,
//   sized for S0, is enough.
// Layouts: q/out [T, nq*hd], k/v [T, nkv*hd], index_q [T, nih*ihd], index_k [T, ihd], all bf16
// row-major; cache as in kv_cache.cuh. All pointers 16-byte aligned, hd and ihd multiples of 8.
// FLOPs for decode: 4*T*L*nq*hd (QK and PV); the indexer adds 2*T*L*nih*ihd.
#include "backends/cuda/attention.cuh"

#include "backends/cuda/kernel_utils.cuh"

#include <algorithm>
#include <cstdint>
#include <string>

#include "backends/cuda/cuda_check.h"

namespace tpmoe::cuda {

namespace {

constexpr int kTile = 32;           // keys per attention tile: one per lane
constexpr int kMaxWarps = 16;       // query heads one attention block serves
constexpr int kMaxBlockWarps = 32;  // warps of an attention block: its query heads times its key groups
constexpr int kMaxTopk = 256;       // kept blocks per (token, index head) the kernels support
// Keys per split, at least: two tiles. A split's tiles run one after another in one block (each a
// load, a barrier, the scores and the sums: ~3 us), so where the grid is small (decode at batch 1:
// one block per KV head) the splits are the parallelism; 256 keys a split made a 190-key context
// one block walking six tiles (12.5 us at 70 keys under Nsight Compute at the tp-8 rank).
constexpr int kMinChunk = 64;
// One tile a split where the step has at most kOneTileRows (token, query head) rows and fewer than
// `max_cluster` splits of 64 keys, up to `max_cluster` of them (plan_splits): more blocks walk a
// short context, each one tile, and they still merge in one cluster. At a tp-8 rank of MiniMax-M3 (8
// query heads on one KV head) that is up to 16 tokens. Measured (docs/PERF.md), with clusters of 8:
// a batch-1 step 3.2% shorter and a 16-token one 1.0% on an H200 (60 layers); without the row limit
// a 64-token step was 0.2% longer on an H100.
constexpr int kOneTileRows = 128;
constexpr int64_t kMaxPartialRows = 16384;  // (token, q head, split) partial rows, at most
// Splits a row merges in a cluster, at most: the portable cluster size, and up to 16 where the
// launch's clusters fit the GPU all at once (launch_split). Measured on an H100 (docs/PERF.md), a
// 30-layer tp-8 rank: batch-1 steps 5.3% shorter at a context bound of 448 (14 one-tile splits in a
// cluster) and 1.7% at 960 (16 splits); an H100 holds 14 clusters of 14-16 of these blocks, and
// 16-token steps, which would need 16, measured 0.5% longer before they took the portable plan.
constexpr int kPortableClusterSplits = int(kPortableClusterSize);
constexpr int kMaxClusterSplits = int(kMaxClusterSize);
constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / kWarp;
constexpr int kSelectKeysPerCta = 512;  // select_cluster
constexpr int kCacheWriteThreads = 128;
constexpr size_t kSmemOptInMax = 227 * 1024;  // sm_90 dynamic + static shared memory per block
constexpr size_t kSelectStaticSmem = 4096;    // bound on select_blocks_kernel's static arrays
// Bound on attention_split_kernel's static shared memory: seg_start, seg_off, last_s, merge_bar.
constexpr size_t kSplitStaticSmem = (2 * kMaxTopk + 2) * sizeof(int) + 2 * sizeof(uint64_t);
constexpr size_t kAlign = 256;

// Order-preserving map float -> uint32 (a < b  <=>  key(a) < key(b)); -0.0 is folded into +0.0
// first so equal scores get equal keys, as they compare equal in the oracle.
constexpr uint32_t kKeyNegInf = 0x007FFFFFu;  // key(-inf)
constexpr uint32_t kKeyPosInf = 0xFF800000u;  // key(+inf)
constexpr uint32_t kKeyRemoved = 0u;          // below every float's key

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct SplitPlan {
  int num_splits;
  int chunk;  // keys per split; num_splits * chunk >= max_len
  bool operator==(const SplitPlan&) const = default;
};

// Depends on the step's token count and max_len only, never on positions (graph capture).
// `max_cluster` bounds the one-tile rule (kOneTileRows); a larger one never gives fewer splits or
// partial rows, so the workspace is sized with kMaxClusterSplits.
SplitPlan plan_splits(int num_tokens, int num_q_heads, int max_len, int max_cluster = kMaxClusterSplits) {
  const int64_t rows = std::max<int64_t>(1, int64_t(num_tokens) * num_q_heads);
  int64_t want = std::max<int64_t>(1, ceil_div(max_len, kMinChunk));
  if (rows <= kOneTileRows && want < max_cluster) want = std::min<int64_t>(max_cluster, ceil_div(max_len, kTile));
  const int64_t cap = std::max<int64_t>(1, kMaxPartialRows / rows);
  const int64_t splits = std::min(want, cap);
  const int64_t chunk = std::max<int64_t>(1, ceil_div(max_len, splits));
  return {int(ceil_div(max_len, chunk)), int(chunk)};
}

// One arrival counter per (token, block row) of a split grid with S > 1: T * nkv * head_chunks <=
// T * nq <= T * nq * S <= kMaxPartialRows (plan_splits caps the partial rows there).
constexpr size_t kArrivalBytes = size_t(kMaxPartialRows) * sizeof(int32_t);

size_t kept_bytes(int num_tokens, int num_index_heads, int topk_blocks) {
  return align_up(size_t(num_tokens) * size_t(std::max(num_index_heads, 0)) * size_t(std::max(topk_blocks, 0)) *
                  sizeof(int32_t));
}

size_t partial_bytes(int num_tokens, int num_q_heads, int head_dim, int max_len) {
  const SplitPlan plan = plan_splits(num_tokens, num_q_heads, max_len);
  if (plan.num_splits <= 1) return 0;
  const size_t rows = size_t(num_tokens) * size_t(num_q_heads) * size_t(plan.num_splits);
  return align_up(rows * sizeof(float2)) + align_up(rows * size_t(head_dim) * sizeof(float));
}

// ---------------------------------------------------------------------------------------------
// Device helpers

__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) == 0) u = 0;  // -0.0 -> +0.0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// sum_i a[i] * b[i] over 8 bf16 pairs, fp32.
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fx = __bfloat1622float2(x[i]);
    const float2 fy = __bfloat1622float2(y[i]);
    acc = fmaf(fx.x, fy.x, acc);
    acc = fmaf(fx.y, fy.y, acc);
  }
  return acc;
}

// N consecutive bf16 (N = 1, 2, 4, 8; aligned to N*2 bytes) widened to fp32.
template <int N>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* p, float (&o)[N]) {
  if constexpr (N == 1) {
    o[0] = __bfloat162float(p[0]);
  } else if constexpr (N == 2) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
    o[0] = f.x;
    o[1] = f.y;
  } else if constexpr (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      o[2 * i] = f.x;
      o[2 * i + 1] = f.y;
    }
  } else {
    static_assert(N == 8, "load_bf16: N must be 1, 2, 4 or 8");
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      o[2 * i] = f.x;
      o[2 * i + 1] = f.y;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Cache write

struct CacheWriteArgs {
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  const __nv_bfloat16* index_k;  // nullptr: full layer
  __nv_bfloat16* k_cache;
  __nv_bfloat16* v_cache;
  __nv_bfloat16* index_k_cache;
  const int32_t* positions;
  const int32_t* seq_slots;
  PageMap pages;
  int kv_row;          // nkv * hd
  int index_head_dim;  // ihd
};

__global__ void __launch_bounds__(kCacheWriteThreads) cache_write_kernel(const CacheWriteArgs a) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const size_t cache_row = a.pages.row(a.seq_slots[t], a.positions[t]);
  {
    const uint4* ks = reinterpret_cast<const uint4*>(a.k + size_t(t) * a.kv_row);
    const uint4* vs = reinterpret_cast<const uint4*>(a.v + size_t(t) * a.kv_row);
    uint4* kd = reinterpret_cast<uint4*>(a.k_cache + cache_row * a.kv_row);
    uint4* vd = reinterpret_cast<uint4*>(a.v_cache + cache_row * a.kv_row);
    for (int c = threadIdx.x; c < a.kv_row / 8; c += blockDim.x) {
      kd[c] = ks[c];
      vd[c] = vs[c];
    }
  }
  if (a.index_k != nullptr) {
    const uint4* is = reinterpret_cast<const uint4*>(a.index_k + size_t(t) * a.index_head_dim);
    uint4* id = reinterpret_cast<uint4*>(a.index_k_cache + cache_row * a.index_head_dim);
    for (int c = threadIdx.x; c < a.index_head_dim / 8; c += blockDim.x) id[c] = is[c];
  }
}

// ---------------------------------------------------------------------------------------------
// 2. Block selection (lightning indexer)

struct SelectArgs {
  const __nv_bfloat16* index_q;        // [T, nih*ihd]
  const __nv_bfloat16* index_k_cache;  // [pool rows][ihd]
  const int32_t* positions;
  const int32_t* seq_slots;
  PageMap pages;
  int32_t* kept;  // [T][nih][topk]
  int num_index_heads;
  int index_head_dim;
  int block_size;
  int topk;
  int local_blocks;
  int cluster;      // CTAs splitting a (token, index head)'s key scan: gridDim.z, one cluster
  int decode_step;  // AttentionKernelParams::decode_step: keys below pos may be read before the wait
};

// Block b's ranking value: its key above, ~b below, so a larger value is a higher score and, among
// equal scores, the lower block (the oracle's tie order). 0 only for a removed block.
__device__ __forceinline__ unsigned long long block_rank_key(const uint32_t* block_key, int b) {
  return (static_cast<unsigned long long>(block_key[b]) << 32) | (0xFFFFFFFFull - static_cast<uint32_t>(b));
}
__device__ __forceinline__ int ranked_block(unsigned long long v) { return int(0xFFFFFFFFull - (v & 0xFFFFFFFFull)); }
// Whether a ranking value's block scored above -inf (removed blocks, 0, do not).
__device__ __forceinline__ bool ranks_above_neg_inf(unsigned long long v) { return uint32_t(v >> 32) > kKeyNegInf; }

// The top `keep` (<= 32) of block_key[0, num_blocks) into out[0, topk): ascending, -1 padded, a
// -inf block ending the selection. Warp 0 takes `keep` rounds of warp argmax over candidates held
// in registers (8 a lane), only the round's winning lane rescanning its own, and writes the winners
// in block order; the other warps leave. Up to 256 blocks the candidates are the blocks themselves
// and no barrier is needed. Past that each warp first ranks the blocks its threads own (b = tid mod
// 256) the same way, the winning lane rescanning its blocks in shared memory, and after one barrier
// warp 0 ranks the 8 warps' top `keep` (the top `keep` of all are among them: a block outside its
// warp's top `keep` has `keep` better ones). Block-wide argmax passes take two barriers a kept
// block. Exact: the 64-bit values are distinct, so every step is a comparison with one answer.
__device__ void rank_by_warps(uint32_t* block_key, int num_blocks, int keep, int topk, int32_t* out,
                              unsigned long long (*warp_cand)[kWarp]) {
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  unsigned long long cand[kSelectWarps];  // removed or absent: 0, below every block
  if (num_blocks <= kSelectThreads) {
    if (warp != 0) return;
#pragma unroll
    for (int w = 0; w < kSelectWarps; ++w) {
      const int b = w * kWarp + lane;
      cand[w] = b < num_blocks ? block_rank_key(block_key, b) : 0;
    }
  } else {
    auto own_best = [&] {
      unsigned long long v = 0;
      for (int b = tid; b < num_blocks; b += kSelectThreads) v = max(v, block_rank_key(block_key, b));
      return v;
    };
    unsigned long long mine = own_best();
    int n = 0;
    for (; n < keep; ++n) {
      const unsigned long long best = warp_max(mine);
      if (!ranks_above_neg_inf(best)) break;  // warp-uniform: only -inf or removed blocks left
      if (lane == 0) warp_cand[warp][n] = best;
      if (best == mine) {  // this lane owns the winner
        block_key[ranked_block(best)] = kKeyRemoved;
        mine = own_best();
      }
    }
    if (n + lane < kWarp) warp_cand[warp][n + lane] = 0;
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int w = 0; w < kSelectWarps; ++w) cand[w] = warp_cand[w][lane];  // warp w's lane-th best
  }

  auto cand_best = [&] {
    unsigned long long v = 0;
#pragma unroll
    for (int w = 0; w < kSelectWarps; ++w) v = max(v, cand[w]);
    return v;
  };
  unsigned long long mine = cand_best();
  int my_block = INT_MAX;  // lane r: the r-th kept block by rank
  int n = 0;
  for (; n < keep; ++n) {
    const unsigned long long best = warp_max(mine);
    if (!ranks_above_neg_inf(best)) break;
    if (lane == n) my_block = ranked_block(best);
    if (best == mine) {
#pragma unroll
      for (int w = 0; w < kSelectWarps; ++w)
        if (cand[w] == best) cand[w] = 0;
      mine = cand_best();
    }
  }
  // Position in block order: the kept blocks below mine (n is warp-uniform).
  int below = 0;
  for (int j = 0; j < n; ++j) below += __shfl_sync(0xffffffffu, my_block, j) < my_block;
  if (lane < n) out[below] = my_block;
  for (int e = n + lane; e < topk; e += kWarp) out[e] = -1;
}

// Grid (token, index head, cluster rank): the CTAs of a cluster (along z, SelectArgs::cluster of
// them) split the key scan, one warp of the cluster a 4-key group at a time, and take the block
// maxima into rank 0's block_key (atomics on distributed shared memory: order-independent, hence
// exact); rank 0 then ranks alone. A short step (a few tokens) is a few CTAs, each scanning up to its
// whole context with dependent loads (page, then key) a round trip each: the cluster puts more
// loads in flight at once.
// Dynamic shared memory: float iq[ihd], then uint32 block_key[ceil(max_len / bs)] (rank 0's used).
__global__ void __launch_bounds__(kSelectThreads) select_blocks_kernel(const SelectArgs a) {
  extern __shared__ __align__(16) unsigned char select_smem[];
  float* iq = reinterpret_cast<float*>(select_smem);
  uint32_t* block_key = reinterpret_cast<uint32_t*>(select_smem + size_t(a.index_head_dim) * sizeof(float));
  __shared__ unsigned long long warp_cand[kSelectWarps][kWarp];  // rank_by_warps' candidates
  __shared__ int kept_s[kMaxTopk];
  __shared__ int num_kept_s;
  __shared__ int done_s;

  // Before the PDL wait the kernel reads only the step's inputs (positions, slots, the page table)
  // and, in a decode step (SelectArgs::decode_step), index keys below the token's position, which
  // earlier steps stored: it sets up the block maxima and loads its first round of keys while the
  // kernel before (the head norm + RoPE that writes this step's index query) still runs. After the
  // wait it reads the query, then scores what it holds.
  const int t = blockIdx.x, g = blockIdx.y, rank = blockIdx.z;
  const bool in_cluster = a.cluster > 1;
  const int pos = a.positions[t], slot = a.seq_slots[t];
  const int bs = a.block_size, ihd = a.index_head_dim;
  const int num_blocks = pos / bs + 1;  // blocks holding a key <= pos
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int num_warps = blockDim.x / kWarp;
  // This warp's place among the cluster's warps, which scan the keys together.
  const int scan_warp = rank * num_warps + warp, scan_warps = a.cluster * num_warps;

  // The local blocks pos/bs - j (j < local_blocks, clamped at 0) start at +inf, which no score's
  // key exceeds (NaN scores are skipped), so they stay there; the others start at -inf.
  const int first_local = num_blocks - a.local_blocks;
  const int scored_end = min(pos + 1, max(0, first_local) * bs);  // keys [0, scored_end) are scored
  if (rank == 0)
    for (int b = tid; b < num_blocks; b += blockDim.x) block_key[b] = b >= first_local ? kKeyPosInf : kKeyNegInf;
  // Rank 0's block_key is set before any CTA of the cluster takes a maximum into it (shared memory
  // only: this may go before the wait).
  if (in_cluster) cluster_sync();

  // Scores of the keys before the local blocks (theirs could not move a +inf): 8 lanes per key, 4
  // keys per warp per step; the loop bound is warp-uniform so every lane takes part in the shuffles.
  const int sub = lane / 8, lane8 = lane % 8, chunks = ihd / 8;
  const int32_t* slot_pages = a.pages.slot_pages(slot);
  // One key's score from this lane's loaded chunks (the 8 lanes of the key summed): into its block's key.
  auto score = [&](int s, float acc) {
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    // NaN scores are skipped, as std::max(block, NaN) keeps the block's value in the oracle.
    if (lane8 == 0 && s < scored_end && !isnan(acc)) {
      if (in_cluster)
        cluster_max_u32(cluster_map(smem_addr(&block_key[s / bs]), 0), order_key(acc));
      else
        atomicMax(&block_key[s / bs], order_key(acc));
    }
  };
  auto dot_chunk = [&](uint4 kv, int c, float acc) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&kv);
    const float* qc = iq + c * 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      acc = fmaf(qc[2 * i], f.x, acc);
      acc = fmaf(qc[2 * i + 1], f.y, acc);
    }
    return acc;
  };

  // Index heads of up to 128 dims (two 16-byte chunks a lane) scan kU steps of the general loop
  // below at once - every page lookup, then every key load, then the sums (in the loop's order) - so
  // a warp waits on its chain of dependent loads once per kU steps instead of once a step.
  constexpr int kU = 4;
  const bool unrolled = chunks <= 16;
  const int stride = scan_warps * 4;
  uint4 kv[kU][2];
  auto load_round = [&](int s0) {
    size_t row[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = s0 + u * stride + sub;
      row[u] = s < scored_end ? PageMap::row(slot_pages, a.pages.shift, s) : 0;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = lane8 + 8 * j, s = s0 + u * stride + sub;
        kv[u][j] = s < scored_end && c < chunks
                       ? *reinterpret_cast<const uint4*>(a.index_k_cache + row[u] * ihd + c * 8)
                       : make_uint4(0, 0, 0, 0);
      }
  };
  // The first round's keys before the wait: below the token's position (scored_end <= pos, true
  // whenever a local block is kept), so stored by earlier steps in a decode step.
  const int first_round = scan_warp * 4;
  const bool early = unrolled && a.decode_step && scored_end <= pos;
  if (early) load_round(first_round);

  pdl_wait();
  pdl_trigger();

  const __nv_bfloat16* q_row = a.index_q + (size_t(t) * a.num_index_heads + g) * ihd;
  for (int i = tid; i < ihd; i += blockDim.x) iq[i] = __bfloat162float(q_row[i]);
  __syncthreads();  // iq (and, without a cluster, block_key)

  if (unrolled) {
    for (int s0 = first_round; s0 < scored_end; s0 += stride * kU) {
      if (!(early && s0 == first_round)) load_round(s0);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (lane8 + 8 * j < chunks) acc = dot_chunk(kv[u][j], lane8 + 8 * j, acc);
        score(s0 + u * stride + sub, acc);
      }
    }
  } else {
    for (int s0 = scan_warp * 4; s0 < scored_end; s0 += scan_warps * 4) {
      const int s = s0 + sub;
      float acc = 0.f;
      if (s < scored_end) {
        const __nv_bfloat16* k_row = a.index_k_cache + PageMap::row(slot_pages, a.pages.shift, s) * ihd;
        for (int c = lane8; c < chunks; c += 8) acc = dot_chunk(*reinterpret_cast<const uint4*>(k_row + c * 8), c, acc);
      }
      score(s, acc);
    }
  }
  if (in_cluster) {
    cluster_sync();  // every maximum is in rank 0's block_key
    if (rank != 0) return;
  } else {
    __syncthreads();
  }

  int32_t* out = a.kept + (size_t(t) * a.num_index_heads + g) * a.topk;
  const int keep = min(a.topk, num_blocks);
  if (keep == num_blocks) {  // every block is kept (short context): no ranking needed
    for (int e = tid; e < a.topk; e += blockDim.x) out[e] = (e < num_blocks && block_key[e] != kKeyNegInf) ? e : -1;
    return;
  }

  // keep < num_blocks: rank by (key desc, block index asc) as one 64-bit value (key << 32 | ~b).
  if (keep <= kWarp) {
    rank_by_warps(block_key, num_blocks, keep, a.topk, out, warp_cand);
    return;
  }
  // More than a warp's worth kept: `keep` passes of block-wide argmax.
  if (tid == 0) {
    num_kept_s = 0;
    done_s = 0;
  }
  __syncthreads();
  for (int r = 0; r < keep; ++r) {
    unsigned long long best = 0;
    for (int b = tid; b < num_blocks; b += blockDim.x) best = max(best, block_rank_key(block_key, b));
    best = warp_max(best);
    if (lane == 0) warp_cand[warp][0] = best;
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < num_warps; ++w) best = max(best, warp_cand[w][0]);
      if (!ranks_above_neg_inf(best)) {
        done_s = 1;  // the best left is -inf: it and all the rest are dropped
      } else {
        const int b = ranked_block(best);
        kept_s[num_kept_s++] = b;
        block_key[b] = kKeyRemoved;
      }
    }
    __syncthreads();
    if (done_s) break;
  }
  if (tid == 0) {  // ascending block order (memory order for the attention walk), -1 padded
    const int n = num_kept_s;
    for (int i = 1; i < n; ++i) {
      const int x = kept_s[i];
      int j = i - 1;
      while (j >= 0 && kept_s[j] > x) {
        kept_s[j + 1] = kept_s[j];
        --j;
      }
      kept_s[j + 1] = x;
    }
    for (int e = 0; e < a.topk; ++e) out[e] = e < n ? kept_s[e] : -1;
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Split-KV attention

struct SplitArgs {
  const __nv_bfloat16* q;  // [T, nq*HD]
  const __nv_bfloat16* k_cache;
  const __nv_bfloat16* v_cache;
  const int32_t* positions;
  const int32_t* seq_slots;
  PageMap pages;
  const int32_t* kept;  // [T][nkv][topk] (sparse layers)
  int sparse;           // 0: full attention over [0, pos]
  int num_q_heads;
  int num_kv_heads;
  int group;        // nq / nkv
  int head_chunks;  // ceil(group / kMaxWarps)
  int block_size;
  int topk;
  float scale_log2;  // scale * log2(e)
  int num_splits;
  int chunk;
  int heads;           // warps of a key group: min(group, kMaxWarps)
  int key_groups;      // G: groups of `heads` warps walking the block's tiles side by side
  int pipelined;       // G == 1 only: two tile buffers, the next tile copied (cp.async) while one is scored
  int decode_step;     // AttentionKernelParams::decode_step: keys below pos may be read before the wait
  int cluster_merge;   // the row's splits are one cluster (rank = split); split 0 collects and merges them
  int push_offset;     // cluster_merge: dynamic shared memory bytes before split 0's slots of the pushed states
  __nv_bfloat16* out;  // written when num_splits == 1
  float2* ml;          // [T*nq][S] (m in log2 units, l)
  float* acc;          // [T*nq][S][HD]
  int* arrivals;       // [T][nkv * head_chunks] splits of the row done so far; zero between launches
};

// Dynamic shared memory of attention_split_kernel<HD>: q_s [heads][HD] bf16, then per key group (per
// tile buffer of the pipelined walk: two) its K tile [kTile][HD + 8], V tile [kTile][HD] (bf16) and
// tile_pos [kTile] (int; the pipelined walk keeps pool rows there). After the walk a group's
// tile space holds its (m, l) per head and then acc [heads][HD] (fp32) for the merge.
template <int HD>
struct SplitSmem {
  static constexpr int kKStride = HD + 8;  // padding: lane r reading row r hits distinct banks
  static constexpr size_t kGroupBytes = size_t(kTile) * (kKStride + HD) * 2 + kTile * sizeof(int);
  static constexpr size_t kMergeAccOffset = kMaxWarps * sizeof(float2);
  static_assert(kGroupBytes % 16 == 0 && kMergeAccOffset + size_t(kMaxWarps) * HD * sizeof(float) <= kGroupBytes,
                "a key group's tile space holds its merge values");
  // q_s: a multiple of 16 bytes (HD % 8 == 0), so the groups' tiles stay 16-byte aligned.
  __host__ __device__ static size_t q_bytes(int heads) { return size_t(heads) * HD * 2; }
  __host__ __device__ static size_t bytes(int heads, int key_groups) {
    return q_bytes(heads) + size_t(key_groups) * kGroupBytes;
  }
  // The cluster merge: split 0's slot of split s >= 1 (after the tile space, at SplitArgs::push_offset)
  // holds its (m, l) per head (kMaxWarps of them: the sums stay 16-byte aligned), then acc [heads][HD].
  // Each active head pushes kPushedBytes into it.
  static constexpr size_t kSlotMlBytes = kMaxWarps * sizeof(float2);
  static constexpr uint32_t kPushedBytes = sizeof(float2) + HD * sizeof(float);
  static_assert((kMaxClusterSplits - 1) * kMaxWarps * kPushedBytes < (1u << 20),
                "split 0's barrier counts every pushed byte: at most 2^20 - 1 (an mbarrier's tx-count)");
  __host__ __device__ static size_t slot_bytes(int heads) { return kSlotMlBytes + size_t(heads) * HD * sizeof(float); }
};

// The merge of n partial softmax states of one head, in index order, as the split kernel merges both
// its key groups (from shared memory) and its splits (pushed into split 0's shared memory, or from
// the workspace): ml(i) gives state i's (m in log2 units, l), acc(i, d) its sum for this lane's head
// dim d. A state that saw no key (m = -inf) is skipped. Returns the merged m and sets l and the sums
// (zeros where no state saw a key). The first kAhead states are read all at once, before the max
// that their weights need: the workspace merge of the splits reads them from L2 (kAhead 4, as the
// cluster merge does), and a short context's 2-4 splits then cost one round trip instead of two. The
// arithmetic, and so the bits, are those of the plain two passes (kAhead 0: the key groups' merge
// from shared memory, which has no round trip to save; reading ahead there too measured the tiny
// preset's step ~1% slower, docs/PERF.md).
template <int kDpl, int kAhead, class Ml, class Acc>
__device__ __forceinline__ float merge_states(int n, Ml&& ml, Acc&& acc, float& l, float (&sums)[kDpl]) {
  float2 ml_ahead[kAhead > 0 ? kAhead : 1];
  float acc_ahead[kAhead > 0 ? kAhead : 1][kDpl];
#pragma unroll
  for (int i = 0; i < kAhead; ++i) {
    ml_ahead[i] = i < n ? ml(i) : make_float2(-INFINITY, 0.f);
#pragma unroll
    for (int d = 0; d < kDpl; ++d) acc_ahead[i][d] = i < n ? acc(i, d) : 0.f;
  }
  float m_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kAhead; ++i) m_max = fmaxf(m_max, ml_ahead[i].x);
  for (int i = kAhead; i < n; ++i) m_max = fmaxf(m_max, ml(i).x);
  l = 0.f;
#pragma unroll
  for (int d = 0; d < kDpl; ++d) sums[d] = 0.f;
  if (m_max == -INFINITY) return m_max;
  auto add = [&](float2 v, auto&& acc_d) {
    if (v.x == -INFINITY) return;
    const float w = exp2f(v.x - m_max);
    l += w * v.y;
#pragma unroll
    for (int d = 0; d < kDpl; ++d) sums[d] = fmaf(w, acc_d(d), sums[d]);
  };
#pragma unroll
  for (int i = 0; i < kAhead; ++i) add(ml_ahead[i], [&](int d) { return acc_ahead[i][d]; });
  for (int i = kAhead; i < n; ++i) add(ml(i), [&](int d) { return acc(i, d); });
  return m_max;
}

template <int HD>
__global__ void __launch_bounds__(kMaxBlockWarps* kWarp) attention_split_kernel(const SplitArgs a) {
  using Smem = SplitSmem<HD>;
  constexpr int kChunks = HD / 8;   // 16-byte vectors per row
  constexpr int kDpl = HD / kWarp;  // head dims per lane
  constexpr int kKStride = Smem::kKStride;
  extern __shared__ __align__(16) unsigned char split_smem[];
  __shared__ int seg_start[kMaxTopk];    // first visible key of segment e
  __shared__ int seg_off[kMaxTopk + 1];  // visible keys before segment e (exclusive prefix sum)

  // Before the PDL wait the kernel reads only what no kernel of this step writes (kernel_utils.cuh):
  // the step's inputs (positions, slots and the page table, uploaded before its first kernel) and,
  // where SplitArgs::decode_step says so, cache rows below the query's position. So a full layer's
  // pipelined walk looks up its first tile's pool rows, and in a decode step starts copying its keys
  // and values too, while the kernel before (the head norm + RoPE that stores this step's keys)
  // still runs; after the wait it copies only the row at the query's own position.
  const int t = blockIdx.x;
  const int kvh = blockIdx.y / a.head_chunks, head_chunk = blockIdx.y % a.head_chunks;
  const int split = blockIdx.z;
  const int pos = a.positions[t], slot = a.seq_slots[t];
  // Splits that ran: split s ran iff s * chunk <= pos.
  const int ran = min(a.num_splits, pos / a.chunk + 1);
  // The cluster merge (below): split 0 sets up the barrier that counts the other splits' pushed
  // states, here, before the PDL wait, so that passing the cluster barrier costs nothing later.
  __shared__ uint64_t merge_bar;
  if (a.cluster_merge) {
    if (split == 0 && threadIdx.x == 0) {
      const int heads_here = min(a.heads, a.group - head_chunk * kMaxWarps);  // active head warps
      mbarrier_expect_bytes(&merge_bar, uint32_t(ran - 1) * uint32_t(heads_here) * Smem::kPushedBytes);
    }
    cluster_arrive_relaxed();
  }
  const int lo = split * a.chunk;
  if (lo > pos) {  // uniform over the block; the merge skips this split, and it counts no arrival
    pdl_wait();
    pdl_trigger();
    if (a.cluster_merge) cluster_wait();  // every thread that arrived waits before it leaves
    return;
  }
  const int hi = min(lo + a.chunk, pos + 1);
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int G = a.key_groups, group_threads = a.heads * kWarp;
  const int kg = warp / a.heads, hw = warp % a.heads;  // key group, head warp in it
  const int gtid = tid - kg * group_threads;           // thread in the key group
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(split_smem);
  unsigned char* group_smem = split_smem + Smem::q_bytes(a.heads) + size_t(kg) * Smem::kGroupBytes;
  __nv_bfloat16* k_tile = reinterpret_cast<__nv_bfloat16*>(group_smem);
  __nv_bfloat16* v_tile = k_tile + kTile * kKStride;
  int* tile_pos = reinterpret_cast<int*>(v_tile + kTile * HD);  // key position of tile slot r, -1: empty

  // Visible keys as segments [seg_start[e], seg_start[e] + len_e), len_e = seg_off[e+1] - seg_off[e]
  // (possibly 0). Full layers: one segment, [lo, hi); sparse layers: the kept blocks (written by the
  // selection launch, so read after the wait).
  const int num_segs = a.sparse ? a.topk : 1;
  int total = hi - lo;  // visible keys of the block; sparse layers: set after the wait
  if (!a.sparse && tid == 0) {
    seg_start[0] = lo;
    seg_off[0] = 0;
    seg_off[1] = hi - lo;
  }
  const size_t pos_stride = size_t(a.num_kv_heads) * HD;  // elements between consecutive pool rows
  const int32_t* slot_pages = a.pages.slot_pages(slot);
  const size_t head_offset = size_t(kvh) * HD;

  // Key number i of the block's visible keys -> its position (-1 past the last): the last segment e
  // with seg_off[e] <= i holds it.
  auto key_position = [&](int i) {
    if (i >= total) return -1;
    int lo_e = 0, hi_e = num_segs - 1;
    while (lo_e < hi_e) {
      const int mid = (lo_e + hi_e + 1) / 2;
      if (seg_off[mid] <= i)
        lo_e = mid;
      else
        hi_e = mid - 1;
    }
    return seg_start[lo_e] + (i - seg_off[lo_e]);
  };

  // The pipelined walk (one key group, two tile buffers, G's space for two): tile j + 1's pool rows
  // are looked up and its keys and values copied (cp.async, no registers) while tile j is scored.
  auto buffer = [&](int b) { return split_smem + Smem::q_bytes(a.heads) + size_t(b) * Smem::kGroupBytes; };
  auto k_buf = [&](int b) { return reinterpret_cast<__nv_bfloat16*>(buffer(b)); };
  auto v_buf = [&](int b) { return k_buf(b) + kTile * kKStride; };
  auto rows_buf = [&](int b) { return reinterpret_cast<int*>(v_buf(b) + kTile * HD); };  // pool row, -1: none
  auto stage_rows = [&](int tile, int b) {
    if (tid < kTile) {
      const int p = key_position(tile * kTile + tid);
      rows_buf(b)[tid] = p >= 0 ? int(PageMap::row(slot_pages, a.pages.shift, p)) : -1;
    }
  };
  // Copies the tile's rows (zero-filled where invisible) whose key position is below the query's
  // (kEarlierKeys), at or past it (kQueryKeys), or all of them, as one cp.async group.
  enum Rows { kEveryRow, kEarlierKeys, kQueryKeys };
  auto copy_tile = [&](int tile, int b, Rows which) {
    const int* rows = rows_buf(b);
    for (int idx = tid; idx < kTile * kChunks; idx += blockDim.x) {
      const int r = idx / kChunks, c = idx % kChunks;
      if (which != kEveryRow && (key_position(tile * kTile + r) < pos) != (which == kEarlierKeys)) continue;
      const int row = rows[r];
      const size_t off = size_t(max(row, 0)) * pos_stride + head_offset + size_t(c) * 8;
      cp_async16(k_buf(b) + r * kKStride + c * 8, a.k_cache + off, row >= 0);
      cp_async16(v_buf(b) + r * HD + c * 8, a.v_cache + off, row >= 0);
    }
    cp_async_commit();
  };
  // A full layer's first tile goes before the wait (its segment is known already); in a decode step
  // its second too, into the other buffer. At batch 1 a split is one tile (a short context:
  // kOneTileRows) or two (64 keys), so after the wait only the query's own row is copied: the second
  // tile's page lookup and copy, between the two tiles' scores after the wait, were ~2 us of the
  // block's chain (docs/PERF.md).
  const bool early = a.pipelined && !a.sparse;
  const bool second_early = early && a.decode_step && hi - lo > kTile;
  if (early) {
    __syncthreads();  // the segment
    stage_rows(0, 0);
    if (second_early) stage_rows(1, 1);
    __syncthreads();
    if (a.decode_step) copy_tile(0, 0, kEarlierKeys);
    if (second_early) copy_tile(1, 1, kEarlierKeys);
  }
  pdl_wait();
  pdl_trigger();

  if (a.sparse) {
    const int32_t* kept = a.kept + (size_t(t) * a.num_kv_heads + kvh) * a.topk;
    if (warp == 0) {
      int carry = 0;
      for (int base = 0; base < num_segs; base += kWarp) {
        const int e = base + lane;
        int len = 0;
        if (e < num_segs) {
          const int b = kept[e];
          int s0 = 0;
          if (b >= 0) {
            s0 = max(b * a.block_size, lo);
            len = max(0, min((b + 1) * a.block_size, hi) - s0);
          }
          seg_start[e] = s0;
        }
        int incl = len;  // inclusive scan over the warp
#pragma unroll
        for (int off = 1; off < kWarp; off <<= 1) {
          const int o = __shfl_up_sync(0xffffffffu, incl, off);
          if (lane >= off) incl += o;
        }
        if (e < num_segs) seg_off[e] = carry + incl - len;
        carry += __shfl_sync(0xffffffffu, incl, kWarp - 1);
      }
      if (lane == 0) seg_off[num_segs] = carry;
    }
  }

  const int head_in_group = head_chunk * kMaxWarps + hw;
  const bool active = head_in_group < a.group;
  const int qh = kvh * a.group + head_in_group;
  if (active && kg == 0) {
    const uint4* src = reinterpret_cast<const uint4*>(a.q + (size_t(t) * a.num_q_heads + qh) * HD);
    for (int c = lane; c < kChunks; c += kWarp) reinterpret_cast<uint4*>(q_s + hw * HD)[c] = src[c];
  }
  __syncthreads();

  if (a.sparse) total = seg_off[num_segs];
  const int tiles = (total + kTile - 1) / kTile;
  float m = -INFINITY, l = 0.f;
  float acc[kDpl];
#pragma unroll
  for (int i = 0; i < kDpl; ++i) acc[i] = 0.f;

  // This warp's head over one tile in shared memory (keys i0 .., zero rows past the last key):
  // the online softmax's m, l and acc updated.
  auto score_tile = [&](int i0, const __nv_bfloat16* kt, const __nv_bfloat16* vt) {
    const int n = min(kTile, total - i0);  // slots [0, n) hold keys; the rest are zero rows
    float s = -INFINITY;
    if (lane < n) {
      float d = 0.f;
      const uint4* qv = reinterpret_cast<const uint4*>(q_s + hw * HD);
      const uint4* kr = reinterpret_cast<const uint4*>(kt + lane * kKStride);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) d = dot8(qv[c], kr[c], d);
      s = d * a.scale_log2;
    }
    const float m_new = fmaxf(m, warp_max(s));  // finite: slot 0 always holds a key
    const float alpha = exp2f(m - m_new);       // 0 on the first tile (m = -inf)
    const float pr = lane < n ? exp2f(s - m_new) : 0.f;
    l = l * alpha + warp_sum(pr);
#pragma unroll
    for (int i = 0; i < kDpl; ++i) acc[i] *= alpha;
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const float pj = __shfl_sync(0xffffffffu, pr, j);
      float vj[kDpl];
      load_bf16<kDpl>(vt + j * HD + lane * kDpl, vj);
#pragma unroll
      for (int i = 0; i < kDpl; ++i) acc[i] = fmaf(pj, vj[i], acc[i]);
    }
    m = m_new;
  };

  if (a.pipelined) {
    // One barrier a tile: tile j + 1's rows are staged before it, its copies issued after it.
    if (tiles > 0) {
      if (early) {
        copy_tile(0, 0, a.decode_step ? kQueryKeys : kEveryRow);  // the rest of tile 0
        if (second_early) copy_tile(1, 1, kQueryKeys);            // and of tile 1
      } else {
        stage_rows(0, 0);
        __syncthreads();
        copy_tile(0, 0, kEveryRow);
      }
    }
    for (int tile = 0; tile < tiles; ++tile) {
      const int b = tile & 1;
      const bool next = tile + 1 < tiles && !(second_early && tile == 0);  // tile + 1 still to copy
      if (next) stage_rows(tile + 1, b ^ 1);            // its buffer's last reader passed the last barrier
      cp_async_wait_all();                              // this thread's copies of tile
      __syncthreads();                                  // everyone's; and tile + 1's rows
      if (next) copy_tile(tile + 1, b ^ 1, kEveryRow);  // buffer b ^ 1 was last scored before the barrier
      if (active) score_tile(tile * kTile, k_buf(b), v_buf(b));
    }
  } else {
    // Step j: key group kg takes tile j * G + kg (the trip count is the block's, so every thread meets
    // every barrier; a group past the last tile idles through the step).
    for (int step0 = 0; step0 < tiles; step0 += G) {
      const int tile = step0 + kg;
      const bool has_tile = tile < tiles;
      const int i0 = tile * kTile;
      if (has_tile && gtid < kTile) tile_pos[gtid] = key_position(i0 + gtid);
      __syncthreads();
      if (has_tile) {
        for (int idx = gtid; idx < kTile * kChunks; idx += group_threads) {
          const int r = idx / kChunks, c = idx % kChunks;
          const int p = tile_pos[r];
          uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
          if (p >= 0) {
            const size_t off = PageMap::row(slot_pages, a.pages.shift, p) * pos_stride + head_offset + size_t(c) * 8;
            kv = *reinterpret_cast<const uint4*>(a.k_cache + off);
            vv = *reinterpret_cast<const uint4*>(a.v_cache + off);
          }
          *reinterpret_cast<uint4*>(k_tile + r * kKStride + c * 8) = kv;
          *reinterpret_cast<uint4*>(v_tile + r * HD + c * 8) = vv;
        }
      }
      __syncthreads();
      if (has_tile && active) score_tile(i0, k_tile, v_tile);
      __syncthreads();  // the next step overwrites tile_pos, k_tile, v_tile
    }
  }

  if (G > 1) {
    // Each group's (m, l, acc) per head into its own tile space (the walk is over), then group 0's
    // warp of head hw merges the groups in group order, as the last split merges the splits.
    float2* group_ml = reinterpret_cast<float2*>(group_smem);
    float* group_acc = reinterpret_cast<float*>(group_smem + Smem::kMergeAccOffset);
    if (active) {
      if (lane == 0) group_ml[hw] = make_float2(m, l);
#pragma unroll
      for (int i = 0; i < kDpl; ++i) group_acc[hw * HD + lane * kDpl + i] = acc[i];
    }
    __syncthreads();
  }
  // Group 0's active warps hold the block's result from here on; the other threads only take part
  // in the barriers of the arrival below (no thread leaves before them).
  const bool writer = active && kg == 0;
  if (G > 1 && writer) {
    const unsigned char* groups = split_smem + Smem::q_bytes(a.heads);
    m = merge_states<kDpl, 0>(
        G, [&](int g) { return reinterpret_cast<const float2*>(groups + size_t(g) * Smem::kGroupBytes)[hw]; },
        [&](int g, int i) {
          const unsigned char* at = groups + size_t(g) * Smem::kGroupBytes + Smem::kMergeAccOffset;
          return reinterpret_cast<const float*>(at)[hw * HD + lane * kDpl + i];
        },
        l, acc);
  }

  const size_t row = size_t(t) * a.num_q_heads + qh;
  __nv_bfloat16* out = a.out + row * HD + lane * kDpl;
  if (a.num_splits == 1) {
    if (!writer) return;
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int i = 0; i < kDpl; ++i) out[i] = __float2bfloat16(acc[i] * inv);
    return;
  }
  if (a.cluster_merge) {
    // Splits 1.. push their states into split 0's slots (st.async: remote shared memory, counted off
    // split 0's barrier) and leave; split 0 waits for the bytes and merges them with its own, in split
    // order: no partials through L2, no fence, no arrival count, no barrier the pushers wait on.
    unsigned char* slots = split_smem + a.push_offset;
    auto slot_of = [&](int s) { return slots + size_t(s - 1) * Smem::slot_bytes(a.heads); };
    cluster_wait();  // split 0's barrier is set up (before the PDL wait: passed long since)
    if (!writer) return;
    if (split != 0) {
      unsigned char* mine = slot_of(split);
      const uint32_t bar = cluster_map(smem_addr(&merge_bar), 0);
      if (lane == 0) {
        const float ml[2] = {m, l};
        push_floats<2>(cluster_map(smem_addr(mine + hw * sizeof(float2)), 0), ml, bar);
      }
      const float* sums = reinterpret_cast<const float*>(mine + Smem::kSlotMlBytes) + hw * HD + lane * kDpl;
      push_floats<kDpl>(cluster_map(smem_addr(sums), 0), acc, bar);
      return;
    }
    mbarrier_wait_phase0(&merge_bar);
    float denom, num[kDpl];
    const float m_max = merge_states<kDpl, 4>(
        ran, [&](int s) { return s == 0 ? make_float2(m, l) : reinterpret_cast<const float2*>(slot_of(s))[hw]; },
        [&](int s, int i) {
          return s == 0 ? acc[i]
                        : reinterpret_cast<const float*>(slot_of(s) + Smem::kSlotMlBytes)[hw * HD + lane * kDpl + i];
        },
        denom, num);
#pragma unroll
    for (int i = 0; i < kDpl; ++i) out[i] = __float2bfloat16(m_max != -INFINITY ? num[i] / denom : 0.f);
    return;
  }

  const size_t prow = row * a.num_splits;
  if (writer) {
    if (lane == 0) a.ml[prow + split] = make_float2(m, l);
    float* o = a.acc + (prow + split) * HD + lane * kDpl;
#pragma unroll
    for (int i = 0; i < kDpl; ++i) o[i] = acc[i];
  }

  // Arrival: the partials above are made visible device-wide (fence), then counted. The block that
  // counts the last split that ran sees every split's partials (each fenced before its count) and
  // merges them; it alone touches the counter after the others' atomics, so it resets it plainly.
  __shared__ int last_s;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* arrivals = a.arrivals + size_t(t) * gridDim.y + blockIdx.y;
    last_s = atomicAdd(arrivals, 1) == ran - 1;
    if (last_s) *arrivals = 0;
  }
  __syncthreads();
  if (!last_s || !writer) return;
  __threadfence();
  // The merge, in split order. L2 loads (__ldcg): the partials of other blocks were never in this
  // SM's L1, and must not be read from it.
  const float2* ml = a.ml + prow;
  const float* partial_acc = a.acc + prow * HD + lane * kDpl;
  float denom, num[kDpl];
  const float m_max = merge_states<kDpl, 4>(
      ran, [&](int s) { return __ldcg(&ml[s]); },
      [&](int s, int i) { return __ldcg(partial_acc + size_t(s) * HD + i); }, denom, num);
#pragma unroll
  for (int i = 0; i < kDpl; ++i) out[i] = __float2bfloat16(m_max != -INFINITY ? num[i] / denom : 0.f);
}

// Shared-memory bytes an attention block may read in one step of its walk: every warp reads its
// group's K and V tiles (4 * kTile * HD bytes). 128 KiB is 8 warps at head_dim 128, a tp-8 rank of
// MiniMax-M3 (8 query heads a KV head); 4 key groups there (32 warps, 512 KiB a step on one SM)
// measured slower than 4 split blocks and their merge (docs/PERF.md), where 4 groups of 2 warps at
// head_dim 32 (the tiny preset, 32 KiB a step) measured faster.
constexpr size_t kMaxTileReadsPerStep = 128 * 1024;

// Key groups a block of `heads` warps takes (SplitArgs::key_groups): enough for the planned splits
// (as many as there are, so that a short context needs no merge across blocks), within the block's 32 warps, its
// shared memory and its shared-memory reads a step. 1 where the plan has one split.
template <int HD>
int choose_key_groups(int planned_splits, int heads) {
  const size_t room = kSmemOptInMax - kSplitStaticSmem - SplitSmem<HD>::q_bytes(heads);
  const int by_smem = int(room / SplitSmem<HD>::kGroupBytes);
  const int by_reads = int(kMaxTileReadsPerStep / (size_t(heads) * 4 * kTile * HD));
  return std::max(1, std::min({planned_splits, kMaxBlockWarps / heads, by_smem, by_reads}));
}

// Sets the splits that run - the plan's chunks, G of them a block (choose_key_groups), spread evenly
// - and the block's tile buffers; returns the dynamic shared memory of the walk.
template <int HD>
size_t shape_splits(const SplitPlan& plan, SplitArgs& a) {
  const int most = choose_key_groups<HD>(plan.num_splits, a.heads);
  a.num_splits = int(ceil_div(plan.num_splits, most));
  a.key_groups = int(ceil_div(plan.num_splits, a.num_splits));
  a.chunk = plan.chunk * a.key_groups;
  a.pipelined = a.key_groups == 1 && SplitSmem<HD>::bytes(a.heads, 2) + kSplitStaticSmem <= kSmemOptInMax;
  return SplitSmem<HD>::bytes(a.heads, a.pipelined ? 2 : a.key_groups);
}

// Shapes the splits from `plan` (plan_splits up to kMaxClusterSplits) or, where that gives more than
// kPortableClusterSplits splits a row and they could not merge in clusters, from `portable` (the
// same up to kPortableClusterSplits): the shape does not depend on merge_in_cluster, so both merges
// give the same bits. Sets the splits' arrival counters and their partials in `partials` (the
// workspace past the kept blocks, sized for `plan`'s splits, which are never fewer), then launches
// the split kernel. A row's splits merge in one cluster where the flag allows it, their states fit
// split 0's shared memory and, above the portable size, every cluster of the grid is resident at
// once: a cluster of 16 at ~99 KiB a block (the tp-8 rank) takes 8 SMs of one GPC, and a grid of
// more such clusters than the GPU holds runs them in waves.
template <int HD>
void launch_split(const SplitPlan& plan, const SplitPlan& portable, int* arrivals, unsigned char* partials,
                  int num_tokens, bool merge_in_cluster, SplitArgs& a, KernelStream on) {
  size_t smem = 0;
  const auto clusters_fit = [&] {
    if (a.num_splits > kMaxClusterSplits) return false;
    const size_t slots = size_t(a.num_splits - 1) * SplitSmem<HD>::slot_bytes(a.heads);
    if (smem + slots + kSplitStaticSmem > kSmemOptInMax) return false;
    if (a.num_splits <= kPortableClusterSplits) return true;
    const int64_t clusters = int64_t(num_tokens) * a.num_kv_heads * a.head_chunks;
    return clusters <= max_active_clusters(attention_split_kernel<HD>, unsigned(a.heads * a.key_groups * kWarp),
                                           smem + slots, unsigned(a.num_splits));
  };
  smem = shape_splits<HD>(plan, a);
  bool fit = clusters_fit();
  // Where the one-tile rule does not raise the plan (more than kOneTileRows rows, or 16 or more
  // splits of kMinChunk keys) both limits give the same plan: nothing to shape again.
  if (a.num_splits > kPortableClusterSplits && !fit && portable != plan) {
    smem = shape_splits<HD>(portable, a);
    fit = clusters_fit();
  }
  a.cluster_merge = merge_in_cluster && a.num_splits > 1 && fit;
  const size_t rows = size_t(num_tokens) * a.num_q_heads * a.num_splits;
  a.ml = a.num_splits > 1 ? reinterpret_cast<float2*>(partials) : nullptr;
  a.acc = a.num_splits > 1 ? reinterpret_cast<float*>(partials + align_up(rows * sizeof(float2))) : nullptr;
  a.arrivals = arrivals;
  a.push_offset = int(smem);
  if (a.cluster_merge) smem += size_t(a.num_splits - 1) * SplitSmem<HD>::slot_bytes(a.heads);
  const dim3 grid(unsigned(num_tokens), unsigned(a.num_kv_heads * a.head_chunks), unsigned(a.num_splits));
  launch_pdl_clusters(attention_split_kernel<HD>, grid, dim3(unsigned(a.heads * a.key_groups * kWarp)), smem, on,
                      a.cluster_merge ? unsigned(a.num_splits) : 1u, a);
}

// CTAs a (token, index head)'s selection splits its key scan over: one per kSelectKeysPerCta keys of
// the context bound, up to the portable cluster size, halved while the grid would hold more CTAs
// than the GPU has SMs (a prefill's many tokens already fill it). A function of the launch's
// arguments and the GPU only, so a captured graph keeps its shape.
int select_cluster(int num_tokens, int num_index_heads, int context_bound) {
  int cluster = int(std::min<int64_t>(kPortableClusterSize, ceil_div(context_bound, kSelectKeysPerCta)));
  const int64_t sms = sm_count();
  while (cluster > 1 && int64_t(num_tokens) * num_index_heads * cluster > sms) cluster /= 2;
  return std::max(cluster, 1);
}

}  // namespace

size_t attention_workspace_bytes(int max_tokens, int num_q_heads, int num_index_heads, int head_dim, int max_len,
                                 int block_size, int topk_blocks) {
  // The partials shrink as tokens grow (S ~ kMaxPartialRows / (T*nq)) but not monotonically once
  // rounded: take the largest over every token count the step may have. Past kMaxPartialRows rows
  // there is one split and no partials.
  size_t partials = 0;
  const int64_t last = std::min<int64_t>(max_tokens, kMaxPartialRows);
  for (int64_t t = 1; t <= last; ++t)
    partials = std::max(partials, partial_bytes(int(t), num_q_heads, head_dim, max_len));
  return kArrivalBytes + kept_bytes(max_tokens, num_index_heads, topk_blocks) + partials;
}

size_t attention_workspace_zeroed_bytes() { return kArrivalBytes; }

bool attention_keeps_every_block(int context_bound, int block_size, int topk_blocks) {
  return block_size > 0 && context_bound > 0 && ceil_div(context_bound, block_size) <= topk_blocks;
}

void launch_attention(const AttentionKernelParams& p, KernelStream on) {
  const int T = p.num_tokens;
  check_arg(T >= 0, "attention: num_tokens must be >= 0");
  if (T == 0) return;
  const bool sparse = p.index_q != nullptr;
  const KvCacheLayer& c = p.cache;
  check_arg(p.num_q_heads > 0 && p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0,
            "attention: num_q_heads=" + std::to_string(p.num_q_heads) +
                " must be a positive multiple of num_kv_heads=" + std::to_string(p.num_kv_heads));
  check_arg(c.num_kv_heads == p.num_kv_heads && c.head_dim == p.head_dim,
            "attention: the KV cache layer's num_kv_heads/head_dim differ from the op's");
  check_arg(c.max_len > 0 && c.max_seqs > 0, "attention: empty KV cache layer");
  check_arg(c.page_shift >= 0 && c.page_shift < 31 && c.pages_per_seq == int(ceil_div(c.max_len, 1ll << c.page_shift)),
            "attention: pages_per_seq=" + std::to_string(c.pages_per_seq) + " does not cover max_len=" +
                std::to_string(c.max_len) + " in pages of 2^" + std::to_string(c.page_shift));
  // k, v and index_k are read only by the cache write; with cache_written they may be null.
  const bool write_cache = !p.cache_written;
  check_arg(p.q && p.out && c.k && c.v && c.page_table && p.positions && p.seq_slots,
            "attention: null pointer (q, out, the KV cache, its page table, positions or seq_slots)");
  check_arg(!write_cache || (p.k && p.v), "attention: k and v must be set unless cache_written");
  check_arg(aligned16(p.q) && aligned16(p.out) && aligned16(c.k) && aligned16(c.v) && aligned16(p.workspace) &&
                (!write_cache || (aligned16(p.k) && aligned16(p.v))),
            "attention: q, k, v, out, cache and workspace must be 16-byte aligned");
  if (sparse) {
    check_arg(c.index_k && (!write_cache || p.index_k),
              "attention: sparse layer without index_k (needed unless cache_written) or index-key cache");
    check_arg(aligned16(p.index_q) && aligned16(c.index_k) && (!write_cache || aligned16(p.index_k)),
              "attention: index_q, index_k and the index-key cache must be 16-byte aligned");
    check_arg(p.num_index_heads == p.num_kv_heads, "attention: num_index_heads=" + std::to_string(p.num_index_heads) +
                                                       " must equal num_kv_heads=" + std::to_string(p.num_kv_heads) +
                                                       " (SPEC §1.4)");
    check_arg(p.index_head_dim > 0 && p.index_head_dim % 8 == 0 && c.index_head_dim == p.index_head_dim,
              "attention: index_head_dim=" + std::to_string(p.index_head_dim) +
                  " must be a positive multiple of 8 and match the cache");
    check_arg(p.block_size > 0, "attention: index block_size must be > 0");
    check_arg(p.topk_blocks >= 0 && p.topk_blocks <= kMaxTopk,
              "attention: unsupported topk_blocks=" + std::to_string(p.topk_blocks) + " (at most " +
                  std::to_string(kMaxTopk) + ")");
    check_arg(p.local_blocks >= 0, "attention: local_blocks must be >= 0");
  }
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head_chunks = int(ceil_div(group, kMaxWarps));
  check_arg(int64_t(p.num_kv_heads) * head_chunks <= 65535, "attention: too many KV heads for the grid");

  check_arg(p.context_bound >= 0 && p.context_bound <= c.max_len,
            "attention: context_bound=" + std::to_string(p.context_bound) + " outside [0, max_len]");
  const int bound = p.context_bound > 0 ? p.context_bound : c.max_len;
  const SplitPlan plan = plan_splits(T, p.num_q_heads, bound);
  const SplitPlan portable = plan_splits(T, p.num_q_heads, bound, kPortableClusterSplits);
  check_arg(plan.num_splits <= 65535, "attention: max_len too large for the split grid");
  const size_t kept_region = sparse ? kept_bytes(T, p.num_index_heads, p.topk_blocks) : 0;
  const size_t need = kArrivalBytes + kept_region + partial_bytes(T, p.num_q_heads, p.head_dim, bound);
  check_arg(p.workspace_bytes >= need && (need == 0 || p.workspace != nullptr),
            "attention: workspace of " + std::to_string(p.workspace_bytes) + " bytes, the step needs " +
                std::to_string(need) + " (size it with attention_workspace_bytes)");
  switch (p.head_dim) {
    case 32:
    case 64:
    case 128:
    case 256: break;
    default:
      check_arg(false, "attention: unsupported head_dim=" + std::to_string(p.head_dim) +
                           " (kernels are built for 32, 64, 128, 256)");
  }

  // A sparse layer whose context bound has no more index blocks than it keeps runs as full
  // attention, without the selection launch (see attention_keeps_every_block).
  const bool select = sparse && !attention_keeps_every_block(bound, p.block_size, p.topk_blocks);
  int* arrivals = static_cast<int*>(p.workspace);
  unsigned char* ws = static_cast<unsigned char*>(p.workspace) + kArrivalBytes;
  int32_t* kept = select ? reinterpret_cast<int32_t*>(ws) : nullptr;
  const PageMap pages = c.pages();

  // 1. cache writes (unless an earlier launch made them: cache_written)
  if (write_cache) {
    CacheWriteArgs a{};
    a.k = p.k;
    a.v = p.v;
    a.index_k = sparse ? p.index_k : nullptr;
    a.k_cache = c.k;
    a.v_cache = c.v;
    a.index_k_cache = c.index_k;
    a.positions = p.positions;
    a.seq_slots = p.seq_slots;
    a.pages = pages;
    a.kv_row = p.num_kv_heads * p.head_dim;
    a.index_head_dim = sparse ? p.index_head_dim : 0;
    launch_pdl(cache_write_kernel, dim3(unsigned(T)), dim3(kCacheWriteThreads), 0, on, a);
  }

  // 2. block selection
  if (select && p.topk_blocks > 0) {
    const size_t max_blocks = size_t(ceil_div(c.max_len, p.block_size));
    const size_t smem = size_t(p.index_head_dim) * sizeof(float) + max_blocks * sizeof(uint32_t);
    check_arg(smem + kSelectStaticSmem <= kSmemOptInMax,
              "attention: max_len/block_size = " + std::to_string(max_blocks) +
                  " blocks exceed the indexer's shared-memory selection");
    SelectArgs a{};
    a.index_q = p.index_q;
    a.index_k_cache = c.index_k;
    a.positions = p.positions;
    a.seq_slots = p.seq_slots;
    a.pages = pages;
    a.kept = kept;
    a.num_index_heads = p.num_index_heads;
    a.index_head_dim = p.index_head_dim;
    a.block_size = p.block_size;
    a.topk = p.topk_blocks;
    a.local_blocks = p.local_blocks;
    a.cluster = select_cluster(T, p.num_index_heads, bound);
    a.decode_step = p.decode_step ? 1 : 0;
    launch_pdl_clusters(select_blocks_kernel, dim3(unsigned(T), unsigned(p.num_index_heads), unsigned(a.cluster)),
                        dim3(kSelectThreads), smem, on, unsigned(a.cluster), a);
  }

  // 3. split-KV attention, its splits merged by the last to finish (topk_blocks = 0 on a sparse
  // layer: no kept blocks, zero segments; a sparse layer that keeps every block: as a full one)
  SplitArgs a{};
  a.q = p.q;
  a.k_cache = c.k;
  a.v_cache = c.v;
  a.positions = p.positions;
  a.seq_slots = p.seq_slots;
  a.pages = pages;
  a.kept = kept;
  a.sparse = select ? 1 : 0;
  a.num_q_heads = p.num_q_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.group = group;
  a.head_chunks = head_chunks;
  a.block_size = select ? p.block_size : 0;
  a.topk = select ? p.topk_blocks : 0;
  a.scale_log2 = p.scale * 1.4426950408889634f;
  a.heads = std::min(group, kMaxWarps);
  a.decode_step = p.decode_step ? 1 : 0;
  a.out = p.out;
  switch (p.head_dim) {
    case 32: launch_split<32>(plan, portable, arrivals, ws + kept_region, T, p.merge_splits_in_cluster, a, on); break;
    case 64: launch_split<64>(plan, portable, arrivals, ws + kept_region, T, p.merge_splits_in_cluster, a, on); break;
    case 128: launch_split<128>(plan, portable, arrivals, ws + kept_region, T, p.merge_splits_in_cluster, a, on); break;
    case 256: launch_split<256>(plan, portable, arrivals, ws + kept_region, T, p.merge_splits_in_cluster, a, on); break;
    default: check_arg(false, "attention: unsupported head_dim=" + std::to_string(p.head_dim));
  }
}

}  // namespace tpmoe::cuda
