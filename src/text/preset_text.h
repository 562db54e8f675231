// The text side of the built-in presets: a tokenizer (make_preset_tokenizer_json, tokenizer.h), a
// chat template in MiniMax M2/M3's format with the preset tokenizer's role markers, and the
// special tokens a template sees. `make-model` writes them next to the weights, and the embedded
// default model uses them, so text works out of the box.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace tpmoe::text {

// `]~!b[` begins the conversation, `]~b]ROLE\n` starts a message and `[e~[` ends it (MiniMax's
// markers); an assistant turn is role "ai" and opens with <think> when a reply is asked for.
std::string preset_chat_template();

// bos_token / eos_token as tokenizer_config.json would list them for the preset tokenizer.
nlohmann::ordered_json preset_special_tokens();

// The token ids generation stops at for the preset tokenizer: end of message and end of text.
inline constexpr const char* kPresetEosTokens[] = {"[e~[", "<|endoftext|>"};

}  // namespace tpmoe::text
