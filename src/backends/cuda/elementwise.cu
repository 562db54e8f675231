// Small memory-bound kernels around the layers (see elementwise.cuh for the contracts):
//   embed        out[T,H] fp32 = table[ids[t], :] bf16 widened; a bad id writes a NaN row.
//                Bytes: T*H*(2 + 4).
//   add_bf16     y[n] += x[n] in fp32, one rounding to bf16. Bytes: 3*n*2.
//   swiglu       gate_up[R, 2n] bf16 -> out[R, n] bf16, SwiGLU-OAI in fp32. Bytes: R*n*(4 + 2).
//   gather_rows  out[r, :] = x[rows[r], :] bf16. Bytes: 2 x num_rows*cols*2.
//   split_columns  out_i[r, :] = in[r, the i-th run of columns], bf16 or fp32 as they are.
//                Bytes: 2 x rows*cols*elem.
//   argmax       ids[r] = first argmax of logits[r, :] fp32: blocks of 4096 logits, then one block
//                per row over their winners. Bytes: R*V*4.
//   combine_vocab_argmax  ids[r] = the winner among the ranks' argmax winners of a vocab-parallel
//                step. Bytes: ranks*R*8 + R*4.
//   fill_random  out[i] = random_value(seed, key, offset + i, stddev) (src/model/presets.cpp),
//                bitwise: the same splitmix64 hash, the same float ops with contraction forbidden
//                (__fmul_rn/__fadd_rn), bf16 by round-to-nearest-even as f32_to_bf16.
//                Bytes: n*2 (or n*4).
// Vectorised paths move 16 bytes per thread (8 bf16 / 4 fp32) when widths allow it and the pointers
// are 16-byte aligned; a scalar path covers every other width. Elementwise kernels are grid-stride
// loops over int64 indices with the grid capped at kMaxBlocks, so the grid depends only on the
// sizes (graph-capturable); no sync, no allocation. All but fill_random (weights, before any step)
// launch with PDL (kernel_utils.cuh).
#include "backends/cuda/elementwise.cuh"

#include "backends/cuda/kernel_utils.cuh"

#include <cstdint>
#include <string>

#include "backends/cuda/cuda_check.h"

namespace tpmoe::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;
constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxChunk = 4096;  // logits per block in the first argmax pass

unsigned grid_for(int64_t work_items) {
  const int64_t blocks = (work_items + kThreads - 1) / kThreads;
  return unsigned(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

__device__ __forceinline__ int64_t global_thread() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return int64_t(gridDim.x) * blockDim.x; }

// ---- embed ---------------------------------------------------------------------------------------

// One item = 8 columns (kVec) or 1 column of one token's row.
template <bool kVec>
__global__ void embed_kernel(EmbedParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t per_row = kVec ? p.hidden / 8 : p.hidden;
  const int64_t total = int64_t(p.num_tokens) * per_row;
  for (int64_t idx = global_thread(); idx < total; idx += grid_stride()) {
    const int64_t t = idx / per_row, c = idx % per_row;
    int32_t id = p.token_ids[t];
    if (id == kEmbedFedBackId && p.fed_ids) id = p.fed_ids[t];
    const bool ok = id >= 0 && id < p.vocab;
    float* out = p.out + t * p.hidden;
    if constexpr (kVec) {
      float f[8];
      if (ok) {
        unpack_bf16x8(reinterpret_cast<const uint4*>(p.table + int64_t(id) * p.hidden)[c], f);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = __int_as_float(0x7fffffff);
      }
      reinterpret_cast<float4*>(out)[2 * c] = make_float4(f[0], f[1], f[2], f[3]);
      reinterpret_cast<float4*>(out)[2 * c + 1] = make_float4(f[4], f[5], f[6], f[7]);
    } else {
      out[c] = ok ? __bfloat162float(p.table[int64_t(id) * p.hidden + c]) : __int_as_float(0x7fffffff);
    }
  }
}

// ---- add_bf16 ------------------------------------------------------------------------------------

template <bool kVec>
__global__ void add_bf16_kernel(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t n) {
  pdl_wait();
  pdl_trigger();
  if constexpr (kVec) {
    for (int64_t c = global_thread(); c < n / 8; c += grid_stride()) {
      float a[8], b[8];
      unpack_bf16x8(reinterpret_cast<const uint4*>(x)[c], a);
      unpack_bf16x8(reinterpret_cast<const uint4*>(y)[c], b);
#pragma unroll
      for (int j = 0; j < 8; ++j) b[j] += a[j];
      reinterpret_cast<uint4*>(y)[c] = pack_bf16x8(b);
    }
  } else {
    for (int64_t i = global_thread(); i < n; i += grid_stride())
      y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) + __bfloat162float(x[i]));
  }
}

// ---- swiglu --------------------------------------------------------------------------------------

template <bool kVec>
__global__ void swiglu_kernel(SwigluKernelParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t n = p.n;
  const int64_t per_row = kVec ? n / 8 : n;
  const int64_t total = int64_t(p.rows) * per_row;
  for (int64_t idx = global_thread(); idx < total; idx += grid_stride()) {
    const int64_t r = idx / per_row, c = idx % per_row;
    const __nv_bfloat16* gate = p.gate_up + r * 2 * n;
    const __nv_bfloat16* up = gate + n;
    __nv_bfloat16* out = p.out + r * n;
    if constexpr (kVec) {
      float g[8], u[8], o[8];
      unpack_bf16x8(reinterpret_cast<const uint4*>(gate)[c], g);
      unpack_bf16x8(reinterpret_cast<const uint4*>(up)[c], u);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = swiglu_oai(g[j], u[j], p.alpha, p.limit);
      reinterpret_cast<uint4*>(out)[c] = pack_bf16x8(o);
    } else {
      out[c] = __float2bfloat16_rn(swiglu_oai(__bfloat162float(gate[c]), __bfloat162float(up[c]), p.alpha, p.limit));
    }
  }
}

// ---- split_columns -------------------------------------------------------------------------------

// One item = one copy unit U (16 bytes, or one element) of one row; the unit's output found by a walk
// over at most kMaxSplitColumns widths.
template <class U>
__global__ void split_columns_kernel(const SplitColumnsParams p) {
  pdl_wait();
  pdl_trigger();
  int64_t per_row = 0;
  for (int i = 0; i < p.count; ++i) per_row += int64_t(p.cols[i]) * p.elem_bytes / int64_t(sizeof(U));
  const int64_t total = p.rows * per_row;
  const U* in = static_cast<const U*>(p.in);
  for (int64_t idx = global_thread(); idx < total; idx += grid_stride()) {
    const int64_t r = idx / per_row;
    int64_t c = idx % per_row;
    int i = 0;
    int64_t width = int64_t(p.cols[0]) * p.elem_bytes / int64_t(sizeof(U));
    while (c >= width) {
      c -= width;
      width = int64_t(p.cols[++i]) * p.elem_bytes / int64_t(sizeof(U));
    }
    static_cast<U*>(p.out[i])[r * width + c] = in[idx];
  }
}

// ---- gather_rows ---------------------------------------------------------------------------------

template <bool kVec>
__global__ void gather_rows_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ rows, int num_rows,
                                   int cols, __nv_bfloat16* __restrict__ out) {
  pdl_wait();
  pdl_trigger();
  const int64_t per_row = kVec ? cols / 8 : cols;
  const int64_t total = int64_t(num_rows) * per_row;
  for (int64_t idx = global_thread(); idx < total; idx += grid_stride()) {
    const int64_t r = idx / per_row, c = idx % per_row;
    const int64_t src = rows[r];
    if constexpr (kVec) {
      reinterpret_cast<uint4*>(out + r * cols)[c] = reinterpret_cast<const uint4*>(x + src * cols)[c];
    } else {
      out[r * cols + c] = x[src * cols + c];
    }
  }
}

// ---- argmax --------------------------------------------------------------------------------------

// (value, index) candidates; `better` is a strict order with no ties between distinct indices:
// NaN above every number (as torch.argmax: the first NaN wins), then the larger value, then on equal
// values the smaller index. The empty candidate is (-inf, INT32_MAX): any real element beats it,
// so a row of -inf still yields index 0.
struct Best {
  float value;
  int32_t index;
};

__device__ __forceinline__ bool better(float v, int32_t i, const Best& b) {
  const bool vn = v != v, bn = b.value != b.value;
  if (vn != bn) return vn;
  if (!vn && v != b.value) return v > b.value;
  return i < b.index;
}

__device__ __forceinline__ void consider(Best& b, float v, int32_t i) {
  if (better(v, i, b)) b = {v, i};
}

// The best candidate of a block (every thread passes its own; the result is valid in thread 0).
// The order is total, so the result does not depend on the reduction tree.
__device__ __forceinline__ Best block_best(Best best) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best.value, off);
    const int32_t i = __shfl_xor_sync(0xffffffffu, best.index, off);
    consider(best, v, i);
  }
  __shared__ Best warp_best[kArgmaxThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (warp == 0) {
    best = lane < int(blockDim.x / kWarp) ? warp_best[lane] : Best{-__int_as_float(0x7f800000), INT32_MAX};
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, best.value, off);
      const int32_t i = __shfl_xor_sync(0xffffffffu, best.index, off);
      consider(best, v, i);
    }
  }
  return best;
}

// Pass 1, grid (chunks, rows): the best of chunk blockIdx.x of row blockIdx.y. A decode step has a
// handful of rows of 200k logits: one block per row would leave 131 SMs idle.
template <bool kVec>
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_chunk_kernel(const float* __restrict__ logits, int vocab, Best* __restrict__ partial) {
  pdl_wait();
  pdl_trigger();
  const float* row = logits + int64_t(blockIdx.y) * vocab;
  const int begin = blockIdx.x * kArgmaxChunk, end = min(vocab, begin + kArgmaxChunk);
  Best best{-__int_as_float(0x7f800000), INT32_MAX};
  if constexpr (kVec) {  // begin and end are multiples of 4 (vocab % 4 == 0, kArgmaxChunk % 4 == 0)
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int c = begin / 4 + threadIdx.x; c < end / 4; c += blockDim.x) {
      const float4 v = row4[c];
      consider(best, v.x, 4 * c);
      consider(best, v.y, 4 * c + 1);
      consider(best, v.z, 4 * c + 2);
      consider(best, v.w, 4 * c + 3);
    }
  } else {
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) consider(best, row[i], i);
  }
  best = block_best(best);
  if (threadIdx.x == 0) partial[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = best;
}

// Pass 2, one block per row: the best of the row's chunk winners.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_finish_kernel(const Best* __restrict__ partial, int chunks, int vocab, int32_t* __restrict__ ids,
                         float* __restrict__ values) {
  pdl_wait();
  pdl_trigger();
  Best best{-__int_as_float(0x7f800000), INT32_MAX};
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const Best b = partial[int64_t(blockIdx.x) * chunks + c];
    consider(best, b.value, b.index);
  }
  best = block_best(best);
  if (threadIdx.x == 0) {
    ids[blockIdx.x] = best.index < vocab ? best.index : 0;
    if (values) values[blockIdx.x] = best.value;
  }
}

// One thread a row: the ranks' winners in rank order, so ties go to the lower rank.
__global__ void combine_vocab_argmax_kernel(const int32_t* __restrict__ gathered, int ranks, int rows, int64_t slice,
                                            int32_t* __restrict__ ids) {
  pdl_wait();
  pdl_trigger();
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  Best best{-__int_as_float(0x7f800000), INT32_MAX};
  for (int q = 0; q < ranks; ++q) consider(best, __int_as_float(gathered[(2 * int64_t(q) + 1) * rows + r]), q);
  const int q = best.index < ranks ? best.index : 0;
  ids[r] = int32_t(q * slice + gathered[2 * int64_t(q) * rows + r]);
}

// ---- fill_random ---------------------------------------------------------------------------------

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// `stream_key` = splitmix64(seed ^ key), hashed once on the host.
template <bool kF32>
__global__ void fill_random_kernel(FillRandomParams p, uint64_t stream_key) {
  const int64_t n = p.rows * p.cols;
  for (int64_t i = global_thread(); i < n; i += grid_stride()) {
    const int64_t r = i / p.cols, c = i - r * p.cols;
    const uint64_t bits = splitmix64(stream_key + p.index_offset + uint64_t(r * p.index_row_stride + c));
    // bits >> 40 < 2^24: the conversion and the scaling by 2^-24 are exact.
    const float unit = __fmul_rn(float(uint32_t(bits >> 40)), 1.0f / float(1u << 24));
    // (2.f * unit - 1.f) * 1.7320508f * stddev, evaluated left to right with no FMA, as the host does.
    const float v = __fmul_rn(__fmul_rn(__fadd_rn(__fmul_rn(2.f, unit), -1.f), 1.7320508f), p.stddev);
    const int64_t o = r * p.out_row_stride + c;
    if constexpr (kF32)
      static_cast<float*>(p.out)[o] = v;
    else
      static_cast<__nv_bfloat16*>(p.out)[o] = __float2bfloat16_rn(v);
  }
}

}  // namespace

void launch_embed(const EmbedParams& p, KernelStream on) {
  if (p.num_tokens <= 0 || p.hidden <= 0) return;
  check_arg(p.table && p.token_ids && p.out, "embed: table, token_ids and out must be set");
  const bool vec = p.hidden % 8 == 0 && aligned16(p.table) && aligned16(p.out);
  const int64_t items = int64_t(p.num_tokens) * (vec ? p.hidden / 8 : p.hidden);
  launch_pdl(vec ? embed_kernel<true> : embed_kernel<false>, dim3(grid_for(items)), dim3(kThreads), 0, on, p);
}

void launch_add_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t n, KernelStream on) {
  if (n <= 0) return;
  check_arg(x && y, "add_bf16: x and y must be set");
  const bool vec = n % 8 == 0 && aligned16(x) && aligned16(y);
  launch_pdl(vec ? add_bf16_kernel<true> : add_bf16_kernel<false>, dim3(grid_for(vec ? n / 8 : n)), dim3(kThreads), 0,
             on, x, y, n);
}

void launch_swiglu(const SwigluKernelParams& p, KernelStream on) {
  if (p.rows <= 0 || p.n <= 0) return;
  check_arg(p.gate_up && p.out, "swiglu: gate_up and out must be set");
  // Row starts are 16-byte aligned when n % 8 == 0 (gate_up rows are 4n bytes, out rows 2n).
  const bool vec = p.n % 8 == 0 && aligned16(p.gate_up) && aligned16(p.out);
  const int64_t items = int64_t(p.rows) * (vec ? p.n / 8 : p.n);
  launch_pdl(vec ? swiglu_kernel<true> : swiglu_kernel<false>, dim3(grid_for(items)), dim3(kThreads), 0, on, p);
}

void launch_gather_rows(const __nv_bfloat16* x, const int32_t* rows, int num_rows, int cols, __nv_bfloat16* out,
                        KernelStream on) {
  if (num_rows <= 0 || cols <= 0) return;
  check_arg(x && rows && out, "gather_rows: x, rows and out must be set");
  const bool vec = cols % 8 == 0 && aligned16(x) && aligned16(out);
  const int64_t items = int64_t(num_rows) * (vec ? cols / 8 : cols);
  launch_pdl(vec ? gather_rows_kernel<true> : gather_rows_kernel<false>, dim3(grid_for(items)), dim3(kThreads), 0, on,
             x, rows, num_rows, cols, out);
}

void launch_split_columns(const SplitColumnsParams& p, KernelStream on) {
  check_arg(p.count >= 1 && p.count <= kMaxSplitColumns && p.rows >= 0 && (p.elem_bytes == 2 || p.elem_bytes == 4),
            "split_columns: 1.." + std::to_string(kMaxSplitColumns) + " outputs, rows >= 0, 2- or 4-byte elements");
  check_arg(p.in != nullptr, "split_columns: in must be set");
  // The widest copy unit every output's row and pointer allow: 16 bytes (a layer's projections), else
  // the element.
  bool vec = aligned16(p.in);
  int64_t total_bytes = 0;
  for (int i = 0; i < p.count; ++i) {
    check_arg(p.out[i] != nullptr && p.cols[i] >= 0, "split_columns: output " + std::to_string(i) + " unset");
    vec = vec && aligned16(p.out[i]) && int64_t(p.cols[i]) * p.elem_bytes % 16 == 0;
    total_bytes += int64_t(p.cols[i]) * p.elem_bytes;
  }
  const int unit = vec ? 16 : p.elem_bytes;
  const int64_t items = p.rows * (total_bytes / unit);
  if (items == 0) return;
  if (vec)
    launch_pdl(split_columns_kernel<uint4>, dim3(grid_for(items)), dim3(kThreads), 0, on, p);
  else if (unit == 4)
    launch_pdl(split_columns_kernel<uint32_t>, dim3(grid_for(items)), dim3(kThreads), 0, on, p);
  else
    launch_pdl(split_columns_kernel<uint16_t>, dim3(grid_for(items)), dim3(kThreads), 0, on, p);
}

size_t argmax_workspace_bytes(int rows, int vocab) {
  return size_t(rows) * size_t((vocab + kArgmaxChunk - 1) / kArgmaxChunk) * sizeof(Best);
}

void launch_argmax(const float* logits, int rows, int vocab, int32_t* ids, float* values, void* workspace,
                   size_t workspace_bytes, KernelStream on) {
  if (rows <= 0) return;
  check_arg(vocab > 0, "argmax: vocab must be positive");
  check_arg(logits && ids && workspace, "argmax: logits, ids and workspace must be set");
  check_arg(workspace_bytes >= argmax_workspace_bytes(rows, vocab), "argmax: workspace too small");
  const int chunks = (vocab + kArgmaxChunk - 1) / kArgmaxChunk;
  check_arg(rows <= 65535, "argmax: at most 65535 rows");
  Best* partial = static_cast<Best*>(workspace);
  const dim3 grid{unsigned(chunks), unsigned(rows)};
  const bool vec = vocab % 4 == 0 && aligned16(logits);
  launch_pdl(vec ? argmax_chunk_kernel<true> : argmax_chunk_kernel<false>, grid, dim3(kArgmaxThreads), 0, on, logits,
             vocab, partial);
  launch_pdl(argmax_finish_kernel, dim3(unsigned(rows)), dim3(kArgmaxThreads), 0, on, static_cast<const Best*>(partial),
             chunks, vocab, ids, values);
}

void launch_combine_vocab_argmax(const int32_t* gathered, int ranks, int rows, int64_t slice, int32_t* ids,
                                 KernelStream on) {
  if (rows <= 0) return;
  check_arg(gathered && ids && ranks > 0 && slice > 0, "combine_vocab_argmax: gathered, ids, ranks and slice");
  constexpr int kRowsPerBlock = 128;
  launch_pdl(combine_vocab_argmax_kernel, dim3(unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock)),
             dim3(kRowsPerBlock), 0, on, gathered, ranks, rows, slice, ids);
}

void launch_fill_random(const FillRandomParams& p, cudaStream_t stream) {
  const int64_t n = p.rows * p.cols;
  if (n <= 0) return;
  check_arg(p.out != nullptr, "fill_random: out must be set");
  check_arg(p.out_row_stride >= p.cols && p.index_row_stride >= p.cols, "fill_random: row strides below cols");
  const uint64_t stream_key = splitmix64(p.seed ^ p.key);
  if (p.out_f32)
    fill_random_kernel<true><<<grid_for(n), kThreads, 0, stream>>>(p, stream_key);
  else
    fill_random_kernel<false><<<grid_for(n), kThreads, 0, stream>>>(p, stream_key);
  CUDA_CHECK_LAUNCH();
}

}  // namespace tpmoe::cuda
