// One token's routing by one warp (SPEC §1.8), shared by the router kernel and the single-token MoE
// kernels that route inside themselves (moe_gemv.cu): the same code, so both give the same bits.
// Device code only.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backends/cuda/moe.cuh"

namespace tpmoe::cuda {

constexpr int kRouteMaxPerLane = 8;  // num_experts <= 32 * 8

// Lane r < top_k ends with the r-th choice: its expert id and its weight (sigmoid score renormalised
// over the k chosen). Choices by score + bias (the bias only chooses; NaN as -inf), ties to the lower
// id, as the CPU oracle; fp32 sigmoid with precise expf. All 32 lanes must call it.
struct RouteChoice {
  int id = 0;
  float weight = 0.f;
};
__device__ inline RouteChoice route_top_k(const RouteKernelParams& p, int token, int lane) {
  const int E = p.num_experts;
  const float* logits = p.logits + size_t(token) * E;
  // Every load first, then the arithmetic: one trip to memory for all of them. Loads inside an
  // `e < E` branch, each next to its use, went one after another (a logit, its sigmoid, the bias,
  // the next logit: 2 * E / 32 trips), ~30% of a warp's time in the single-token down GEMV at the
  // tp-8 width under Nsight Compute (docs/PERF.md). Lanes past E read expert E - 1 and are dropped.
  float logit[kRouteMaxPerLane], bias[kRouteMaxPerLane];
#pragma unroll
  for (int i = 0; i < kRouteMaxPerLane; ++i) {
    const int e = min(lane + 32 * i, E - 1);
    logit[i] = logits[e];
    bias[i] = p.bias[e];
  }
  float score[kRouteMaxPerLane], choice[kRouteMaxPerLane];
#pragma unroll
  for (int i = 0; i < kRouteMaxPerLane; ++i) {
    const bool live = lane + 32 * i < E;
    score[i] = live ? 1.f / (1.f + expf(-logit[i])) : 0.f;
    // A NaN choice (a NaN logit or bias) ranks as -inf, below every number and tied with -inf, as in
    // the oracle. The scan below never takes a NaN: a token of NaNs would end with id 0x7fffffff, a row
    // far past the weights.
    const float c = score[i] + bias[i];
    choice[i] = live && !isnan(c) ? c : -INFINITY;
  }

  uint32_t taken = 0;  // bit i: expert lane + 32*i already chosen
  RouteChoice mine;
  float sum = 0.f;
  for (int r = 0; r < p.top_k; ++r) {
    float best_v = -INFINITY, best_s = 0.f;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kRouteMaxPerLane; ++i) {
      const int e = lane + 32 * i;
      // Ids rise with i, so among equal values the first one seen (the lower id) is kept.
      if (e < E && !((taken >> i) & 1u) && (choice[i] > best_v || (choice[i] == best_v && e < best_e))) {
        best_v = choice[i];
        best_s = score[i];
        best_e = e;
      }
    }
    // Butterfly: every lane ends with the same (value, id); ties to the lower id.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, off);
      const float os = __shfl_xor_sync(0xffffffffu, best_s, off);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
      if (ov > best_v || (ov == best_v && oe < best_e)) {
        best_v = ov;
        best_s = os;
        best_e = oe;
      }
    }
    if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
    if (lane == r) {
      mine.id = best_e;
      mine.weight = best_s;
    }
    sum += best_s;  // in choice order, as the oracle
  }
  mine.weight /= sum;
  return mine;
}

// Writes token's slots as the router kernel does: the top_k choices (lane r holds choice r), then
// the shared ids E..E+n-1 with shared_weight, and the routing statistics. All 32 lanes call it.
__device__ inline void store_route(const RouteKernelParams& p, int token, const RouteChoice& c, int lane) {
  const int slots = p.top_k + p.num_shared;
  int32_t* ids = p.slot_ids + size_t(token) * slots;
  float* w = p.slot_weights + size_t(token) * slots;
  if (lane < p.top_k) {
    ids[lane] = c.id;
    w[lane] = c.weight;
    // Routing statistics: mark the experts the step's real tokens chose (the count is read on the
    // device, so a recorded step counts each replay's own).
    if (p.routed_flags && token < *p.num_real_tokens) p.routed_flags[c.id] = 1;
  }
  for (int i = lane; i < p.num_shared; i += 32) {
    ids[p.top_k + i] = p.num_experts + i;
    w[p.top_k + i] = p.shared_weight;
  }
}

// The expert row of slot s of a token whose choices are `c` (lane r holding choice r): a routed
// choice, or a shared row. All 32 lanes call it.
__device__ inline int route_slot_row(const RouteKernelParams& p, const RouteChoice& c, int s) {
  const int chosen = __shfl_sync(0xffffffffu, c.id, s < p.top_k ? s : 0);
  return s < p.top_k ? chosen : p.num_experts + (s - p.top_k);
}

}  // namespace tpmoe::cuda
