// The decode GEMV (gemv.cuh). Grid: one block per group of weight rows of one output, the outputs'
// blocks laid end to end (block_begin). A block's 4 warps either each own kRowsPerWarp rows, or, for
// an output with few rows, split k between them (k_split warps per row pair, partial sums added in
// shared memory in a fixed order): a GEMV is bound by the loads in flight, and a 128-row router with
// one warp per row pair would keep only 64 warps' loads in flight on the whole GPU. The split
// depends only on the output's own shape, so an output's bits do not depend on what it is launched
// with. Each warp walks its rows over k, a lane reading 16 bytes (8 bf16 or 16 e4m3) per row per
// load, kUnroll loads per row in flight, the next ones issued before the current ones are
// multiplied. The activations [M][K] are copied into shared memory once per block after the PDL
// wait; the first weight loads go before it. Sums: each lane accumulates its k chunks in order,
// then one warp reduction per (row, token), then the k-split partials in warp order.
// With an input norm (GemvInputNorm) the block computes x itself where it would copy it: the norm
// threads of norm_math.cuh run by its 4 warps, so x, the new residual and the outputs are the bits of
// add_rmsnorm followed by the plain GEMV.
#include "backends/cuda/gemv.cuh"

#include "backends/cuda/kernel_utils.cuh"
#include "backends/cuda/norm_math.cuh"
#include "backends/cuda/weight_loads.cuh"

#include <string>

#include "backends/cuda/cuda_check.h"

namespace tpmoe::cuda {

namespace {

constexpr int kGemvWarps = 4;
constexpr int kRowsPerWarp = 2;
constexpr int kMaxKSplit = kGemvWarps;
// An output with at least this many row pairs keeps enough loads in flight with one warp per pair
// (132 SMs x ~8 resident warps); fewer rows split k across 2 or 4 warps.
constexpr int kFillRowPairs = 1024;
constexpr size_t kMaxActivationBytes = 200 * 1024;  // x in shared memory (227 KiB per block on Hopper)
constexpr size_t kPartialBytes = kGemvWarps * kRowsPerWarp * kGemvMaxM * sizeof(float);  // k-split sums
// Redundant reads an input norm inside the GEMV may cost (every block reads the rows from L2) before
// its own launch is the cheaper choice: a judgment (a launch in a chain costs 2-3 us; 4 MiB spread
// over the blocks' L2 reads is well under that), not a measured break-even.
constexpr size_t kNormInsideMaxBytes = 4u << 20;

struct GemvBatch {
  const uint16_t* x = nullptr;  // bf16 bits [M][K], read (no input norm; with one, norm.out is written)
  int K = 0;
  GemvOutput outputs[kMaxGemvOutputs];
  int block_begin[kMaxGemvOutputs + 1] = {};
  int k_split[kMaxGemvOutputs] = {};  // warps per row pair (1, 2 or 4), per output
  int count = 0;
  GemvInputNorm norm;
};

// x = the input norm of the M residual rows (GemvInputNorm), into shared memory. The norm threads of
// norm_math.cuh (norm warp v: chunks 32v + lane, + norm_threads, ...) run on the block's warps, warp w
// taking norm warps w, w + kGemvWarps, ...; every warp then adds the norm warps' sums in block_sum's
// shape itself. Block 0 also stores the sums (residual_out) and x (out). Returns after a barrier.
template <int M>
__device__ void stage_normed_rows(const GemvBatch& b, uint16_t* xs) {
  __shared__ float norm_warp_sums[M][kMaxBlockThreads / kWarp];
  const GemvInputNorm& n = b.norm;
  const int K = b.K, chunks = K / 8, threads = norm_threads(K), norm_warps = threads / kWarp;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const float4* w4 = reinterpret_cast<const float4*>(n.weight);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float4* res4 = reinterpret_cast<const float4*>(n.residual + size_t(m) * K);
    const uint4* part = reinterpret_cast<const uint4*>(n.partial + size_t(m) * K);
    for (int v = warp; v < norm_warps; v += kGemvWarps) {
      float ss = 0.f;
      for (int c = v * kWarp + lane; c < chunks; c += threads) {
        float4 r0 = res4[2 * c], r1 = res4[2 * c + 1];
        ss = add_chunk_sum_squares(r0, r1, part + c, ss);
      }
      ss = warp_sum(ss);
      if (lane == 0) norm_warp_sums[m][v] = ss;
    }
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float4* res4 = reinterpret_cast<const float4*>(n.residual + size_t(m) * K);
    const uint4* part = reinterpret_cast<const uint4*>(n.partial + size_t(m) * K);
    const float inv = inverse_rms(warp_sum(lane < norm_warps ? norm_warp_sums[m][lane] : 0.f), K, n.eps);
    float4* out4 = reinterpret_cast<float4*>(n.residual_out + size_t(m) * K);
    for (int c = tid; c < chunks; c += blockDim.x) {
      float4 r0 = res4[2 * c], r1 = res4[2 * c + 1];
      add_chunk_sum_squares(r0, r1, part + c, 0.f);  // the same sums as above (its squares unused)
      const uint4 x = normed_chunk(r0, r1, __ldg(&w4[2 * c]), __ldg(&w4[2 * c + 1]), inv);
      reinterpret_cast<uint4*>(xs + size_t(m) * K)[c] = x;
      if (blockIdx.x == 0) {
        out4[2 * c] = r0;
        out4[2 * c + 1] = r1;
        reinterpret_cast<uint4*>(n.out + size_t(m) * K)[c] = x;
      }
    }
  }
  __syncthreads();
}

// The norm weight into L1 before the PDL wait (it never depends on the previous kernel): a 128-byte
// line a thread.
__device__ __forceinline__ void prefetch_norm_weight(const GemvBatch& b) {
  constexpr int kLineFloats = 32;
  for (int i = threadIdx.x; i * kLineFloats < b.K; i += blockDim.x)
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(b.norm.weight + i * kLineFloats));
}

// Rows of one output a block covers: kRowsPerWarp per group of k_split warps.
__host__ __device__ constexpr int rows_per_block(int k_split) { return kGemvWarps / k_split * kRowsPerWarp; }

template <int M, bool kFp8>
__global__ void __launch_bounds__(kGemvWarps* kWarp) gemv_kernel(const GemvBatch b) {
  constexpr int kPerLoad = kFp8 ? 16 : 8;  // k per 16-byte weight load
  constexpr int kPass = kWarp * kPerLoad;  // k per warp and load
  constexpr int kBytesPerK = kFp8 ? 1 : 2;
  constexpr int kUnroll = M <= 2 ? 4 : 2;  // registers allow more loads in flight for 1-2 tokens
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  // [kGemvWarps][kRowsPerWarp][M] k-split partial sums, then x: [M][K] bf16 bits.
  float* partial = reinterpret_cast<float*>(gemv_smem);
  uint16_t* xs = reinterpret_cast<uint16_t*>(gemv_smem + kPartialBytes);

  int o = 0;
  while (o + 1 < b.count && int(blockIdx.x) >= b.block_begin[o + 1]) ++o;
  const GemvOutput& g = b.outputs[o];
  const int K = b.K, N = g.N;
  const int k_split = b.k_split[o];
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int slice = warp % k_split;  // this warp's share of k: passes slice, slice + k_split, ...
  const int row0 = (int(blockIdx.x) - b.block_begin[o]) * rows_per_block(k_split) + warp / k_split * kRowsPerWarp;
  const int stride = kPass * k_split;  // k between a warp's consecutive loads of a row
  const uint8_t* w = static_cast<const uint8_t*>(g.w);

  uint4 raw[kUnroll][kRowsPerWarp];
  uint32_t scale[kUnroll][kRowsPerWarp];
  auto load = [&](int k0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = k0 + u * stride;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int n = row0 + r;
        const bool live = k < K && n < N;
        const uint8_t* at = w + (size_t(n) * K + k) * kBytesPerK;
        raw[u][r] = live ? ld_weight16(reinterpret_cast<const uint16_t*>(at)) : make_uint4(0, 0, 0, 0);
        if constexpr (kFp8) scale[u][r] = live ? __ldg(g.w_scale + size_t(n) * (K / 32) + k / 32) : 127u;
      }
    }
  };
  int k0 = slice * kPass + lane * kPerLoad;
  load(k0);  // weights never depend on the previous kernel: these loads overlap its tail
  const bool norm = b.norm.residual != nullptr;
  if (norm) prefetch_norm_weight(b);

  pdl_wait();
  pdl_trigger();
  if (norm) {
    stage_normed_rows<M>(b, xs);
  } else {
    for (int i = tid; i < M * K / 8; i += blockDim.x)
      reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(b.x)[i];
    __syncthreads();
  }

  float acc[kRowsPerWarp][M];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

  for (; k0 < K; k0 += kUnroll * stride) {
    uint4 cur[kUnroll][kRowsPerWarp];
    uint32_t cur_scale[kUnroll][kRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        cur[u][r] = raw[u][r];
        cur_scale[u][r] = kFp8 ? scale[u][r] : 0u;
      }
    load(k0 + kUnroll * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = k0 + u * stride;
      if (k >= K) break;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if constexpr (kFp8) {
          float wf[16];
          widen_e4m3x16(cur[u][r], wf);
          const float scale_f = e8m0_to_float(cur_scale[u][r]);
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const uint4* xv = reinterpret_cast<const uint4*>(xs + size_t(m) * K + k);
            acc[r][m] = dot16_scaled(wf, xv[0], xv[1], scale_f, acc[r][m]);
          }
        } else {
#pragma unroll
          for (int m = 0; m < M; ++m)
            acc[r][m] = dot8(cur[u][r], *reinterpret_cast<const uint4*>(xs + size_t(m) * K + k), acc[r][m]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = warp_sum(acc[r][m]);
      if (lane == 0) partial[(warp * kRowsPerWarp + r) * kGemvMaxM + m] = v;
    }
  __syncthreads();
  // Lanes of a group's first warp write its rows: the k slices' sums added in slice order.
  if (slice != 0 || lane >= kRowsPerWarp * M) return;
  const int r = lane / M, m = lane % M, n = row0 + r;
  if (n >= N) return;
  float v = 0.f;
  for (int s = 0; s < k_split; ++s) v += partial[((warp + s) * kRowsPerWarp + r) * kGemvMaxM + m];
  if (g.out_f32)
    static_cast<float*>(g.out)[size_t(m) * N + n] = v;
  else
    static_cast<__nv_bfloat16*>(g.out)[size_t(m) * N + n] = __float2bfloat16(v);
}

template <int M, bool kFp8>
void launch_m(const GemvBatch& b, size_t smem, KernelStream on) {
  auto kernel = gemv_kernel<M, kFp8>;
  launch_pdl(kernel, dim3(unsigned(b.block_begin[b.count])), dim3(kGemvWarps * kWarp), smem, on, b);
}

template <bool kFp8>
void launch_format(int M, const GemvBatch& b, size_t smem, KernelStream on) {
  switch (M) {
    case 1: launch_m<1, kFp8>(b, smem, on); break;
    case 2: launch_m<2, kFp8>(b, smem, on); break;
    case 3: launch_m<3, kFp8>(b, smem, on); break;
    case 4: launch_m<4, kFp8>(b, smem, on); break;
    case 5: launch_m<5, kFp8>(b, smem, on); break;
    case 6: launch_m<6, kFp8>(b, smem, on); break;
    case 7: launch_m<7, kFp8>(b, smem, on); break;
    default: launch_m<8, kFp8>(b, smem, on); break;
  }
}

// Warps per row pair for an output of N rows: split k (by powers of two, each warp keeping at least
// one whole pass over k) until the output has kFillRowPairs warps' worth of loads in flight.
int choose_k_split(int N, int K, bool fp8) {
  const int pass = kWarp * (fp8 ? 16 : 8);
  const int pairs = (N + kRowsPerWarp - 1) / kRowsPerWarp;
  int split = 1;
  while (split < kMaxKSplit && pairs * split < kFillRowPairs && K >= 2 * split * pass) split *= 2;
  return split;
}

// Blocks of the launch: the outputs' row groups end to end (block_begin), per their k split.
int64_t lay_out_blocks(const GemvParams& p, GemvBatch& b) {
  for (int i = 0; i < p.count; ++i) {
    b.k_split[i] = choose_k_split(p.outputs[i].N, p.K, p.outputs[i].w_scale != nullptr);
    const int rows = rows_per_block(b.k_split[i]);
    const int64_t end = int64_t(b.block_begin[i]) + (p.outputs[i].N + rows - 1) / rows;
    if (end > 0x7fffffff) return end;
    b.block_begin[i + 1] = int(end);
  }
  return b.block_begin[p.count];
}

}  // namespace

bool gemv_fits(const GemvParams& p) {
  if (p.M < 1 || p.M > kGemvMaxM || p.count < 1 || p.count > kMaxGemvOutputs || p.K < 1) return false;
  const bool fp8 = p.outputs[0].w_scale != nullptr;
  if (p.K % (fp8 ? 32 : 16) != 0 || !aligned16(p.x) || size_t(p.M) * p.K * 2 > kMaxActivationBytes) return false;
  for (int i = 0; i < p.count; ++i) {
    const GemvOutput& o = p.outputs[i];
    if ((o.w_scale != nullptr) != fp8 || !aligned16(o.w) || o.N < 1) return false;
  }
  const GemvInputNorm& n = p.norm;
  if (n.residual != nullptr && (p.x != nullptr || n.out == nullptr || n.residual_out == nullptr ||
                                n.residual_out == n.residual || !aligned16(n.out) || !aligned16(n.residual) ||
                                !aligned16(n.residual_out) || !aligned16(n.partial) || !aligned16(n.weight)))
    return false;
  return true;
}

bool gemv_norm_pays(const GemvParams& p) {
  if (!gemv_fits(p)) return false;
  GemvBatch b;
  const int64_t blocks = lay_out_blocks(p, b);
  // Each block reads the M rows of residual (fp32) and partial (bf16) and the norm weight (fp32).
  const size_t per_block = size_t(p.M) * p.K * (sizeof(float) + sizeof(uint16_t)) + size_t(p.K) * sizeof(float);
  return size_t(blocks) * per_block <= kNormInsideMaxBytes;
}

void launch_gemv(const GemvParams& p, KernelStream on) {
  check_arg(gemv_fits(p),
            "launch_gemv: operands it does not take (M in [1, 8], K % 16 (MXFP8: 32), 16-byte "
            "aligned x and weights, one weight format, at most 6 outputs; an input norm's partial, "
            "residual, residual_out (another buffer), weight and out 16-byte aligned, x null)");
  GemvBatch b;
  b.x = reinterpret_cast<const uint16_t*>(p.x);
  b.K = p.K;
  b.count = p.count;
  b.norm = p.norm;
  for (int i = 0; i < p.count; ++i) {
    const GemvOutput& o = p.outputs[i];
    check_arg(o.out != nullptr && o.out != static_cast<const void*>(p.x), "launch_gemv: every output set, none is x");
    check_arg(p.norm.residual == nullptr ||
                  (o.out != static_cast<const void*>(p.norm.residual) &&
                   o.out != static_cast<const void*>(p.norm.partial) && o.out != static_cast<const void*>(p.norm.out)),
              "launch_gemv: no output is the input norm's residual, partial or out");
    b.outputs[i] = o;
  }
  check_arg(lay_out_blocks(p, b) <= 0x7fffffff, "launch_gemv: too many weight rows for one launch");
  const size_t smem = kPartialBytes + size_t(p.M) * p.K * sizeof(uint16_t);
  if (p.outputs[0].w_scale != nullptr)
    launch_format<true>(p.M, b, smem, on);
  else
    launch_format<false>(p.M, b, smem, on);
}

}  // namespace tpmoe::cuda
