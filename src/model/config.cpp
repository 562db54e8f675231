// ModelConfig parsing, validation and serialisation (SPEC §2).
//
// config.json is untrusted input (it is fuzzed): every field is type-checked and range-checked
// before it is narrowed to int/float, so no value can overflow a cast or make a later allocation
// explode. Most fields are described once in a table, which drives parsing, validation and both
// output forms, so a field cannot be handled in one place and forgotten in another.
//
// Choices the SPEC leaves open:
//  - A field set to null counts as absent (transformers writes null for "unset", e.g. head_dim).
//  - Integer fields also accept integral floats (64.0); 64.5, strings and booleans are errors.
//  - With neither rotary_dim nor partial_rotary_factor, the whole head rotates (transformers'
//    default factor 1.0).
//  - index_local_blocks may be 0: top-k selection alone is then well defined (block 0 always holds
//    a causally visible key, and kept blocks scored -inf are dropped).
//  - model_type inside text_config is not checked: only the top-level form is identified by it.
#include "model/config.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"

namespace tpmoe {

namespace {

using json = nlohmann::json;

// Sanity bounds: far above any real model (H=6144, 60 layers), far below sizes whose products would
// overflow the int64 element counts computed from them later.
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;

constexpr const char* kTextModelType = "minimax_m3_vl_text";
constexpr const char* kMultimodalModelType = "minimax_m3_vl";

// An integer field: its current name, its legacy alias (a "parent.child" path, or nullptr), the
// smallest value the parser accepts (validate() adds the cross-field rules), and whether it must be
// present at all.
struct IntField {
  int ModelConfig::*member;
  const char* name;
  const char* legacy;
  int64_t min;
  int64_t max;
  bool required;
};

constexpr IntField kIntFields[] = {
    {&ModelConfig::hidden_size, "hidden_size", nullptr, 1, kMaxDim, true},
    {&ModelConfig::num_layers, "num_hidden_layers", nullptr, 1, kMaxLayers, true},
    {&ModelConfig::num_heads, "num_attention_heads", nullptr, 1, kMaxDim, true},
    {&ModelConfig::num_kv_heads, "num_key_value_heads", nullptr, 1, kMaxDim, true},
    {&ModelConfig::vocab_size, "vocab_size", nullptr, 1, kMaxDim, true},
    // MoE / MLP sizes: only required (> 0) when a layer uses them, which validate() checks.
    {&ModelConfig::num_experts, "num_local_experts", nullptr, 0, kMaxDim, false},
    {&ModelConfig::num_experts_per_tok, "num_experts_per_tok", nullptr, 0, kMaxDim, false},
    {&ModelConfig::moe_intermediate_size, "intermediate_size", nullptr, 0, kMaxDim, false},
    {&ModelConfig::shared_intermediate_size, "shared_intermediate_size", nullptr, 0, kMaxDim, false},
    {&ModelConfig::dense_intermediate_size, "dense_intermediate_size", nullptr, 0, kMaxDim, false},
    {&ModelConfig::index_n_heads, "index_n_heads", "sparse_attention_config.sparse_num_index_heads", 0, kMaxDim, false},
    {&ModelConfig::index_head_dim, "index_head_dim", "sparse_attention_config.sparse_index_dim", 0, kMaxDim, false},
    {&ModelConfig::index_block_size, "index_block_size", "sparse_attention_config.sparse_block_size", 0, kMaxDim,
     false},
    {&ModelConfig::index_topk_blocks, "index_topk_blocks", "sparse_attention_config.sparse_topk_blocks", 0, kMaxDim,
     false},
    {&ModelConfig::index_local_blocks, "index_local_blocks", "sparse_attention_config.sparse_local_block", 0, kMaxDim,
     false},
};

// Integer fields whose defaults depend on other fields, so they are parsed by hand; validate()
// range-checks them like the table above.
constexpr IntField kDerivedIntFields[] = {
    {&ModelConfig::head_dim, "head_dim", nullptr, 1, kMaxDim, false},
    {&ModelConfig::rotary_dim, "rotary_dim", nullptr, 1, kMaxDim, false},
    {&ModelConfig::num_shared_experts, "n_shared_experts", nullptr, 0, kMaxDim, false},
};

struct FloatField {
  float ModelConfig::*member;
  const char* name;
};

constexpr FloatField kFloatFields[] = {
    {&ModelConfig::rms_norm_eps, "rms_norm_eps"},
    {&ModelConfig::routed_scaling_factor, "routed_scaling_factor"},
    {&ModelConfig::swiglu_alpha, "swiglu_alpha"},
    {&ModelConfig::swiglu_limit, "swiglu_limit"},
};

// A JSON value for a message, cut short: a fuzzed config can hold megabytes in one field.
std::string brief(const json& v) {
  std::string s = v.dump();
  if (s.size() > 64) s = s.substr(0, 60) + " ...";
  return s;
}

// The integer a JSON number holds, or nullopt when it is not an integer (strings, booleans,
// 64.5). Integers beyond int64 come back as INT64_MAX so the range check rejects them.
std::optional<int64_t> integer_value(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    return u > uint64_t(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max() : int64_t(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 0x1p53) return int64_t(d);
  }
  return std::nullopt;
}

void check_int_range(const std::string& origin, const char* name, int64_t v, int64_t min, int64_t max) {
  TPMOE_CHECK(v >= min, "{}: field '{}' must be {}, got {}", origin, name, min > 0 ? "positive" : "non-negative", v);
  TPMOE_CHECK(v <= max,
              "{}: field '{}' = {} exceeds the sanity bound {} (a value this large is a "
              "corrupt config and would make later allocations explode)",
              origin, name, v, max);
}

// Shortest decimal that reads back as the same float (1e-06, not 9.99999997e-07). Reading it as a
// double and narrowing gives the float back exactly: double has more than 2*24+2 bits.
double float_for_json(float f) { return std::strtod(fmt::format("{}", f).c_str(), nullptr); }

// Sets `path` ("name" or "parent.child") in `j`.
void set_path(json& j, std::string_view path, json value) {
  const size_t dot = path.find('.');
  if (dot == std::string_view::npos) {
    j[std::string(path)] = std::move(value);
  } else {
    j[std::string(path.substr(0, dot))][std::string(path.substr(dot + 1))] = std::move(value);
  }
}

// Typed reads from one config object, every error naming `origin` and the field.
class Fields {
 public:
  Fields(const json& obj, std::string origin) : obj_(obj), origin_(std::move(origin)) {}

  const std::string& origin() const { return origin_; }

  // The value at `path` ("name" or "parent.child"); nullptr when absent or null.
  const json* find(std::string_view path) const {
    const json* parent = &obj_;
    std::string_view key = path;
    if (const size_t dot = path.find('.'); dot != std::string_view::npos) {
      const std::string outer(path.substr(0, dot));
      const auto it = obj_.find(outer);
      if (it == obj_.end() || it->is_null()) return nullptr;
      TPMOE_CHECK(it->is_object(), "{}: field '{}' must be an object, got {}", origin_, outer, brief(*it));
      parent = &*it;
      key = path.substr(dot + 1);
    }
    const auto it = parent->find(std::string(key));
    return it == parent->end() || it->is_null() ? nullptr : &*it;
  }

  int integer(std::string_view name, const json& v, int64_t min, int64_t max) const {
    const std::optional<int64_t> i = integer_value(v);
    TPMOE_CHECK(i.has_value(), "{}: field '{}' must be a {} integer, got {}", origin_, name,
                min > 0 ? "positive" : "non-negative", brief(v));
    check_int_range(origin_, std::string(name).c_str(), *i, min, max);
    return int(*i);  // safe: max <= kMaxDim
  }

  double number(std::string_view name, const json& v) const {
    TPMOE_CHECK(v.is_number(), "{}: field '{}' must be a number, got {}", origin_, name, brief(v));
    return v.get<double>();
  }

  float single(std::string_view name, const json& v) const {
    const double d = number(name, v);
    // Narrowing a double beyond float range is undefined behaviour, not just inf.
    TPMOE_CHECK(std::fabs(d) <= FLT_MAX, "{}: field '{}' = {} is out of float range", origin_, name, d);
    return float(d);
  }

  // Reads `name` and its legacy `alias` (either may be nullptr) with `parse(path, value)`. When
  // both are present they must agree: silently preferring one would hide a broken conversion.
  template <class T, class Parse>
  std::optional<T> aliased(const char* name, const char* alias, Parse parse) const {
    const json* a = name ? find(name) : nullptr;
    const json* b = alias ? find(alias) : nullptr;
    std::optional<T> va, vb;
    if (a) va = parse(name, *a);
    if (b) vb = parse(alias, *b);
    TPMOE_CHECK(!(va && vb && *va != *vb), "{}: field '{}' = {} disagrees with its alias '{}' = {}", origin_, name,
                brief(*a), alias, brief(*b));
    return va ? va : vb;
  }

  // A per-layer list: `name` holds strings (`names[0]`, `names[1]`), `alias` holds 0/1.
  template <class Enum>
  std::optional<std::vector<Enum>> layer_list(const char* name, const char* alias,
                                              const char* const (&names)[2]) const {
    auto parse = [&](std::string_view field, const json& v) {
      TPMOE_CHECK(v.is_array(), "{}: field '{}' must be a list, got {}", origin_, field, brief(v));
      TPMOE_CHECK(int64_t(v.size()) <= kMaxLayers,
                  "{}: field '{}' has {} entries, more than the sanity bound {} layers", origin_, field, v.size(),
                  kMaxLayers);
      const bool strings = field == name;
      std::vector<Enum> out;
      for (size_t i = 0; i < v.size(); ++i) {
        const json& e = v[i];
        if (strings) {
          const std::string* s = e.is_string() ? e.get_ptr<const std::string*>() : nullptr;
          TPMOE_CHECK(s && (*s == names[0] || *s == names[1]), "{}: field '{}[{}]' must be \"{}\" or \"{}\", got {}",
                      origin_, field, i, names[0], names[1], brief(e));
          out.push_back(Enum(*s == names[1]));
        } else {
          const std::optional<int64_t> bit = integer_value(e);
          TPMOE_CHECK(bit && (*bit == 0 || *bit == 1), "{}: field '{}[{}]' must be 0 or 1, got {}", origin_, field, i,
                      brief(e));
          out.push_back(Enum(*bit == 1));
        }
      }
      return out;
    };
    return aliased<std::vector<Enum>>(name, alias, parse);
  }

 private:
  const json& obj_;
  std::string origin_;
};

// Strings for the two enums, index = enum value (kFull/kDense = 0).
constexpr const char* kAttentionNames[2] = {"full_attention", "minimax_m3_sparse"};
constexpr const char* kMlpNames[2] = {"dense", "sparse"};
static_assert(int(AttentionType::kSparse) == 1 && int(MlpType::kMoe) == 1);

ModelConfig parse_text_config(const Fields& f) {
  ModelConfig c;
  const auto int_parser = [&](int64_t min, int64_t max) {
    return [&f, min, max](std::string_view name, const json& v) { return f.integer(name, v, min, max); };
  };

  for (const IntField& field : kIntFields) {
    const std::optional<int> v = f.aliased<int>(field.name, field.legacy, int_parser(field.min, field.max));
    TPMOE_CHECK(v || !field.required, "{}: missing required field '{}'", f.origin(), field.name);
    if (v) c.*field.member = *v;
  }

  if (const json* v = f.find("head_dim")) {
    c.head_dim = f.integer("head_dim", *v, 1, kMaxDim);
  } else {
    TPMOE_CHECK(c.hidden_size % c.num_heads == 0,
                "{}: field 'head_dim' is absent and hidden_size {} is not a multiple of "
                "num_attention_heads {}",
                f.origin(), c.hidden_size, c.num_heads);
    c.head_dim = c.hidden_size / c.num_heads;
  }

  // rotary_dim, or partial_rotary_factor * head_dim, which must come out a whole channel count.
  const auto factor_to_dim = [&](std::string_view name, const json& v) {
    const double factor = f.number(name, v);
    TPMOE_CHECK(factor > 0 && factor <= 1, "{}: field '{}' must be in (0, 1], got {}", f.origin(), name, brief(v));
    const double dims = factor * c.head_dim;
    const double rounded = std::round(dims);
    TPMOE_CHECK(std::fabs(dims - rounded) <= 1e-6 * rounded,
                "{}: field '{}' = {} times head_dim {} is {}, not a whole number of channels", f.origin(), name,
                brief(v), c.head_dim, dims);
    return int(rounded);
  };
  const std::optional<int> rd = f.aliased<int>("rotary_dim", nullptr, int_parser(1, kMaxDim));
  const std::optional<int> rd_factor = f.aliased<int>("rope_parameters.partial_rotary_factor", nullptr, factor_to_dim);
  TPMOE_CHECK(!(rd && rd_factor && *rd != *rd_factor),
              "{}: field 'rotary_dim' = {} disagrees with 'rope_parameters.partial_rotary_factor' "
              "(= {} rotary channels of head_dim {})",
              f.origin(), *rd, rd_factor.value_or(0), c.head_dim);
  c.rotary_dim = rd ? *rd : rd_factor ? *rd_factor : c.head_dim;

  const auto number = [&f](std::string_view name, const json& v) { return f.number(name, v); };
  if (auto theta = f.aliased<double>("rope_parameters.rope_theta", "rope_theta", number)) {
    c.rope_theta = *theta;
  }

  for (const FloatField& field : kFloatFields) {
    if (const json* v = f.find(field.name)) c.*field.member = f.single(field.name, *v);
  }

  if (const json* v = f.find("n_shared_experts")) {
    c.num_shared_experts = f.integer("n_shared_experts", *v, 0, kMaxDim);
  } else {
    c.num_shared_experts = c.shared_intermediate_size > 0 ? 1 : 0;
  }

  if (const json* v = f.find("tie_word_embeddings")) {
    TPMOE_CHECK(v->is_boolean(), "{}: field 'tie_word_embeddings' must be true or false, got {}", f.origin(),
                brief(*v));
    c.tie_word_embeddings = v->get<bool>();
  }

  if (const json* v = f.find("eos_token_id")) {
    const bool list = v->is_array();
    for (const json& id : list ? *v : json::array({*v}))
      if (!id.is_null()) c.eos_token_ids.push_back(int32_t(f.integer("eos_token_id", id, 0, kMaxDim)));
  }

  // Missing lists: every layer full attention, every layer MoE (SPEC §2).
  c.layer_types =
      f.layer_list<AttentionType>("layer_types", "sparse_attention_config.sparse_attention_freq", kAttentionNames)
          .value_or(std::vector<AttentionType>(c.num_layers, AttentionType::kFull));
  c.mlp_layer_types = f.layer_list<MlpType>("mlp_layer_types", "moe_layer_freq", kMlpNames)
                          .value_or(std::vector<MlpType>(c.num_layers, MlpType::kMoe));
  return c;
}

constexpr const char* kMxfp8Method = "mxfp8";

// quantization_config: {"quant_method": "mxfp8", "weight_block_size": [1, 32], "ignored_layers": [..]}.
QuantizationConfig parse_quantization(const json& q, const std::string& origin) {
  const std::string field = "quantization_config";
  TPMOE_CHECK(q.is_object(), "{}: field '{}' must be an object, got {}", origin, field, brief(q));
  QuantizationConfig out;
  const auto method = q.find("quant_method");
  TPMOE_CHECK(method != q.end() && method->is_string(), "{}: field '{}.quant_method' must be a string, got {}", origin,
              field, method == q.end() ? "nothing" : brief(*method));
  TPMOE_CHECK(*method == kMxfp8Method,
              "{}: field '{}.quant_method' is {}; tpmoe reads bf16/fp32 checkpoints and the \"{}\" variant only",
              origin, field, brief(*method), kMxfp8Method);
  out.method = QuantMethod::kMxfp8;
  if (const auto bs = q.find("weight_block_size"); bs != q.end() && !bs->is_null()) {
    const bool ok =
        bs->is_array() && bs->size() == 2 && integer_value((*bs)[0]) == 1 && integer_value((*bs)[1]) == kMxfp8BlockSize;
    TPMOE_CHECK(ok, "{}: field '{}.weight_block_size' must be [1, {}] for mxfp8, got {}", origin, field,
                kMxfp8BlockSize, brief(*bs));
  }
  if (const auto f = q.find("fmt"); f != q.end() && !f->is_null())
    TPMOE_CHECK(*f == "e4m3", "{}: field '{}.fmt' must be \"e4m3\" for mxfp8, got {}", origin, field, brief(*f));
  if (const auto ig = q.find("ignored_layers"); ig != q.end() && !ig->is_null()) {
    TPMOE_CHECK(ig->is_array(), "{}: field '{}.ignored_layers' must be a list, got {}", origin, field, brief(*ig));
    for (size_t i = 0; i < ig->size(); ++i) {
      TPMOE_CHECK((*ig)[i].is_string(), "{}: field '{}.ignored_layers[{}]' must be a string, got {}", origin, field, i,
                  brief((*ig)[i]));
      out.ignored_layers.push_back((*ig)[i].get<std::string>());
    }
  }
  return out;
}

json quantization_json(const QuantizationConfig& q) {
  return {{"quant_method", kMxfp8Method},
          {"weight_block_size", {1, kMxfp8BlockSize}},
          {"fmt", "e4m3"},
          {"ignored_layers", q.ignored_layers}};
}

// The quantization_config of either form: at the top level (where the hub files keep it) or inside
// text_config; when both are present they must agree.
QuantizationConfig find_quantization(const json& top, const json* text, const std::string& origin) {
  const json* a = top.contains("quantization_config") && !top["quantization_config"].is_null()
                      ? &top["quantization_config"]
                      : nullptr;
  const json* b = text && text->contains("quantization_config") && !(*text)["quantization_config"].is_null()
                      ? &(*text)["quantization_config"]
                      : nullptr;
  TPMOE_CHECK(!(a && b && *a != *b), "{}: 'quantization_config' differs between the top level and 'text_config'",
              origin);
  if (a) return parse_quantization(*a, origin);
  if (b) return parse_quantization(*b, origin + " [text_config]");
  return {};
}

}  // namespace

bool ModelConfig::any_sparse_attention() const {
  for (AttentionType t : layer_types)
    if (t == AttentionType::kSparse) return true;
  return false;
}

bool ModelConfig::any_moe() const {
  for (MlpType t : mlp_layer_types)
    if (t == MlpType::kMoe) return true;
  return false;
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j, const std::string& origin) {
  try {
    TPMOE_CHECK(j.is_object(), "{}: expected a JSON object at the top level, got {}", origin, j.type_name());
    const auto text_config = j.find("text_config");
    if (text_config != j.end()) {
      // The multimodal form: only the text part matters here; the vision tower is ignored.
      TPMOE_CHECK(text_config->is_object(), "{}: field 'text_config' must be an object, got {}", origin,
                  brief(*text_config));
      const std::string text_origin = origin + " [text_config]";
      ModelConfig c = parse_text_config(Fields(*text_config, text_origin));
      c.quantization = find_quantization(j, &*text_config, origin);
      c.validate(text_origin);
      return c;
    }
    if (const auto mt = j.find("model_type"); mt != j.end()) {
      TPMOE_CHECK(mt->is_string(), "{}: field 'model_type' must be a string, got {}", origin, brief(*mt));
      TPMOE_CHECK(*mt != kMultimodalModelType, "{}: model_type is \"{}\" but there is no 'text_config' object", origin,
                  kMultimodalModelType);
      TPMOE_CHECK(*mt == kTextModelType,
                  "{}: field 'model_type' is {}, not a MiniMax-M3 config (expected \"{}\", or "
                  "\"{}\" with a 'text_config')",
                  origin, brief(*mt), kTextModelType, kMultimodalModelType);
    }
    ModelConfig c = parse_text_config(Fields(j, origin));
    c.quantization = find_quantization(j, nullptr, origin);
    c.validate(origin);
    return c;
  } catch (const nlohmann::json::exception& e) {
    // Should not happen (every access is type-checked first), but never let one escape untagged.
    TPMOE_FAIL("{}: {}", origin, e.what());
  }
}

ModelConfig ModelConfig::from_file(const std::filesystem::path& path) {
  const std::string origin = path.string();
  std::error_code ec;
  TPMOE_CHECK(std::filesystem::is_regular_file(path, ec), "{}: config file not found or not a file", origin);
  std::ifstream in(path, std::ios::binary);
  TPMOE_CHECK(in.good(), "{}: cannot open config file: {}", origin, std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  TPMOE_CHECK(!in.bad(), "{}: error reading config file", origin);
  json j;
  try {
    j = json::parse(text.str());
  } catch (const json::parse_error& e) {
    // nlohmann's message carries the line and column.
    TPMOE_FAIL("{}: invalid JSON: {}", origin, e.what());
  }
  return from_json(j, origin);
}

void ModelConfig::validate(const std::string& origin) const {
  for (const IntField& f : kIntFields) check_int_range(origin, f.name, this->*f.member, f.min, f.max);
  for (const IntField& f : kDerivedIntFields) check_int_range(origin, f.name, this->*f.member, f.min, f.max);

  TPMOE_CHECK(num_heads % num_kv_heads == 0,
              "{}: field 'num_attention_heads' ({}) must be a multiple of 'num_key_value_heads' ({})", origin,
              num_heads, num_kv_heads);
  TPMOE_CHECK(head_dim % 2 == 0, "{}: field 'head_dim' must be even, got {}", origin, head_dim);
  for (int32_t id : eos_token_ids)
    TPMOE_CHECK(id >= 0 && id < vocab_size, "{}: field 'eos_token_id' ({}) is outside the vocabulary (vocab_size {})",
                origin, id, vocab_size);
  TPMOE_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim,
              "{}: field 'rotary_dim' must be even and at most head_dim {}, got {}", origin, head_dim, rotary_dim);
  // Projection widths are computed as int products later; keep them in range too.
  TPMOE_CHECK(int64_t(num_heads) * head_dim <= kMaxDim,
              "{}: num_attention_heads {} x head_dim {} exceeds the sanity bound {}", origin, num_heads, head_dim,
              kMaxDim);

  TPMOE_CHECK(std::isfinite(rope_theta) && rope_theta > 0, "{}: field 'rope_theta' must be positive, got {}", origin,
              rope_theta);
  TPMOE_CHECK(std::isfinite(rms_norm_eps) && rms_norm_eps > 0, "{}: field 'rms_norm_eps' must be positive, got {}",
              origin, rms_norm_eps);
  TPMOE_CHECK(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0,
              "{}: field 'routed_scaling_factor' must be positive, got {}", origin, routed_scaling_factor);
  TPMOE_CHECK(std::isfinite(swiglu_alpha), "{}: field 'swiglu_alpha' must be finite, got {}", origin, swiglu_alpha);
  TPMOE_CHECK(std::isfinite(swiglu_limit) && swiglu_limit > 0, "{}: field 'swiglu_limit' must be positive, got {}",
              origin, swiglu_limit);

  TPMOE_CHECK(int64_t(layer_types.size()) == num_layers,
              "{}: list 'layer_types' has {} entries but num_hidden_layers is {}", origin, layer_types.size(),
              num_layers);
  TPMOE_CHECK(int64_t(mlp_layer_types.size()) == num_layers,
              "{}: list 'mlp_layer_types' has {} entries but num_hidden_layers is {}", origin, mlp_layer_types.size(),
              num_layers);

  if (any_moe()) {
    TPMOE_CHECK(num_experts > 0, "{}: field 'num_local_experts' must be positive (MoE layers exist)", origin);
    TPMOE_CHECK(num_experts_per_tok > 0 && num_experts_per_tok <= num_experts,
                "{}: field 'num_experts_per_tok' must be in 1..num_local_experts ({}), got {}", origin, num_experts,
                num_experts_per_tok);
    TPMOE_CHECK(moe_intermediate_size > 0, "{}: field 'intermediate_size' must be positive (MoE layers exist)", origin);
  }
  TPMOE_CHECK(num_shared_experts == 0 || shared_intermediate_size > 0,
              "{}: field 'n_shared_experts' is {} but 'shared_intermediate_size' is 0", origin, num_shared_experts);
  for (MlpType t : mlp_layer_types) {
    TPMOE_CHECK(t != MlpType::kDense || dense_intermediate_size > 0,
                "{}: field 'dense_intermediate_size' must be positive (dense MLP layers exist)", origin);
  }

  if (any_sparse_attention()) {
    TPMOE_CHECK(index_n_heads == num_kv_heads,
                "{}: field 'index_n_heads' ({}) must equal 'num_key_value_heads' ({}) when sparse "
                "attention layers exist",
                origin, index_n_heads, num_kv_heads);
    TPMOE_CHECK(index_head_dim > 0 && index_head_dim % 2 == 0 && index_head_dim >= rotary_dim,
                "{}: field 'index_head_dim' must be positive, even and at least rotary_dim {}, "
                "got {}",
                origin, rotary_dim, index_head_dim);
    TPMOE_CHECK(int64_t(index_n_heads) * index_head_dim <= kMaxDim,
                "{}: index_n_heads {} x index_head_dim {} exceeds the sanity bound {}", origin, index_n_heads,
                index_head_dim, kMaxDim);
    TPMOE_CHECK(index_block_size > 0, "{}: field 'index_block_size' must be positive (sparse layers exist)", origin);
    TPMOE_CHECK(index_topk_blocks > 0, "{}: field 'index_topk_blocks' must be positive (sparse layers exist)", origin);
    // index_local_blocks >= 0 is already checked; 0 is allowed (see the top of this file).
  }
}

nlohmann::json ModelConfig::to_json(JsonForm form) const {
  const bool legacy = form == JsonForm::kMultimodalLegacy;
  json t = json::object();
  if (!legacy) {
    t["model_type"] = kTextModelType;
    t["architectures"] = {"MiniMaxM3VLForCausalLM"};
  }
  for (const IntField& f : kIntFields) {
    set_path(t, legacy && f.legacy ? f.legacy : f.name, this->*f.member);
  }
  t["head_dim"] = head_dim;
  t["n_shared_experts"] = num_shared_experts;
  for (const FloatField& f : kFloatFields) t[f.name] = float_for_json(this->*f.member);
  t["tie_word_embeddings"] = tie_word_embeddings;
  if (eos_token_ids.size() == 1) t["eos_token_id"] = eos_token_ids[0];
  if (eos_token_ids.size() > 1) t["eos_token_id"] = eos_token_ids;

  const double factor = head_dim > 0 ? double(rotary_dim) / head_dim : 0.0;
  json layers = json::array(), mlps = json::array();
  if (legacy) {
    // Original names: theta at the top level, rotary width only as a factor, 0/1 layer lists.
    t["rope_theta"] = rope_theta;
    t["rope_parameters"] = {{"partial_rotary_factor", factor}, {"rope_type", "default"}};
    for (AttentionType a : layer_types) layers.push_back(int(a));
    for (MlpType m : mlp_layer_types) mlps.push_back(int(m));
    t["sparse_attention_config"]["sparse_attention_freq"] = std::move(layers);
    t["moe_layer_freq"] = std::move(mlps);
    json out = {
        {"model_type", kMultimodalModelType},
        {"architectures", {"MiniMaxM3VLForConditionalGeneration"}},
        {"vision_config",
         {{"model_type", "minimax_m3_vl_vision"}, {"hidden_size", 64}, {"num_hidden_layers", 1}, {"patch_size", 14}}},
        {"text_config", std::move(t)}};
    // The hub files keep quantization_config at the top level.
    if (quantization.method == QuantMethod::kMxfp8) out["quantization_config"] = quantization_json(quantization);
    return out;
  }
  if (quantization.method == QuantMethod::kMxfp8) t["quantization_config"] = quantization_json(quantization);
  t["rotary_dim"] = rotary_dim;
  t["rope_parameters"] = {{"rope_theta", rope_theta}, {"partial_rotary_factor", factor}, {"rope_type", "default"}};
  for (AttentionType a : layer_types) layers.push_back(kAttentionNames[int(a)]);
  for (MlpType m : mlp_layer_types) mlps.push_back(kMlpNames[int(m)]);
  t["layer_types"] = std::move(layers);
  t["mlp_layer_types"] = std::move(mlps);
  return t;
}

}  // namespace tpmoe
