// libFuzzer target: the input is a whole safetensors file image. tpmoe::Error is the expected way to
// reject it; any other exception, crash or sanitizer report is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    tpmoe::io::parse_safetensors_header({reinterpret_cast<const std::byte*>(data), size}, "fuzz.safetensors");
  } catch (const tpmoe::Error&) {
  }
  return 0;
}
