// Python semantics for template values: truthiness, str()/repr(), ==, <, and json.dumps.
#include "text/jinja_value.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

namespace tpmoe::text::jinja {

const Value* DictData::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

Value* DictData::find(std::string_view key) {
  for (auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void DictData::set(std::string key, Value value) {
  if (Value* slot = find(key)) {
    *slot = std::move(value);
  } else {
    items.emplace_back(std::move(key), std::move(value));
  }
}

Value Value::list(std::vector<Value> items, bool is_tuple) {
  auto l = std::make_shared<ListData>();
  l->items = std::move(items);
  l->is_tuple = is_tuple;
  return Value(std::move(l));
}

Value Value::dict() { return Value(std::make_shared<DictData>()); }

Value Value::function(std::string name, std::function<Value(CallArgs&)> fn) {
  return Value(std::make_shared<Callable>(Callable{std::move(name), std::move(fn)}));
}

double Value::to_double() const {
  if (is_bool()) return as_bool() ? 1.0 : 0.0;
  if (is_int()) return double(as_int());
  return as_float();
}

std::string Value::type_name() const {
  if (is_undefined()) return "Undefined";
  if (is_none()) return "NoneType";
  if (is_bool()) return "bool";
  if (is_int()) return "int";
  if (is_float()) return "float";
  if (is_string()) return "str";
  if (is_list()) return as_list()->is_tuple ? "tuple" : "list";
  if (is_dict()) return "dict";
  if (is_namespace()) return "Namespace";
  return "function";
}

const Value* CallArgs::get(size_t position, std::string_view name) const {
  for (const auto& [k, v] : kwargs)
    if (k == name) return &v;
  return position < args.size() ? &args[position] : nullptr;
}

void fail(std::string message) { throw RuntimeError{std::move(message)}; }

bool truthy(const Value& v) {
  if (v.is_undefined() || v.is_none()) return false;
  if (v.is_bool()) return v.as_bool();
  if (v.is_int()) return v.as_int() != 0;
  if (v.is_float()) return v.as_float() != 0.0;
  if (v.is_string()) return !v.as_string().empty();
  if (v.is_list()) return !v.as_list()->items.empty();
  if (v.is_dict()) return !v.as_dict()->items.empty();
  return true;
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, as CPython's repr picks them; then CPython's layout: positional
  // notation for decimal exponents in [-4, 16), scientific with a two-digit exponent otherwise.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (sci[0] == '-') sign = "-", sci.erase(0, 1);
  const size_t e_pos = sci.find('e');
  std::string digits = sci.substr(0, e_pos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exponent = std::stoi(sci.substr(e_pos + 1));
  if (exponent < -4 || exponent >= 16) {
    std::string mantissa = digits.substr(0, 1);
    if (digits.size() > 1) mantissa += "." + digits.substr(1);
    return fmt::format("{}{}e{}{:02d}", sign, mantissa, exponent < 0 ? '-' : '+', std::abs(exponent));
  }
  const int point = exponent + 1;  // digits before the decimal point
  const int n = int(digits.size());
  if (point <= 0) return sign + "0." + std::string(-point, '0') + digits;
  if (point < n) return sign + digits.substr(0, point) + "." + digits.substr(point);
  return sign + digits + std::string(point - n, '0') + ".0";
}

namespace {

// Python's str.isprintable, approximately: control characters, separators other than the space,
// format characters and private-use characters print escaped in repr(). (Unassigned code points,
// which CPython also escapes, are not tracked.)
bool is_printable(char32_t c) {
  if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) || (c >= 0x205f && c <= 0x2064) ||
      (c >= 0x2066 && c <= 0x206f) || c == 0x3000 || c == 0xfeff)
    return false;
  if ((c >= 0x600 && c <= 0x605) || c == 0x61c || c == 0x6dd || c == 0x70f || c == 0x180e) return false;
  if ((c >= 0xe000 && c <= 0xf8ff) || (c >= 0xfff9 && c <= 0xfffb) || c == 0xfffe || c == 0xffff) return false;
  if (c >= 0xf0000) return false;
  return true;
}

std::string string_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : utf8_decode(s)) {
    if (c == char32_t(quote) || c == U'\\') {
      out += '\\';
      out += char(c);
    } else if (c == U'\t') {
      out += "\\t";
    } else if (c == U'\n') {
      out += "\\n";
    } else if (c == U'\r') {
      out += "\\r";
    } else if (c < 0x7f && c >= 0x20) {
      out += char(c);
    } else if (!is_printable(c)) {
      if (c <= 0xff) {
        out += fmt::format("\\x{:02x}", uint32_t(c));
      } else if (c <= 0xffff) {
        out += fmt::format("\\u{:04x}", uint32_t(c));
      } else {
        out += fmt::format("\\U{:08x}", uint32_t(c));
      }
    } else {
      utf8_append(out, c);
    }
  }
  out += quote;
  return out;
}

}  // namespace

namespace {

// Values nested deeper than this are an error when printed or serialized (Python's repr and json.dumps
// raise RecursionError near there too) rather than a stack overflow.
constexpr int kMaxNesting = 512;

std::string repr_at(const Value& v, int depth);

}  // namespace

std::string repr(const Value& v) { return repr_at(v, 0); }

namespace {

std::string repr_at(const Value& v, int depth) {
  if (depth > kMaxNesting) fail("maximum recursion depth exceeded while printing a value");
  if (v.is_string()) return string_repr(v.as_string());
  if (v.is_list()) {
    const auto& l = *v.as_list();
    std::string out = l.is_tuple ? "(" : "[";
    for (size_t i = 0; i < l.items.size(); ++i) {
      if (i) out += ", ";
      out += repr_at(l.items[i], depth + 1);
    }
    if (l.is_tuple && l.items.size() == 1) out += ",";
    out += l.is_tuple ? ")" : "]";
    return out;
  }
  if (v.is_dict()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, item] : v.as_dict()->items) {
      if (!first) out += ", ";
      first = false;
      out += string_repr(k) + ": " + repr_at(item, depth + 1);
    }
    return out + "}";
  }
  if (v.is_undefined()) return "Undefined";
  return to_str(v);
}

}  // namespace

std::string to_str(const Value& v) {
  if (v.is_undefined()) return "";
  if (v.is_none()) return "None";
  if (v.is_bool()) return v.as_bool() ? "True" : "False";
  if (v.is_int()) return std::to_string(v.as_int());
  if (v.is_float()) return float_repr(v.as_float());
  if (v.is_string()) return v.as_string();
  if (v.is_namespace()) {
    Value d(std::make_shared<DictData>(v.as_namespace()->attrs));
    return "<Namespace " + repr(d) + ">";
  }
  if (v.is_callable()) return "<function " + v.as_callable()->name + ">";
  return repr(v);
}

bool equals(const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined()) return a.is_undefined() && b.is_undefined();
  if (a.is_number() && b.is_number()) {
    if (!a.is_float() && !b.is_float()) {
      const int64_t x = a.is_bool() ? int64_t(a.as_bool()) : a.as_int();
      const int64_t y = b.is_bool() ? int64_t(b.as_bool()) : b.as_int();
      return x == y;
    }
    return a.to_double() == b.to_double();
  }
  if (a.is_none() || b.is_none()) return a.is_none() && b.is_none();
  if (a.is_string() && b.is_string()) return a.as_string() == b.as_string();
  if (a.is_list() && b.is_list()) {
    const auto& x = *a.as_list();
    const auto& y = *b.as_list();
    if (x.is_tuple != y.is_tuple || x.items.size() != y.items.size()) return false;
    for (size_t i = 0; i < x.items.size(); ++i)
      if (!equals(x.items[i], y.items[i])) return false;
    return true;
  }
  if (a.is_dict() && b.is_dict()) {
    const auto& x = *a.as_dict();
    const auto& y = *b.as_dict();
    if (x.items.size() != y.items.size()) return false;
    for (const auto& [k, item] : x.items) {
      const Value* other = y.find(k);
      if (!other || !equals(item, *other)) return false;
    }
    return true;
  }
  if (a.is_namespace() && b.is_namespace()) return a.as_namespace() == b.as_namespace();
  if (a.is_callable() && b.is_callable()) return a.as_callable() == b.as_callable();
  return false;
}

int compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (!a.is_float() && !b.is_float()) {
      const int64_t x = a.is_bool() ? int64_t(a.as_bool()) : a.as_int();
      const int64_t y = b.is_bool() ? int64_t(b.as_bool()) : b.as_int();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    const double x = a.to_double(), y = b.to_double();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  // UTF-8 byte order is code point order, which is how Python orders strings.
  if (a.is_string() && b.is_string())
    return a.as_string().compare(b.as_string()) < 0 ? -1 : (a.as_string() == b.as_string() ? 0 : 1);
  if (a.is_list() && b.is_list() && a.as_list()->is_tuple == b.as_list()->is_tuple) {
    const auto& x = a.as_list()->items;
    const auto& y = b.as_list()->items;
    for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
      if (equals(x[i], y[i])) continue;
      return compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  fail(fmt::format("'<' not supported between instances of '{}' and '{}'", a.type_name(), b.type_name()));
}

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case U'"': out += "\\\""; break;
      case U'\\': out += "\\\\"; break;
      case U'\n': out += "\\n"; break;
      case U'\r': out += "\\r"; break;
      case U'\t': out += "\\t"; break;
      case U'\b': out += "\\b"; break;
      case U'\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (ensure_ascii && c > 0x7e)) {
          if (c > 0xffff) {
            const uint32_t v = uint32_t(c) - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
          } else {
            out += fmt::format("\\u{:04x}", uint32_t(c));
          }
        } else {
          utf8_append(out, c);
        }
    }
  }
  out += '"';
}

void json_write(std::string& out, const Value& v, const JsonOptions& o, int level) {
  if (level > kMaxNesting) fail("maximum recursion depth exceeded while encoding a JSON object");
  auto newline = [&](int depth) {
    if (!o.has_indent) return;
    out += '\n';
    for (int i = 0; i < depth; ++i) out += o.indent_string;
  };
  if (v.is_none()) {
    out += "null";
  } else if (v.is_bool()) {
    out += v.as_bool() ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(v.as_int());
  } else if (v.is_float()) {
    const double d = v.as_float();
    out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : float_repr(d);
  } else if (v.is_string()) {
    json_string(out, v.as_string(), o.ensure_ascii);
  } else if (v.is_list()) {
    const auto& items = v.as_list()->items;
    if (items.empty()) {
      out += "[]";
      return;
    }
    out += '[';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += o.item_separator;
      newline(level + 1);
      json_write(out, items[i], o, level + 1);
    }
    newline(level);
    out += ']';
  } else if (v.is_dict()) {
    std::vector<const std::pair<std::string, Value>*> items;
    for (const auto& item : v.as_dict()->items) items.push_back(&item);
    if (items.empty()) {
      out += "{}";
      return;
    }
    if (o.sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
    out += '{';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += o.item_separator;
      newline(level + 1);
      json_string(out, items[i]->first, o.ensure_ascii);
      out += o.key_separator;
      json_write(out, items[i]->second, o, level + 1);
    }
    newline(level);
    out += '}';
  } else {
    fail(fmt::format("Object of type {} is not JSON serializable", v.type_name()));
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_write(out, v, options, 0);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value(None{});
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u <= uint64_t(INT64_MAX)) return Value(int64_t(u));
      return Value(double(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      for (const auto& e : j) items.push_back(from_json(e));
      return Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = std::make_shared<DictData>();
      for (const auto& [k, e] : j.items()) d->set(k, from_json(e));
      return Value(std::move(d));
    }
    default: fail("unsupported JSON value (binary or discarded)");
  }
}

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    int n = 0;
    char32_t cp = 0;
    if (c < 0x80) {
      cp = c, n = 1;
    } else if ((c >> 5) == 0x6) {
      cp = c & 0x1f, n = 2;
    } else if ((c >> 4) == 0xe) {
      cp = c & 0x0f, n = 3;
    } else if ((c >> 3) == 0x1e) {
      cp = c & 0x07, n = 4;
    } else {
      fail(fmt::format("invalid UTF-8 byte 0x{:02x} at offset {}", c, i));
    }
    if (i + n > s.size()) fail(fmt::format("truncated UTF-8 sequence at offset {}", i));
    for (int k = 1; k < n; ++k) {
      const unsigned char cc = s[i + k];
      if ((cc >> 6) != 0x2) fail(fmt::format("invalid UTF-8 continuation byte at offset {}", i + k));
      cp = (cp << 6) | (cc & 0x3f);
    }
    out += cp;
    i += n;
  }
  return out;
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xc0 | (c >> 6));
    out += char(0x80 | (c & 0x3f));
  } else if (c < 0x10000) {
    out += char(0xe0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3f));
    out += char(0x80 | (c & 0x3f));
  } else {
    out += char(0xf0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3f));
    out += char(0x80 | ((c >> 6) & 0x3f));
    out += char(0x80 | (c & 0x3f));
  }
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) utf8_append(out, c);
  return out;
}

bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

}  // namespace tpmoe::text::jinja
