#include "cli/text_stream.h"

#include <memory>
#include <vector>

namespace tpmoe::cli {

void attach_text_stream(GenerateRequest& req, const text::Tokenizer& tokenizer,
                        std::function<void(int, const std::string&)> sink) {
  auto decoders = std::make_shared<std::vector<text::StreamDecoder>>();
  for (size_t b = 0; b < req.prompts.size(); ++b) decoders->emplace_back(tokenizer);
  req.detokenize = [decoders](int b, int32_t id) { return (*decoders)[size_t(b)].push(id); };
  req.on_text = std::move(sink);
}

}  // namespace tpmoe::cli
