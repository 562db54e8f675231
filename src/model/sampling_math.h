// The arithmetic of drawing one token, shared bit for bit by the CPU sampling op (the reference)
// and the CUDA kernel: the counter-based RNG (Philox4x32-10), Gumbel noise, exp/log built from
// basic IEEE operations, the penalised score of a logit and the fixed-point weights top-p sums.
//
// Why everything is exact: every value a draw depends on is produced by correctly rounded IEEE
// operations (+ - * /, int<->float conversion, floor) in a fixed order, never by a library exp/log
// whose last bit differs between glibc and CUDA, and never by a float sum whose order differs
// between a loop and a parallel reduction: top-p sums 64-bit fixed-point weights (integer addition
// is associative). So the CPU op and the CUDA kernel return the same token for the same inputs,
// not merely the same distribution. On the device the helpers use the __f*_rn intrinsics, which
// nvcc never contracts into FMAs; on the host this relies on the default x86-64 target having no
// FMA (the same assumption presets.cpp's random_value makes): a build with -march=haswell or later
// would also need -ffp-contract=off for this file's users.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define TPMOE_HD __host__ __device__ __forceinline__
#else
#define TPMOE_HD inline
#endif

namespace tpmoe::sampling {

// A token whose score is more than 22 below the row's maximum is never drawn: Gumbel noise from a
// 23-bit uniform lies in [-2.81, 16.64], so the maximum's perturbed score beats it by at least
// 22 - 19.45. Such tokens are dropped before the filters (the "candidates" are the rest), and their
// top-p weight exp(-22) * 2^32 < 2 is negligible against the maximum's 2^32.
constexpr float kCandidateCut = -22.0f;
constexpr float kWeightScale = 4294967296.0f;    // top-p weights: floor(exp(score - max) * 2^32)
constexpr uint32_t kPhiloxDomain = 0x53414d50u;  // "SAMP": the counter's third word

// One row as the op consumes it (built from SampleRowParams by make_sample_row_args, the same way
// for every backend). POD, uploaded as is to the device.
struct SampleRowArgs {
  float temperature;  // 1 on greedy rows (no division)
  float top_p;        // 1: off
  float log_min_p;    // keep d = score - max >= log_min_p; -inf: off
  float repetition_penalty, presence_penalty, frequency_penalty;
  int32_t top_k;  // 0: off
  uint32_t step;
  uint32_t seed_lo, seed_hi;
  int32_t penalty_begin, penalty_end;  // the row's entries in the batch's penalty arrays
  int32_t greedy;
  int32_t pad;
};

// ---- exactly rounded basic operations (never fused) -----------------------------------------------

TPMOE_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TPMOE_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TPMOE_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TPMOE_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TPMOE_HD uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
#endif
}
TPMOE_HD float bits_float(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, 4);
  return x;
#endif
}
TPMOE_HD bool is_nan(float x) { return x != x; }
TPMOE_HD float neg_inf() { return bits_float(0xff800000u); }

// Larger float -> larger key; -0 and +0 differ, so scores are canonicalised (+0) before keys are taken.
TPMOE_HD uint32_t order_key(float x) {
  const uint32_t b = float_bits(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// ---- Philox4x32-10 (Salmon et al., SC'11), keyed by the seed, counter (token/4, step, domain, 0) ----

struct U32x4 {
  uint32_t v[4];
};

TPMOE_HD U32x4 philox4x32_10(U32x4 c, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c.v[0], p1 = uint64_t(0xCD9E8D57u) * c.v[2];
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0), hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    c = U32x4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// ---- log and exp from basic operations ------------------------------------------------------------

// Natural log of a positive normal float (the inputs here lie in [2^-24, 17]): x = m 2^e with
// m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m-1)/(m+1), |s| < 0.172, odd series to s^9
// (truncation < 1e-9). About 2 ulp; what matters is that it is the same on every backend.
TPMOE_HD float log_positive(float x) {
  const uint32_t b = float_bits(x);
  int e = int(b >> 23) - 127;
  float m = bits_float((b & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  if (m > 1.41421356f) {
    m = mul_rn(m, 0.5f);
    e += 1;
  }
  const float f = sub_rn(m, 1.0f);  // exact (Sterbenz)
  const float s = div_rn(f, add_rn(2.0f, f));
  const float z = mul_rn(s, s);
  float poly = 1.0f / 9.0f;
  poly = add_rn(mul_rn(poly, z), 1.0f / 7.0f);
  poly = add_rn(mul_rn(poly, z), 1.0f / 5.0f);
  poly = add_rn(mul_rn(poly, z), 1.0f / 3.0f);
  poly = add_rn(mul_rn(poly, z), 1.0f);
  const float log_m = mul_rn(mul_rn(2.0f, s), poly);
  // e * ln2 in two parts: e * kLn2Hi is exact for |e| < 2^9 (kLn2Hi has 15 significant bits).
  const float fe = float(e);
  return add_rn(add_rn(mul_rn(fe, 0.693145751953125f), mul_rn(fe, 1.42860677e-06f)), log_m);
}

// exp(d) for d in [kCandidateCut, 0]: d = n ln2 + r, |r| <= ln2/2, Taylor to r^7 (truncation < 1e-8
// relative), times 2^n built from bits.
TPMOE_HD float exp_nonpositive(float d) {
#ifdef __CUDA_ARCH__
  const float n = floorf(add_rn(mul_rn(d, 1.44269504f), 0.5f));
#else
  const float n = __builtin_floorf(add_rn(mul_rn(d, 1.44269504f), 0.5f));
#endif
  const float r = sub_rn(sub_rn(d, mul_rn(n, 0.693145751953125f)), mul_rn(n, 1.42860677e-06f));
  float p = 1.0f / 5040.0f;
  p = add_rn(mul_rn(p, r), 1.0f / 720.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 120.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 24.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 6.0f);
  p = add_rn(mul_rn(p, r), 0.5f);
  p = add_rn(mul_rn(p, r), 1.0f);
  p = add_rn(mul_rn(p, r), 1.0f);
  return mul_rn(p, bits_float(uint32_t(int(n) + 127) << 23));
}

// ---- the pieces of a draw ----------------------------------------------------------------------

// Gumbel noise of token `token` at the row's (seed, step): u in (0, 1) on the 2^23 odd multiples of
// 2^-24 (exact in float), g = -log(-log(u)).
TPMOE_HD float gumbel_noise(const SampleRowArgs& a, uint32_t token) {
  const U32x4 r = philox4x32_10(U32x4{{token >> 2, a.step, kPhiloxDomain, 0u}}, a.seed_lo, a.seed_hi);
  const uint32_t bits = r.v[token & 3u];
  const float u = mul_rn(float((bits >> 9) * 2u + 1u), 5.9604644775390625e-08f);  // * 2^-24
  return -log_positive(-log_positive(u));
}

// The score a logit competes with: penalties (count: times generated, 0: seen in the prompt only,
// -1: not seen), then temperature. Greedy rows keep NaN (it wins, as in torch.argmax); sampled rows
// never draw a NaN (it becomes -inf). -0 becomes +0 so equal scores have equal keys.
TPMOE_HD float row_score(float x, int32_t count, const SampleRowArgs& a) {
  if (count >= 0) {
    if (a.repetition_penalty != 1.0f) x = x > 0.0f ? div_rn(x, a.repetition_penalty) : mul_rn(x, a.repetition_penalty);
    if (count > 0) {
      x = sub_rn(x, mul_rn(a.frequency_penalty, float(count)));
      x = sub_rn(x, a.presence_penalty);
    }
  }
  if (!a.greedy) {
    x = div_rn(x, a.temperature);
    if (is_nan(x)) x = neg_inf();
  }
  return add_rn(x, 0.0f);
}

// The argmax order (torch.argmax): NaN above every number, then the larger value, then on equal
// values the smaller index. A strict total order, so any reduction order gives the same winner.
TPMOE_HD bool better(float v, int32_t i, float best_v, int32_t best_i) {
  const bool vn = is_nan(v), bn = is_nan(best_v);
  if (vn != bn) return vn;
  if (!vn && v != best_v) return v > best_v;
  return i < best_i;
}

// Top-p weight of a candidate from e = exp_nonpositive(score - max), score - max in [kCandidateCut, 0].
TPMOE_HD uint64_t weight_from_exp(float e) { return uint64_t(mul_rn(e, kWeightScale)); }
TPMOE_HD uint64_t top_p_weight(float d) { return weight_from_exp(exp_nonpositive(d)); }

// Top-p keeps the tokens above a threshold key t: the largest t with W(key >= t) >= this target,
// where W sums the weights of what top-k kept and total is that sum. ceil(top_p * total): for an
// integer W, W >= top_p * total exactly when W >= the ceiling. total < 2^53, so the double is exact.
TPMOE_HD uint64_t top_p_target(float top_p, uint64_t total) {
  const double t = double(top_p) * double(total);
  uint64_t c = uint64_t(t);
  if (double(c) < t) ++c;
  return c < 1 ? 1 : c;
}

}  // namespace tpmoe::sampling
