// libFuzzer target for config.json parsing: any bytes must either give a valid ModelConfig or a
// tpmoe::Error; anything else (another exception, a crash, a sanitizer report) is a finding.
// A config that parses must also survive both output forms unchanged, which checks that
// to_json() and from_json() agree on every field and alias.
#include <cstddef>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using json = nlohmann::json;
  using tpmoe::ModelConfig;
  // No exceptions from the JSON layer: malformed text is not what this target is testing.
  const json j = json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  ModelConfig config;
  try {
    config = ModelConfig::from_json(j, "fuzz");
  } catch (const tpmoe::Error&) {
    return 0;
  }
  const json canonical = config.to_json(ModelConfig::JsonForm::kText);
  for (auto form : {ModelConfig::JsonForm::kText, ModelConfig::JsonForm::kMultimodalLegacy}) {
    // Through text, as a real file would go; a throw here escapes and is reported as a finding.
    const json again = json::parse(config.to_json(form).dump());
    if (ModelConfig::from_json(again, "fuzz round trip").to_json() != canonical) __builtin_trap();
  }
  return 0;
}
