#include "serve/tool_calls.h"

#include <algorithm>
#include <set>

namespace tpmoe::serve {

namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kBlockOpen = "<tool_call>", kBlockClose = "</tool_call>";
constexpr std::string_view kInvokeOpen = "<invoke name=\"", kInvokeClose = "</invoke>";

std::string block_opening() { return std::string(kMiniMaxNamespace) + std::string(kBlockOpen); }

std::string without_namespace(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t at = 0;;) {
    const size_t ns = text.find(kMiniMaxNamespace, at);
    out.append(text.substr(at, ns == std::string_view::npos ? std::string_view::npos : ns - at));
    if (ns == std::string_view::npos) return out;
    at = ns + kMiniMaxNamespace.size();
  }
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

bool all_space(std::string_view text) { return std::all_of(text.begin(), text.end(), is_space); }

// One element of a value's nested markup: <name>content</name>.
struct Element {
  std::string name;
  std::string_view content;
};

// Where the `</name>` closing the element whose content starts at `from` begins, counting nested
// elements of the same name; npos when it is not there.
size_t find_close(std::string_view text, const std::string& name, size_t from) {
  const std::string open = "<" + name + ">", close = "</" + name + ">";
  int depth = 1;
  for (size_t at = from;;) {
    const size_t c = text.find(close, at);
    if (c == std::string_view::npos) return c;
    const size_t o = text.find(open, at);
    if (o < c) {
      ++depth;
      at = o + open.size();
    } else if (--depth == 0) {
      return c;
    } else {
      at = c + close.size();
    }
  }
}

// The elements `text` is made of. `strict`: only elements and whitespace between them, else
// nothing (the text is a plain value); otherwise text outside elements is skipped.
std::vector<Element> elements_of(std::string_view text, bool strict) {
  std::vector<Element> out;
  size_t at = 0;
  while (at < text.size()) {
    if (is_space(text[at])) {
      ++at;
      continue;
    }
    if (text[at] != '<') {
      if (strict) return {};
      ++at;
      continue;
    }
    const size_t gt = text.find('>', at + 1);
    const std::string_view name = text.substr(at + 1, gt == std::string_view::npos ? 0 : gt - at - 1);
    const bool plain_name = !name.empty() && name.find_first_of("</ \n\t\"=") == std::string_view::npos;
    const size_t end = plain_name ? find_close(text, std::string(name), gt + 1) : std::string_view::npos;
    if (end == std::string_view::npos) {
      if (strict) return {};
      ++at;
      continue;
    }
    out.push_back({std::string(name), text.substr(gt + 1, end - gt - 1)});
    at = end + name.size() + 3;
  }
  return out;
}

// The JSON types a schema allows ("type" as a string or a list, and those of anyOf / oneOf).
std::set<std::string> schema_types(const Json& schema) {
  std::set<std::string> types;
  if (!schema.is_object()) return types;
  if (const auto t = schema.find("type"); t != schema.end()) {
    if (t->is_string()) types.insert(t->get<std::string>());
    if (t->is_array())
      for (const auto& v : *t)
        if (v.is_string()) types.insert(v.get<std::string>());
  }
  for (const char* key : {"anyOf", "oneOf"})
    if (const auto alts = schema.find(key); alts != schema.end() && alts->is_array())
      for (const auto& alt : *alts) types.merge(schema_types(alt));
  return types;
}

const Json& sub_schema(const Json& schema, const char* key, const std::string& name = "") {
  static const Json kNone;
  if (!schema.is_object()) return kNone;
  const auto it = schema.find(key);
  if (it == schema.end()) return kNone;
  if (name.empty()) return *it;
  if (!it->is_object()) return kNone;
  const auto field = it->find(name);
  return field == it->end() ? kNone : *field;
}

Json read_value(std::string_view text, const Json& schema);

// A value written as nested elements: a list where every element is an <item> (and the schema does
// not want an object), else an object.
Json read_nested(const std::vector<Element>& elements, const Json& schema) {
  const std::set<std::string> types = schema_types(schema);
  const bool wants_object = types.contains("object") && !types.contains("array");
  const bool items = std::all_of(elements.begin(), elements.end(), [](const Element& e) { return e.name == "item"; });
  if (items && !wants_object) {
    Json out = Json::array();
    for (const Element& e : elements) out.push_back(read_value(e.content, sub_schema(schema, "items")));
    return out;
  }
  Json out = Json::object();
  for (const Element& e : elements) out[e.name] = read_value(e.content, sub_schema(schema, "properties", e.name));
  return out;
}

// JSON text as its value (or discarded).
Json parse_json(std::string_view text) { return Json::parse(text, nullptr, /*allow_exceptions=*/false); }

Json read_value(std::string_view text, const Json& schema) {
  const std::set<std::string> types = schema_types(schema);
  const bool structured = types.contains("object") || types.contains("array");
  if (types.empty() || structured) {
    const std::vector<Element> elements = elements_of(text, true);
    if (!elements.empty() || (structured && all_space(text))) return read_nested(elements, schema);
  }
  if (types.empty()) {  // undeclared: JSON where it is JSON
    const Json j = parse_json(text);
    return j.is_discarded() ? Json(std::string(text)) : j;
  }
  const Json j = parse_json(text);
  if (!j.is_discarded()) {
    if (types.contains("integer") && j.is_number_integer()) return j;
    if (types.contains("number") && j.is_number()) return j;
    if (types.contains("boolean") && j.is_boolean()) return j;
    if (types.contains("null") && j.is_null()) return j;
    if (types.contains("object") && j.is_object()) return j;
    if (types.contains("array") && j.is_array()) return j;
  }
  return std::string(text);  // declared a string, or does not read as its declared type
}

// The `parameters` schema of the tool named `name` in an OpenAI tools list (null: not listed).
const Json& parameters_of(const Json& tools, std::string_view name) {
  static const Json kNone;
  if (!tools.is_array()) return kNone;
  for (const auto& tool : tools) {
    const Json& function = sub_schema(tool, "function");
    const Json& n = sub_schema(function, "name");
    if (n.is_string() && n.get<std::string>() == name) return sub_schema(function, "parameters");
  }
  return kNone;
}

}  // namespace

Json read_tool_arguments(std::string_view body, const Json& parameters) {
  Json args = Json::object();
  for (const Element& e : elements_of(body, false))
    args[e.name] = read_value(e.content, sub_schema(parameters, "properties", e.name));
  return args;
}

ToolCallParser::ToolCallParser(ToolCallSyntax syntax, const Json& tools, std::string id_prefix)
    : syntax_(syntax), tools_(tools), id_prefix_(std::move(id_prefix)) {}

ToolCallDelta ToolCallParser::feed(std::string_view text) {
  ToolCallDelta out;
  if (syntax_ == ToolCallSyntax::kNone) {
    out.content.append(text);
    return out;
  }
  const std::string opening = block_opening();
  std::string rest = std::move(held_);
  held_.clear();
  rest.append(text);
  while (!rest.empty()) {
    if (!in_block_) {
      const size_t at = rest.find(opening);
      if (at == std::string::npos) {
        const size_t keep = partial_tag_suffix(rest, opening);
        out.content.append(rest, 0, rest.size() - keep);
        held_ = rest.substr(rest.size() - keep);
        return out;
      }
      out.content.append(rest, 0, at);
      rest.erase(0, at + opening.size());
      in_block_ = true;
      block_calls_ = 0;
      continue;
    }
    block_.append(rest);
    rest.clear();
    const size_t close = read_block(out);
    if (close == std::string::npos) return out;
    // The block is over; what follows is content again (or another block).
    rest = block_.substr(close + kBlockClose.size());
    block_.clear();
    in_block_ = false;
  }
  return out;
}

size_t ToolCallParser::read_block(ToolCallDelta& out) {
  for (;;) {
    const size_t close = block_.find(kBlockClose);
    const size_t end = block_.find(kInvokeClose);
    if (end == std::string::npos || end > close) return close;
    emit(without_namespace(std::string_view(block_).substr(0, end + kInvokeClose.size())), out);
    block_.erase(0, end + kInvokeClose.size());
  }
}

void ToolCallParser::emit(std::string_view invoke, ToolCallDelta& out) {
  // invoke: [text between invokes] <invoke name="NAME"> body </invoke>, NS removed.
  const size_t open = invoke.find(kInvokeOpen);
  if (open == std::string_view::npos) return;  // not an invoke: dropped with the text between them
  const size_t name_at = open + kInvokeOpen.size();
  const size_t quote = invoke.find('"', name_at);
  const size_t gt = quote == std::string_view::npos ? quote : invoke.find('>', quote);
  if (gt == std::string_view::npos) return;
  ToolCall call;
  call.name = std::string(invoke.substr(name_at, quote - name_at));
  const std::string_view body = invoke.substr(gt + 1, invoke.size() - kInvokeClose.size() - gt - 1);
  call.arguments = read_tool_arguments(body, parameters_of(tools_, call.name));
  call.index = calls_++;
  call.id = id_prefix_ + std::to_string(call.index);
  ++block_calls_;
  out.calls.push_back(std::move(call));
}

ToolCallDelta ToolCallParser::flush() {
  ToolCallDelta out;
  if (!in_block_) {
    out.content = std::move(held_);
  } else if (!all_space(without_namespace(block_))) {
    // Unfinished: the rest as written, with the block's opening tag where none of it was read.
    out.content = (block_calls_ == 0 ? block_opening() : std::string()) + block_;
  }
  held_.clear();
  block_.clear();
  in_block_ = false;
  return out;
}

}  // namespace tpmoe::serve
