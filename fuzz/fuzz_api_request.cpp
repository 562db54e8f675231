// libFuzzer target: the input is an HTTP request body for /v1/completions and /v1/chat/completions.
// Reading it must give an ApiRequest or throw ApiError (the 4xx the server sends); any other
// exception, a crash or a sanitizer report is a finding. A request that reads must also survive
// what the server does with it next: its conversation and tools copied and dumped as JSON.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "serve/openai_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tpmoe::serve;
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  Json j;
  try {
    j = parse_json_body(body);
  } catch (const ApiError&) {
    return 0;
  }
  for (const Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    try {
      const ApiRequest r = parse_api_request(endpoint, j);
      const ApiRequest copy = r;
      (void)copy.chat.messages.dump();
      (void)copy.chat.tools.dump();
      (void)copy.chat.extra.dump();
    } catch (const ApiError&) {
    }
  }
  return 0;
}
