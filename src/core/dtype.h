// Element types of stored tensors, and exact conversions to the fp32 the CPU oracle computes in.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace tpmoe {

// kF8E4M3: float8_e4m3fn (MXFP8 weights); kF8E8M0: a biased power-of-two exponent (MXFP8 block
// scales when saved as torch.float8_e8m0fnu rather than uint8).
enum class DType : uint8_t { kBF16, kF16, kF32, kF64, kI64, kI32, kI16, kI8, kU8, kBool, kF8E4M3, kF8E8M0 };

// Bytes per element.
size_t dtype_size(DType t);
// Safetensors spelling ("BF16", "F32", "I64", ...).
std::string_view dtype_name(DType t);
// Parses the safetensors spelling; nullopt for a name tpmoe does not know.
std::optional<DType> parse_dtype(std::string_view name);

// bf16 is the top half of an fp32: widening is exact.
inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, NaN kept NaN (as torch and the CUDA intrinsics do).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

float f16_to_f32(uint16_t v);

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN,
// largest finite 448. Widening is exact.
float fp8_e4m3_to_f32(uint8_t v);
// Round to nearest even, saturating finite values beyond 448 to +-448 (as quantizers clamp before
// the cast); NaN stays NaN.
uint8_t f32_to_fp8_e4m3(float f);

// MXFP8 block scale: a biased E8M0 exponent, 2^(s - 127); 255 is NaN.
inline constexpr int kMxfp8BlockSize = 32;
inline constexpr uint8_t kE8M0Nan = 255;
float e8m0_to_f32(uint8_t s);

}  // namespace tpmoe
