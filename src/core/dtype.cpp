#include "core/dtype.h"

#include <cmath>

namespace tpmoe {

namespace {
struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},   {DType::kF32, "F32", 4}, {DType::kF64, "F64", 8},
    {DType::kI64, "I64", 8},   {DType::kI32, "I32", 4},   {DType::kI16, "I16", 2}, {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},     {DType::kBool, "BOOL", 1},
};
}  // namespace

size_t dtype_size(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.size;
  return 0;
}

std::string_view dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.type;
  return std::nullopt;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float mag;
  if (exp == 0)
    mag = std::ldexp(float(mant), -24);  // subnormal or zero
  else if (exp == 31)
    mag = mant ? NAN : INFINITY;  // NaN or inf
  else
    mag = std::ldexp(float(mant | 0x400u), int(exp) - 25);  // normal
  return sign ? -mag : mag;
}

}  // namespace tpmoe
