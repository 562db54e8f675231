// Chat templates: parsing and rendering through the Jinja interpreter, finding a model's template and
// special tokens, and building the variables Hugging Face's apply_chat_template passes.
#include "text/chat_template.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "text/jinja_ast.h"

namespace tpmoe::text {

ChatTemplate ChatTemplate::parse(std::string source) {
  ChatTemplate t;
  try {
    t.program_ = jinja::parse(source);
  } catch (const jinja::RuntimeError& e) {  // e.g. invalid UTF-8 met while decoding a literal
    TPMOE_FAIL("chat template syntax error: {}", e.message);
  }
  t.source_ = std::move(source);
  return t;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context, const ChatRenderOptions& options) const {
  TPMOE_CHECK(program_, "chat template: render() called on a template that was not parsed");
  TPMOE_CHECK(context.is_object(), "chat template context must be a JSON object, got {}", context.type_name());
  jinja::Value vars;
  try {
    vars = jinja::from_json(context);
  } catch (const jinja::RuntimeError& e) {
    TPMOE_FAIL("chat template context: {}", e.message);
  }
  jinja::RenderOptions render_options;
  render_options.now = options.now;
  return jinja::render(*program_, *vars.as_dict(), render_options);
}

namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TPMOE_CHECK(in, "{}: cannot open", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::ordered_json read_json(const std::filesystem::path& path) {
  try {
    return nlohmann::ordered_json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    TPMOE_FAIL("{}: invalid JSON: {}", path.string(), e.what());
  }
}

// A special token as tokenizer_config.json writes it: a string, or an AddedToken {"content": ...}.
std::optional<std::string> token_string(const nlohmann::ordered_json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) return j["content"].get<std::string>();
  return std::nullopt;
}

std::string pick_template(const nlohmann::ordered_json& value, const std::string& name, const std::string& where) {
  if (value.is_string()) {
    TPMOE_CHECK(name.empty() || name == "default",
                "{}: chat_template is a single template; there is no template named '{}'", where, name);
    return value.get<std::string>();
  }
  TPMOE_CHECK(value.is_array(), "{}: chat_template must be a string or a list of {{\"name\", \"template\"}}, got {}",
              where, value.type_name());
  const std::string want = name.empty() ? "default" : name;
  std::string names;
  for (const auto& entry : value) {
    TPMOE_CHECK(entry.is_object() && entry.contains("name") && entry.contains("template") &&
                    entry["name"].is_string() && entry["template"].is_string(),
                "{}: each chat_template entry must be {{\"name\": string, \"template\": string}}", where);
    if (entry["name"] == want) return entry["template"].get<std::string>();
    names += (names.empty() ? "" : ", ") + entry["name"].get<std::string>();
  }
  TPMOE_FAIL("{}: no chat template named '{}' (have: {})", where, want, names);
}

}  // namespace

ChatTemplateFiles load_chat_template(const std::filesystem::path& model_dir, const std::string& name) {
  TPMOE_CHECK(std::filesystem::is_directory(model_dir), "{}: not a directory", model_dir.string());
  ChatTemplateFiles files;
  const auto config_path = model_dir / "tokenizer_config.json";
  nlohmann::ordered_json config;
  if (std::filesystem::exists(config_path)) {
    config = read_json(config_path);
    TPMOE_CHECK(config.is_object(), "{}: expected a JSON object", config_path.string());
    for (const auto& [key, value] : config.items()) {
      const bool is_token_field = key.size() > 6 && key.compare(key.size() - 6, 6, "_token") == 0;
      if (!is_token_field) continue;
      if (auto s = token_string(value)) files.special_tokens[key] = *s;
    }
  }
  const auto jinja_path = model_dir / "chat_template.jinja";
  const auto json_path = model_dir / "chat_template.json";
  if (std::filesystem::exists(jinja_path)) {
    TPMOE_CHECK(name.empty() || name == "default", "{}: holds a single template; there is no template named '{}'",
                jinja_path.string(), name);
    files.source = read_file(jinja_path);
    files.origin = jinja_path.string();
  } else if (std::filesystem::exists(json_path)) {
    const auto j = read_json(json_path);
    TPMOE_CHECK(j.is_object() && j.contains("chat_template"), "{}: no \"chat_template\" key", json_path.string());
    files.source = pick_template(j["chat_template"], name, json_path.string());
    files.origin = json_path.string();
  } else if (config.is_object() && config.contains("chat_template") && !config["chat_template"].is_null()) {
    files.source = pick_template(config["chat_template"], name, config_path.string());
    files.origin = config_path.string();
  } else {
    TPMOE_FAIL(
        "{}: no chat template (looked for chat_template.jinja, chat_template.json and \"chat_template\" in "
        "tokenizer_config.json)",
        model_dir.string());
  }
  return files;
}

nlohmann::ordered_json make_chat_context(const ChatRequest& request, const nlohmann::ordered_json& special_tokens) {
  TPMOE_CHECK(request.messages.is_array(), "chat request: messages must be a list, got {}",
              request.messages.type_name());
  TPMOE_CHECK(request.tools.is_null() || request.tools.is_array(), "chat request: tools must be a list, got {}",
              request.tools.type_name());
  TPMOE_CHECK(request.extra.is_object(), "chat request: extra variables must be an object");
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = request.messages;
  context["tools"] = request.tools;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = request.add_generation_prompt;
  for (const auto& [k, v] : special_tokens.items()) context[k] = v;
  for (const auto& [k, v] : request.extra.items()) context[k] = v;
  return context;
}

ChatRequest parse_chat_request(const nlohmann::ordered_json& j) {
  ChatRequest request;
  TPMOE_CHECK(j.is_array() || j.is_object(),
              "chat request must be a list of messages or an object with \"messages\", got {}", j.type_name());
  TPMOE_CHECK(j.is_array() || j.contains("messages"), "chat request has no \"messages\"");
  if (j.is_array()) request.messages = j;
  if (j.is_object()) {
    for (const auto& [k, v] : j.items()) {
      if (k == "messages") {
        request.messages = v;
      } else if (k == "tools") {
        request.tools = v;
      } else if (k == "add_generation_prompt") {
        TPMOE_CHECK(v.is_boolean(), "chat request: add_generation_prompt must be true or false");
        request.add_generation_prompt = v.get<bool>();
      } else {
        request.extra[k] = v;
      }
    }
  }
  TPMOE_CHECK(request.messages.is_array(), "chat request: messages must be a list, got {}",
              request.messages.type_name());
  for (const auto& m : request.messages)
    TPMOE_CHECK(m.is_object() && m.contains("role"), "chat request: each message must be an object with a \"role\"");
  return request;
}

std::string apply_chat_template(const std::filesystem::path& model_dir, const ChatRequest& request,
                                const ChatRenderOptions& options) {
  const ChatTemplateFiles files = load_chat_template(model_dir);
  ChatTemplate t;
  try {
    t = ChatTemplate::parse(files.source);
  } catch (const Error& e) {
    TPMOE_FAIL("{}: {}", files.origin, e.what());
  }
  return t.render(make_chat_context(request, files.special_tokens), options);
}

}  // namespace tpmoe::text
