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
    {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},        {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},   {DType::kI64, "I64", 8},        {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},   {DType::kI8, "I8", 1},          {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1}, {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E8M0, "F8_E8M0", 1},
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

float fp8_e4m3_to_f32(uint8_t v) {
  const uint32_t sign = v >> 7, exp = (v >> 3) & 0xfu, mant = v & 0x7u;
  float mag;
  if (exp == 0xf && mant == 0x7)
    mag = NAN;
  else if (exp == 0)
    mag = std::ldexp(float(mant), -9);  // subnormal or zero: mant/8 * 2^-6
  else
    mag = std::ldexp(float(mant | 0x8u), int(exp) - 10);  // (1 + mant/8) * 2^(exp-7)
  return sign ? -mag : mag;
}

uint8_t f32_to_fp8_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= 448.f) return sign | 0x7e;  // saturate (448 = 0.1111.110)
  // Every e4m3 value is a multiple of its binade's step; the step of [2^e, 2^(e+1)) is 2^(e-3),
  // subnormals (below 2^-6) share the step 2^-9. Round a / step to the nearest even integer.
  int e = a > 0 ? std::ilogb(a) : -6;
  if (e < -6) e = -6;
  const float step = std::ldexp(1.f, e - 3);
  const float q = std::nearbyint(a / step);  // default rounding mode: to nearest even
  float r = q * step;
  // Encode r, which may have rounded up into the next binade (still <= 448).
  if (r == 0) return sign;
  int re = std::ilogb(r);
  if (re < -6) return sign | uint8_t(int(std::ldexp(r, 9)));  // subnormal: mant = r / 2^-9
  const int mant = int(std::ldexp(r, 3 - re)) - 8;
  return sign | uint8_t(((re + 7) << 3) | mant);
}

float e8m0_to_f32(uint8_t s) { return s == kE8M0Nan ? NAN : std::ldexp(1.f, int(s) - 127); }

}  // namespace tpmoe
