#include "serve/tool_calls.h"

#include <algorithm>
#include <set>
#include <unordered_map>

#include "serve/json_nesting.h"

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

// The elements of one invoke's body, matched once: for every `<name>` (a plain name: no '<', '/',
// whitespace, '"' or '=') the `</name>` that closes it, counting nested elements of the same name.
// A value's elements are read out of parts of the body at every level of its nesting; a part's
// `<name>` is closed inside it exactly when the match found in the whole body lies inside the part
// (whether a tag closes depends only on the tags after it), so one pass over the body serves every
// level, where searching each part anew cost time cubic in the nesting.
class ElementIndex {
 public:
  explicit ElementIndex(std::string_view body) : body_(body) {
    std::unordered_map<std::string_view, std::vector<size_t>> unclosed;  // name -> its open tags, innermost last
    size_t gt = 0;  // the first '>' after the current '<': only moves forward
    for (size_t at = body.find('<'); at != std::string_view::npos; at = body.find('<', at + 1)) {
      if (gt <= at) gt = body.find('>', at + 1);
      if (gt == std::string_view::npos) break;  // no tag ends after here
      const bool closing = body[at + 1] == '/';
      const std::string_view name = body.substr(at + 1 + closing, gt - at - 1 - closing);
      if (name.empty() || name.find_first_of("</ \n\t\"=") != std::string_view::npos) continue;
      if (!closing) {
        opens_.emplace(at, Open{name.size(), std::string_view::npos});
        unclosed[name].push_back(at);
      } else if (auto it = unclosed.find(name); it != unclosed.end() && !it->second.empty()) {
        opens_[it->second.back()].close = at;
        it->second.pop_back();
      }
    }
  }

  // The elements `part` (a view into the body) is made of. `strict`: only elements and whitespace
  // between them, else nothing (the part is a plain value); otherwise text outside elements is
  // skipped.
  std::vector<Element> elements_of(std::string_view part, bool strict) const {
    std::vector<Element> out;
    const size_t base = size_t(part.data() - body_.data()), end = base + part.size();
    size_t at = 0;
    while (at < part.size()) {
      if (is_space(part[at])) {
        ++at;
        continue;
      }
      const auto open = part[at] == '<' ? opens_.find(base + at) : opens_.end();
      const bool closed = open != opens_.end() && open->second.close != std::string_view::npos &&
                          open->second.close + open->second.name_size + 3 <= end;
      if (!closed) {
        if (strict) return {};
        ++at;
        continue;
      }
      const size_t content = at + 1 + open->second.name_size + 1, close = open->second.close - base;
      out.push_back({std::string(part.substr(at + 1, open->second.name_size)), part.substr(content, close - content)});
      at = close + open->second.name_size + 3;
    }
    return out;
  }

 private:
  struct Open {
    size_t name_size;
    size_t close;  // where its `</name>` starts in the body; npos: never closed
  };
  std::string_view body_;
  std::unordered_map<size_t, Open> opens_;  // by where the `<name>` starts in the body
};

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

// Values nested deeper than this (as elements, or as JSON text) are kept as their text: no tool's
// schema wants that many levels, and reading them would take time and stack in proportion to the
// nesting, which a reply (its model is not to be trusted with the server) can make as deep as it is
// long.
constexpr int kMaxValueNesting = 32;

Json read_value(const ElementIndex& index, std::string_view text, const Json& schema, int nesting);

// A value written as nested elements: a list where every element is an <item> (and the schema does
// not want an object), else an object. `nesting`: the levels of elements around them.
Json read_nested(const ElementIndex& index, const std::vector<Element>& elements, const Json& schema, int nesting) {
  const std::set<std::string> types = schema_types(schema);
  const bool wants_object = types.contains("object") && !types.contains("array");
  const bool items = std::all_of(elements.begin(), elements.end(), [](const Element& e) { return e.name == "item"; });
  if (items && !wants_object) {
    Json out = Json::array();
    for (const Element& e : elements)
      out.push_back(read_value(index, e.content, sub_schema(schema, "items"), nesting + 1));
    return out;
  }
  Json out = Json::object();
  for (const Element& e : elements)
    out[e.name] = read_value(index, e.content, sub_schema(schema, "properties", e.name), nesting + 1);
  return out;
}

// JSON text as its value (or discarded, as is JSON nested past kMaxValueNesting).
Json parse_json(std::string_view text) {
  if (json_nesting(text, kMaxValueNesting) > kMaxValueNesting) return Json(Json::value_t::discarded);
  return Json::parse(text, nullptr, /*allow_exceptions=*/false);
}

// `text`: a part of the body `index` was made of; `nesting`: the levels of elements around it (past
// kMaxValueNesting the value is its text).
Json read_value(const ElementIndex& index, std::string_view text, const Json& schema, int nesting) {
  if (nesting >= kMaxValueNesting) return std::string(text);
  const std::set<std::string> types = schema_types(schema);
  const bool structured = types.contains("object") || types.contains("array");
  if (types.empty() || structured) {
    const std::vector<Element> elements = index.elements_of(text, true);
    if (!elements.empty() || (structured && all_space(text))) return read_nested(index, elements, schema, nesting);
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
  const ElementIndex index(body);
  Json args = Json::object();
  for (const Element& e : index.elements_of(body, false))
    args[e.name] = read_value(index, e.content, sub_schema(parameters, "properties", e.name), 0);
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
    end_block();
  }
  return out;
}

namespace {

// Where `tag` starts in `text` at or after `from`; when it does not, `from` moves up to where a tag
// still to be completed by more text could start, so that the next search goes over new text only.
size_t find_from(const std::string& text, std::string_view tag, size_t& from) {
  const size_t at = text.find(tag, from);
  if (at == std::string::npos) from = std::max(from, text.size() - std::min(text.size(), tag.size() - 1));
  return at;
}

}  // namespace

size_t ToolCallParser::read_block(ToolCallDelta& out) {
  // Each tag is searched for from where its last search left off: searching the whole block for
  // every piece of a streamed reply took time quadratic in the block's length.
  const size_t close = find_from(block_, kBlockClose, block_close_from_);
  for (;;) {
    const size_t end = find_from(block_, kInvokeClose, invoke_close_from_);
    if (end == std::string::npos || end > close) return close;
    emit(without_namespace(std::string_view(block_).substr(read_, end + kInvokeClose.size() - read_)), out);
    read_ = invoke_close_from_ = end + kInvokeClose.size();
  }
}

void ToolCallParser::end_block() {
  block_.clear();
  read_ = block_close_from_ = invoke_close_from_ = 0;
  in_block_ = false;
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
  const std::string_view unread = std::string_view(block_).substr(std::min(read_, block_.size()));
  if (!in_block_) {
    out.content = std::move(held_);
  } else if (!all_space(without_namespace(unread))) {
    // Unfinished: the rest as written, with the block's opening tag where none of it was read.
    out.content = (block_calls_ == 0 ? block_opening() : std::string()) + std::string(unread);
  }
  held_.clear();
  end_block();
  return out;
}

}  // namespace tpmoe::serve
