// What makes a model speak text (the command line, the server): its tokenizer, its chat template, the special
// tokens the template sees and the ids generation stops at. A checkpoint folder provides them as
// Hugging Face lays them out (tokenizer.json, chat_template.jinja or tokenizer_config.json); a
// preset gets the preset tokenizer and template (src/text/preset_text.h).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace tpmoe::text {

struct TextModel {
  explicit TextModel(Tokenizer t) : tokenizer(std::move(t)) {}

  Tokenizer tokenizer;
  std::optional<ChatTemplate> chat_template;  // absent: the folder has none (chat is an error)
  std::string chat_template_error;            // why it is absent
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
  std::vector<int32_t> eos_ids;  // config.json's eos_token_id, else the tokenizer's eos token

  // The prompt text of a conversation, rendered with the model's template (a reply asked for).
  std::string render_chat(const ChatRequest& request) const;
};

// `model_dir` empty: the preset tokenizer and template for a vocabulary of `vocab_size`.
TextModel load_text_model(const std::string& model_dir, int vocab_size, const std::vector<int32_t>& config_eos);

// Writes the preset's tokenizer.json, chat_template.jinja and tokenizer_config.json into `dir`.
void write_preset_text_files(const std::string& dir, int vocab_size);
// The preset tokenizer's stop ids (end of message, end of text).
std::vector<int32_t> preset_eos_ids(int vocab_size);

}  // namespace tpmoe::text
