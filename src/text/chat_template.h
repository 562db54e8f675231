// Chat templates: a conversation (messages, tools) rendered to prompt text with the model's own
// template, as Hugging Face's `apply_chat_template` does, in C++ with no Python at run time.
//
// The template is Jinja2 source (`chat_template.jinja`, or `chat_template` in tokenizer_config.json);
// text/jinja_*.{h,cpp} interpret the subset of Jinja2 chat templates use, configured as Hugging Face
// configures it (trim_blocks, lstrip_blocks, loop controls, `tojson` without HTML escaping and with
// ensure_ascii=False, raise_exception, strftime_now, an immutable sandbox).
//
// Key order matters (json.dumps prints dicts in insertion order), so the API takes
// nlohmann::ordered_json.
#pragma once

#include <nlohmann/json.hpp>

#include <ctime>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

namespace tpmoe::text {

namespace jinja {
struct Program;
}

struct ChatRenderOptions {
  // The time strftime_now() formats (local time); unset: now. Tests pin it.
  std::optional<std::time_t> now;
};

class ChatTemplate {
 public:
  // Parses the template; a syntax error throws tpmoe::Error naming line and column.
  static ChatTemplate parse(std::string source);

  // Renders with `context` (a JSON object) as the template's variables: what Hugging Face passes is
  // messages, tools, add_generation_prompt, bos_token, eos_token and any extra kwargs (see
  // make_chat_context). A template error throws tpmoe::Error naming the template line;
  // raise_exception(msg) in the template throws tpmoe::Error carrying msg.
  std::string render(const nlohmann::ordered_json& context, const ChatRenderOptions& options = {}) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::shared_ptr<const jinja::Program> program_;
};

// What a model directory says about its chat template.
struct ChatTemplateFiles {
  std::string source;  // the template text
  std::string origin;  // the file it came from, for messages
  // Special tokens from tokenizer_config.json (bos_token, eos_token, unk_token, pad_token, ...), as
  // strings; a token that is null or absent there is absent here (Hugging Face passes only set ones).
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
};

// Finds the chat template of a Hugging Face model directory: chat_template.jinja, else
// chat_template.json's "chat_template", else tokenizer_config.json's "chat_template" (a string, or a
// list of {"name", "template"} from which `name` is picked: "default" unless given). Throws
// tpmoe::Error naming the directory when there is none.
ChatTemplateFiles load_chat_template(const std::filesystem::path& model_dir, const std::string& name = "");

// One chat request: the arguments of apply_chat_template.
struct ChatRequest {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;  // null: no tools (the template sees `tools` as None)
  bool add_generation_prompt = true;
  // Extra template variables (enable_thinking, thinking_mode, ...); they override the special tokens.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
};

// The variables Hugging Face's apply_chat_template gives a template: messages, tools, documents
// (None), add_generation_prompt, the special tokens, then the extra kwargs.
nlohmann::ordered_json make_chat_context(const ChatRequest& request, const nlohmann::ordered_json& special_tokens);

// Parses a request from JSON: either a list of messages, or an object with "messages" and optional
// "tools", "add_generation_prompt" and any other keys (passed to the template as extra variables).
ChatRequest parse_chat_request(const nlohmann::ordered_json& j);

// The CLI hook: the prompt text for `request` with the chat template of `model_dir`.
std::string apply_chat_template(const std::filesystem::path& model_dir, const ChatRequest& request,
                                const ChatRenderOptions& options = {});

}  // namespace tpmoe::text
