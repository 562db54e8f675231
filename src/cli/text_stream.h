// The command line's text streaming: a GenerateRequest's reply printed as tokens arrive.
#pragma once

#include <functional>
#include <string>

#include "text/tokenizer.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe::cli {

// Streams each sequence's text as tokens arrive: fills req.detokenize (a streaming decoder per
// sequence, holding back incomplete UTF-8) and req.on_text (calls `sink`).
void attach_text_stream(GenerateRequest& req, const text::Tokenizer& tokenizer,
                        std::function<void(int sequence, const std::string& text)> sink);

}  // namespace tpmoe::cli
