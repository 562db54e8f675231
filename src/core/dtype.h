// Element types of stored tensors, and exact conversions to the fp32 the CPU oracle computes in.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace tpmoe {

enum class DType : uint8_t { kBF16, kF16, kF32, kF64, kI64, kI32, kI16, kI8, kU8, kBool };

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

}  // namespace tpmoe
