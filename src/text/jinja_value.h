// The values a chat template computes with: a small Python-like object model (None, bool, int, float,
// str, list/tuple, dict, namespace, callable, and Jinja's Undefined), with Python's semantics for the
// operations templates rely on: truthiness, str() and repr(), ==, ordering, and json.dumps as Hugging
// Face's `tojson` filter calls it.
//
// Why Python semantics: a chat template is a Python Jinja2 program. The prompt a model was trained on
// is whatever Jinja2 printed, so every conversion to text (`{{ 1.0 }}` is "1.0", `{{ none }}` is
// "None", a dict prints as {'k': 'v'}) must match CPython byte for byte.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace tpmoe::text::jinja {

class Value;

// A Python list, or a tuple (`is_tuple` only changes how it prints: (1, 2) instead of [1, 2]).
struct ListData {
  std::vector<Value> items;
  bool is_tuple = false;
};

// A Python dict with string keys, in insertion order (Python dicts keep it, and json.dumps prints it).
struct DictData {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(std::string key, Value value);  // replaces in place, or appends
};

// Jinja's namespace(): the one mutable object a template can make (`{% set ns.x = ... %}`).
struct NamespaceData {
  DictData attrs;
};

struct CallArgs;
// Builtin functions, bound methods and macros. `name` is for messages only.
struct Callable {
  std::string name;
  std::function<Value(CallArgs&)> fn;
};

// Jinja's Undefined: what a missing variable, attribute or item evaluates to. It prints as "" and is
// falsy; most other uses are errors, reported with `hint` (Jinja's own wording: "'x' is undefined").
struct Undefined {
  std::string hint;
};
struct None {};

class Value {
 public:
  using List = std::shared_ptr<ListData>;
  using Dict = std::shared_ptr<DictData>;
  using Namespace = std::shared_ptr<NamespaceData>;
  using Function = std::shared_ptr<Callable>;

  Value() : v_(Undefined{}) {}
  Value(None) : v_(None{}) {}
  Value(Undefined u) : v_(std::move(u)) {}
  Value(bool b) : v_(b) {}
  Value(int64_t i) : v_(i) {}
  Value(int i) : v_(int64_t(i)) {}
  Value(double d) : v_(d) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(List l) : v_(std::move(l)) {}
  Value(Dict d) : v_(std::move(d)) {}
  Value(Namespace n) : v_(std::move(n)) {}
  Value(Function f) : v_(std::move(f)) {}

  static Value undefined(std::string hint) { return Value(Undefined{std::move(hint)}); }
  static Value list(std::vector<Value> items, bool is_tuple = false);
  static Value dict();
  static Value function(std::string name, std::function<Value(CallArgs&)> fn);

  bool is_undefined() const { return std::holds_alternative<Undefined>(v_); }
  bool is_none() const { return std::holds_alternative<None>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }
  bool is_int() const { return std::holds_alternative<int64_t>(v_); }
  bool is_float() const { return std::holds_alternative<double>(v_); }
  bool is_number() const { return is_int() || is_float() || is_bool(); }  // Python: bool is a number
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_list() const { return std::holds_alternative<List>(v_); }
  bool is_dict() const { return std::holds_alternative<Dict>(v_); }
  bool is_namespace() const { return std::holds_alternative<Namespace>(v_); }
  bool is_callable() const { return std::holds_alternative<Function>(v_); }

  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const { return std::get<int64_t>(v_); }
  double as_float() const { return std::get<double>(v_); }
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const List& as_list() const { return std::get<List>(v_); }
  const Dict& as_dict() const { return std::get<Dict>(v_); }
  const Namespace& as_namespace() const { return std::get<Namespace>(v_); }
  const Function& as_callable() const { return std::get<Function>(v_); }
  const std::string& undefined_hint() const { return std::get<Undefined>(v_).hint; }

  // A number as a double (bools are 0/1, as in Python).
  double to_double() const;
  // Python's type name, for messages ("str", "dict", "NoneType").
  std::string type_name() const;

 private:
  std::variant<Undefined, None, bool, int64_t, double, std::string, List, Dict, Namespace, Function> v_;
};

// Positional and keyword arguments of a call, as Python passes them.
struct CallArgs {
  std::vector<Value> args;
  std::vector<std::pair<std::string, Value>> kwargs;
  // The argument named `name` (keyword) or at `position` (positional), if given.
  const Value* get(size_t position, std::string_view name) const;
};

// Every failure while rendering (a type error, a missing attribute used in an unsupported way): the
// interpreter adds the template line and turns it into a tpmoe::Error.
struct RuntimeError {
  std::string message;
};
// raise_exception(msg) from the template: carries the template's own message.
struct RaisedByTemplate {
  std::string message;
};
[[noreturn]] void fail(std::string message);

// Python truthiness (Undefined is falsy).
bool truthy(const Value& v);
// Python str(v) as Jinja prints it (`{{ v }}`): Undefined prints as "".
std::string to_str(const Value& v);
// Python repr(v).
std::string repr(const Value& v);
// Python repr of a float (shortest round trip; "1.0", "1e-05", "1e+16").
std::string float_repr(double d);
// Python ==.
bool equals(const Value& a, const Value& b);
// Python <: -1, 0, 1; a TypeError (as RuntimeError) for types Python cannot order.
int compare(const Value& a, const Value& b);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys) as Hugging Face's tojson filter calls it.
// `indent` < 0 means None; separators default as Python's do (", " / ": ", or "," with an indent).
struct JsonOptions {
  bool ensure_ascii = false;
  int indent = -1;
  std::string indent_string;  // when indent was given as a string
  bool has_indent = false;
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonOptions& options);

// JSON (as parsed, key order kept) to a template value, and back for tests and callers.
Value from_json(const nlohmann::ordered_json& j);

// UTF-8 helpers: Python strings index by code point.
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
void utf8_append(std::string& out, char32_t c);
bool is_python_space(char32_t c);

}  // namespace tpmoe::text::jinja
