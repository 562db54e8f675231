#include "text/text_model.h"

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "text/preset_text.h"

namespace tpmoe::text {

namespace fs = std::filesystem;

std::string TextModel::render_chat(const ChatRequest& request) const {
  TPMOE_CHECK(chat_template.has_value(), "chat: {}", chat_template_error);
  return chat_template->render(make_chat_context(request, special_tokens));
}

TextModel load_text_model(const std::string& model_dir, int vocab_size, const std::vector<int32_t>& config_eos) {
  if (model_dir.empty()) {
    TextModel m(Tokenizer::from_json(make_preset_tokenizer_json(vocab_size), "the preset tokenizer"));
    m.chat_template = ChatTemplate::parse(preset_chat_template());
    m.special_tokens = preset_special_tokens();
    m.eos_ids = preset_eos_ids(vocab_size);
    return m;
  }
  TPMOE_CHECK(fs::exists(fs::path(model_dir) / "tokenizer.json"),
              "{}: no tokenizer.json, so the model cannot take or give text (add the model's tokenizer.json; "
              "generate also takes token ids: --prompt-ids)",
              model_dir);
  TextModel m(Tokenizer::from_file(model_dir));
  try {
    const ChatTemplateFiles files = load_chat_template(model_dir);
    m.chat_template = ChatTemplate::parse(files.source);
    m.special_tokens = files.special_tokens;
  } catch (const Error& e) {
    m.chat_template_error = e.what();
  }
  m.eos_ids = config_eos;
  if (m.eos_ids.empty() && m.special_tokens.contains("eos_token") && m.special_tokens["eos_token"].is_string())
    if (auto id = m.tokenizer.token_to_id(m.special_tokens["eos_token"].get<std::string>())) m.eos_ids.push_back(*id);
  for (int32_t id : m.eos_ids)
    TPMOE_CHECK(m.tokenizer.is_valid_id(id), "{}: eos_token_id {} is not in tokenizer.json's vocabulary", model_dir,
                id);
  return m;
}

std::vector<int32_t> preset_eos_ids(int vocab_size) {
  const auto tok = Tokenizer::from_json(make_preset_tokenizer_json(vocab_size), "the preset tokenizer");
  std::vector<int32_t> ids;
  for (const char* name : kPresetEosTokens) ids.push_back(tok.token_to_id(name).value());
  return ids;
}

void write_preset_text_files(const std::string& dir, int vocab_size) {
  auto write = [&](const char* name, const std::string& text) {
    std::ofstream out(fs::path(dir) / name, std::ios::binary);
    out << text;
    TPMOE_CHECK(out.good(), "{}: cannot write {}", dir, name);
  };
  write("tokenizer.json", make_preset_tokenizer_json(vocab_size));
  write("chat_template.jinja", preset_chat_template());
  nlohmann::ordered_json config = preset_special_tokens();
  config["tokenizer_class"] = "PreTrainedTokenizerFast";
  write("tokenizer_config.json", config.dump(2) + "\n");
}

}  // namespace tpmoe::text
