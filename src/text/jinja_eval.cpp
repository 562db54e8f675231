// The interpreter of parsed chat templates: statements, expressions, and the filters, tests, string and
// dict methods and globals that chat templates use, each with Jinja2's (and so Python's) semantics
// under Hugging Face's ImmutableSandboxedEnvironment.
//
// Scoping follows Jinja2: `if` opens no scope; every iteration of a `for` body is a fresh scope whose
// parent is the scope around the loop (so a `set` inside a loop is gone after the iteration: state that
// must survive goes in a namespace()); a macro body is a scope whose parent is the scope the macro was
// defined in, read at call time.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "core/error.h"
#include "text/jinja_ast.h"

namespace tpmoe::text::jinja {
namespace {

struct Frame {
  std::shared_ptr<Frame> parent;
  DictData vars;
};
using FramePtr = std::shared_ptr<Frame>;

// Python's type description in Jinja's undefined messages ("'dict object' has no attribute 'x'").
std::string object_type(const Value& v) {
  if (v.is_none()) return "None";
  return v.type_name() + " object";
}

Value missing_attribute(const Value& obj, const std::string& name) {
  if (obj.is_none()) return Value::undefined(fmt::format("'None' has no attribute '{}'", name));
  return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_type(obj), name));
}

Value missing_element(const Value& obj, const Value& key) {
  return Value::undefined(fmt::format("{} has no element {}", object_type(obj), repr(key)));
}

[[noreturn]] void fail_undefined(const Value& v) { fail(v.undefined_hint()); }

int64_t require_int(const Value& v, const char* what) {
  if (v.is_int()) return v.as_int();
  if (v.is_bool()) return v.as_bool();
  if (v.is_undefined()) fail_undefined(v);
  fail(fmt::format("{} must be an integer, not '{}'", what, v.type_name()));
}

const std::string& require_string(const Value& v, const char* what) {
  if (v.is_string()) return v.as_string();
  if (v.is_undefined()) fail_undefined(v);
  fail(fmt::format("{} must be a string, not '{}'", what, v.type_name()));
}

// The items a Python `for` sees: list items, dict keys, string characters; Undefined is empty.
std::vector<Value> iterate(const Value& v) {
  if (v.is_list()) return v.as_list()->items;
  if (v.is_dict()) {
    std::vector<Value> keys;
    for (const auto& [k, item] : v.as_dict()->items) keys.emplace_back(k);
    return keys;
  }
  if (v.is_string()) {
    std::vector<Value> chars;
    for (char32_t c : utf8_decode(v.as_string())) chars.emplace_back(utf8_encode(std::u32string(1, c)));
    return chars;
  }
  if (v.is_undefined()) return {};
  fail(fmt::format("'{}' object is not iterable", v.type_name()));
}

int64_t length(const Value& v) {
  if (v.is_string()) return int64_t(utf8_decode(v.as_string()).size());
  if (v.is_list()) return int64_t(v.as_list()->items.size());
  if (v.is_dict()) return int64_t(v.as_dict()->items.size());
  if (v.is_undefined()) return 0;
  fail(fmt::format("object of type '{}' has no len()", v.type_name()));
}

bool contains(const Value& container, const Value& item) {
  if (container.is_string()) {
    if (!item.is_string()) fail(fmt::format("'in <string>' requires string as left operand, not {}", item.type_name()));
    return container.as_string().find(item.as_string()) != std::string::npos;
  }
  if (container.is_list()) {
    for (const auto& e : container.as_list()->items)
      if (equals(e, item)) return true;
    return false;
  }
  if (container.is_dict()) return item.is_string() && container.as_dict()->find(item.as_string()) != nullptr;
  if (container.is_undefined()) return false;
  fail(fmt::format("argument of type '{}' is not iterable", container.type_name()));
}

// Case mapping for ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic (Python maps all of Unicode;
// text outside these blocks keeps its case).
char32_t to_upper_cp(char32_t c) {
  if (c >= U'a' && c <= U'z') return c - 32;
  if ((c >= 0xe0 && c <= 0xfe && c != 0xf7)) return c - 32;
  if (c == 0xff) return 0x178;
  if ((c >= 0x100 && c <= 0x137) || (c >= 0x14a && c <= 0x177)) return c & ~char32_t(1);
  if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e)) return (c % 2 == 0) ? c - 1 : c;
  if (c >= 0x3b1 && c <= 0x3c9) return c == 0x3c2 ? 0x3a3 : c - 32;
  if (c >= 0x430 && c <= 0x44f) return c - 32;
  if (c >= 0x450 && c <= 0x45f) return c - 80;
  return c;
}

char32_t to_lower_cp(char32_t c) {
  if (c >= U'A' && c <= U'Z') return c + 32;
  if ((c >= 0xc0 && c <= 0xde && c != 0xd7)) return c + 32;
  if (c == 0x178) return 0xff;
  if ((c >= 0x100 && c <= 0x137) || (c >= 0x14a && c <= 0x177)) return c | 1;
  if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e)) return (c % 2 == 1) ? c + 1 : c;
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) return c + 32;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}

bool is_cased_lower(char32_t c) { return to_upper_cp(c) != c || c == 0xdf; }
bool is_cased_upper(char32_t c) { return to_lower_cp(c) != c; }

std::string str_upper(const std::string& s) {
  std::u32string out;
  for (char32_t c : utf8_decode(s)) {
    if (c == 0xdf) {
      out += U"SS";
    } else {
      out += to_upper_cp(c);
    }
  }
  return utf8_encode(out);
}

std::string str_lower(const std::string& s) {
  std::u32string out;
  for (char32_t c : utf8_decode(s)) out += to_lower_cp(c);
  return utf8_encode(out);
}

std::string str_capitalize(const std::string& s) {
  std::u32string u = utf8_decode(s);
  std::u32string out;
  for (size_t i = 0; i < u.size(); ++i) out += i == 0 ? to_upper_cp(u[i]) : to_lower_cp(u[i]);
  return utf8_encode(out);
}

// Python's str.title(): a letter after a non-letter starts a word.
std::string str_title_python(const std::string& s) {
  std::u32string out;
  bool prev_cased = false;
  for (char32_t c : utf8_decode(s)) {
    const bool cased = is_cased_lower(c) || is_cased_upper(c);
    out += cased ? (prev_cased ? to_lower_cp(c) : to_upper_cp(c)) : c;
    prev_cased = cased;
  }
  return utf8_encode(out);
}

std::u32string strip_chars(const std::u32string& s, const Value* chars, bool left, bool right) {
  std::u32string set;
  const bool whitespace = !chars || chars->is_none();
  if (!whitespace) set = utf8_decode(require_string(*chars, "strip() argument"));
  auto strip = [&](char32_t c) { return whitespace ? is_python_space(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && strip(s[b])) ++b;
  if (right)
    while (e > b && strip(s[e - 1])) --e;
  return s.substr(b, e - b);
}

std::vector<Value> str_split(const std::string& s, const Value* sep_v, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (!sep_v || sep_v->is_none()) {
    // Runs of whitespace separate; leading and trailing whitespace make no empty parts.
    std::u32string u = utf8_decode(s);
    std::vector<std::u32string> words;
    if (!from_right) {
      size_t i = 0;
      while (i < u.size()) {
        while (i < u.size() && is_python_space(u[i])) ++i;
        if (i >= u.size()) break;
        if (maxsplit >= 0 && int64_t(words.size()) == maxsplit) {
          size_t e = u.size();
          while (e > i && is_python_space(u[e - 1])) --e;
          words.push_back(u.substr(i, e - i));
          break;
        }
        size_t j = i;
        while (j < u.size() && !is_python_space(u[j])) ++j;
        words.push_back(u.substr(i, j - i));
        i = j;
      }
    } else {
      size_t i = u.size();
      while (i > 0) {
        while (i > 0 && is_python_space(u[i - 1])) --i;
        if (i == 0) break;
        if (maxsplit >= 0 && int64_t(words.size()) == maxsplit) {
          size_t b = 0;
          while (b < i && is_python_space(u[b])) ++b;
          words.push_back(u.substr(b, i - b));
          break;
        }
        size_t j = i;
        while (j > 0 && !is_python_space(u[j - 1])) --j;
        words.push_back(u.substr(j, i - j));
        i = j;
      }
      std::reverse(words.begin(), words.end());
    }
    for (auto& w : words) parts.push_back(utf8_encode(w));
  } else {
    const std::string& sep = require_string(*sep_v, "split() separator");
    if (sep.empty()) fail("empty separator");
    if (!from_right) {
      size_t start = 0;
      while (true) {
        const size_t at = s.find(sep, start);
        if (at == std::string::npos || (maxsplit >= 0 && int64_t(parts.size()) == maxsplit)) {
          parts.push_back(s.substr(start));
          break;
        }
        parts.push_back(s.substr(start, at - start));
        start = at + sep.size();
      }
    } else {
      size_t end = s.size();
      while (true) {
        const size_t at = end >= sep.size() ? s.rfind(sep, end - sep.size()) : std::string::npos;
        if (at == std::string::npos || (maxsplit >= 0 && int64_t(parts.size()) == maxsplit)) {
          parts.push_back(s.substr(0, end));
          break;
        }
        parts.push_back(s.substr(at + sep.size(), end - at - sep.size()));
        end = at;
      }
      std::reverse(parts.begin(), parts.end());
    }
  }
  std::vector<Value> out;
  for (auto& p : parts) out.emplace_back(std::move(p));
  return out;
}

std::string str_replace(const std::string& s, const std::string& old, const std::string& replacement, int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement before every character and at the end.
    std::u32string u = utf8_decode(s);
    int64_t done = 0;
    for (char32_t c : u) {
      if (count < 0 || done < count) out += replacement, ++done;
      utf8_append(out, c);
    }
    if (count < 0 || done < count) out += replacement;
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t at = s.find(old, start);
    if (at == std::string::npos) break;
    out += s.substr(start, at - start) + replacement;
    start = at + old.size();
    ++done;
  }
  return out + s.substr(start);
}

std::vector<std::string> splitlines(const std::string& s, bool keepends) {
  std::u32string u = utf8_decode(s);
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    const char32_t c = u[i];
    const bool brk = c == U'\n' || c == U'\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
                     c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) continue;
    size_t end = i + 1;
    if (c == U'\r' && i + 1 < u.size() && u[i + 1] == U'\n') end = i + 2;
    lines.push_back(utf8_encode(u.substr(start, (keepends ? end : i) - start)));
    start = end;
    i = end - 1;
  }
  if (start < u.size()) lines.push_back(utf8_encode(u.substr(start)));
  return lines;
}

// Python's int(str): optional sign, digits with single underscores between them, surrounding spaces.
bool parse_python_int(const std::string& text, int64_t& out) {
  std::u32string u = strip_chars(utf8_decode(text), nullptr, true, true);
  std::string s = utf8_encode(u);
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if (i >= s.size()) return false;
  std::string digits;
  for (size_t k = i; k < s.size(); ++k) {
    if (std::isdigit((unsigned char)s[k])) {
      digits += s[k];
    } else if (s[k] == '_' && k > i && k + 1 < s.size() && std::isdigit((unsigned char)s[k - 1]) &&
               std::isdigit((unsigned char)s[k + 1])) {
      continue;
    } else {
      return false;
    }
  }
  try {
    out = std::stoll(digits);
  } catch (const std::exception&) {
    return false;
  }
  if (neg) out = -out;
  return true;
}

// Python's float(str).
bool parse_python_float(const std::string& text, double& out) {
  std::string s = utf8_encode(strip_chars(utf8_decode(text), nullptr, true, true));
  std::string lower = str_lower(s);
  std::string body = lower;
  double sign = 1;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    sign = body[0] == '-' ? -1 : 1;
    body = body.substr(1);
  }
  if (body == "inf" || body == "infinity") return out = sign * INFINITY, true;
  if (body == "nan") return out = NAN, true;
  std::string clean;
  bool digit_seen = false, exp_seen = false;
  for (size_t k = 0; k < s.size(); ++k) {
    const char c = s[k];
    if (c == '_') {
      if (k == 0 || k + 1 >= s.size() || !std::isdigit((unsigned char)s[k - 1]) ||
          !std::isdigit((unsigned char)s[k + 1]))
        return false;
      continue;
    }
    if (std::isdigit((unsigned char)c)) {
      digit_seen = true;
    } else if (c == 'e' || c == 'E') {
      if (exp_seen || !digit_seen) return false;
      exp_seen = true;
    } else if (c != '.' && c != '+' && c != '-') {
      return false;
    }
    clean += c;
  }
  if (!digit_seen) return false;
  char* end = nullptr;
  out = std::strtod(clean.c_str(), &end);
  return end && *end == '\0';
}

// Python's printf-style `str % args` for the conversions templates use: s r d i f F e E g G x X o c %.
std::string percent_format(const std::string& fmt_str, const Value& args) {
  std::vector<Value> positional;
  const DictData* named = args.is_dict() ? args.as_dict().get() : nullptr;
  if (args.is_list() && args.as_list()->is_tuple) {
    positional = args.as_list()->items;
  } else if (!named) {
    positional.push_back(args);
  }
  size_t next_arg = 0;
  std::string out;
  for (size_t i = 0; i < fmt_str.size(); ++i) {
    if (fmt_str[i] != '%') {
      out += fmt_str[i];
      continue;
    }
    if (++i >= fmt_str.size()) fail("incomplete format");
    const Value* arg = nullptr;
    if (fmt_str[i] == '(') {
      const size_t close = fmt_str.find(')', i);
      if (close == std::string::npos || !named) fail("format requires a mapping");
      arg = named->find(fmt_str.substr(i + 1, close - i - 1));
      if (!arg) fail(fmt::format("KeyError: '{}'", fmt_str.substr(i + 1, close - i - 1)));
      i = close + 1;
    }
    std::string flags;
    while (i < fmt_str.size() && std::strchr("-+ #0", fmt_str[i])) flags += fmt_str[i++];
    std::string width, precision;
    while (i < fmt_str.size() && std::isdigit((unsigned char)fmt_str[i])) width += fmt_str[i++];
    if (i < fmt_str.size() && fmt_str[i] == '.') {
      ++i;
      precision = "0";
      std::string p;
      while (i < fmt_str.size() && std::isdigit((unsigned char)fmt_str[i])) p += fmt_str[i++];
      if (!p.empty()) precision = p;
    }
    if (i >= fmt_str.size()) fail("incomplete format");
    const char conv = fmt_str[i];
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (!arg) {
      if (next_arg >= positional.size()) fail("not enough arguments for format string");
      arg = &positional[next_arg++];
    }
    std::string spec = "%" + flags + width + (precision.empty() ? "" : "." + precision);
    char buf[512];
    std::string piece;
    switch (conv) {
      case 's': piece = to_str(*arg); break;
      case 'r': piece = repr(*arg); break;
      case 'd':
      case 'i':
      case 'x':
      case 'X':
      case 'o': {
        if (!arg->is_number())
          fail(fmt::format("%{} format: a real number is required, not {}", conv, arg->type_name()));
        const long long v = arg->is_float() ? (long long)std::trunc(arg->as_float())
                                            : (long long)(arg->is_bool() ? arg->as_bool() : arg->as_int());
        std::snprintf(buf, sizeof(buf), (spec + "ll" + (conv == 'i' ? 'd' : conv)).c_str(), v);
        piece = buf;
        break;
      }
      case 'f':
      case 'F':
      case 'e':
      case 'E':
      case 'g':
      case 'G': {
        if (!arg->is_number()) fail(fmt::format("must be real number, not {}", arg->type_name()));
        std::snprintf(buf, sizeof(buf), (spec + conv).c_str(), arg->to_double());
        piece = buf;
        break;
      }
      case 'c': piece = to_str(*arg); break;
      default: fail(fmt::format("unsupported format character '{}'", conv));
    }
    if (conv == 's' || conv == 'r' || conv == 'c') {
      if (!precision.empty()) piece = utf8_encode(utf8_decode(piece).substr(0, std::stoul(precision)));
      const size_t w = width.empty() ? 0 : std::stoul(width);
      const size_t len = utf8_decode(piece).size();
      if (len < w)
        piece = flags.find('-') != std::string::npos ? piece + std::string(w - len, ' ')
                                                     : std::string(w - len, ' ') + piece;
    }
    out += piece;
  }
  if (next_arg < positional.size() && !named) fail("not all arguments converted during string formatting");
  return out;
}

// str.format() with {} / {0} / {name} fields and no format specs.
std::string brace_format(const std::string& s, const CallArgs& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '{' && i + 1 < s.size() && s[i + 1] == '{') {
      out += '{';
      ++i;
    } else if (s[i] == '}' && i + 1 < s.size() && s[i + 1] == '}') {
      out += '}';
      ++i;
    } else if (s[i] == '{') {
      const size_t close = s.find('}', i);
      if (close == std::string::npos) fail("Single '{' encountered in format string");
      const std::string field = s.substr(i + 1, close - i - 1);
      if (field.find_first_of(":!") != std::string::npos) fail("format specs in str.format() are not supported");
      const Value* v = nullptr;
      if (field.empty()) {
        if (auto_index >= a.args.size()) fail(fmt::format("Replacement index {} out of range", auto_index));
        v = &a.args[auto_index++];
      } else if (std::all_of(field.begin(), field.end(), [](char c) { return std::isdigit((unsigned char)c); })) {
        const size_t k = std::stoul(field);
        if (k >= a.args.size()) fail(fmt::format("Replacement index {} out of range", k));
        v = &a.args[k];
      } else {
        for (const auto& [k, val] : a.kwargs)
          if (k == field) v = &val;
        if (!v) fail(fmt::format("KeyError: '{}'", field));
      }
      out += to_str(*v);
      i = close;
    } else {
      out += s[i];
    }
  }
  return out;
}

// Python slicing of a list, tuple or string.
Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  auto opt = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_none() || v.is_undefined()) return std::nullopt;
    return require_int(v, what);
  };
  const auto start_o = opt(start_v, "slice start"), stop_o = opt(stop_v, "slice stop");
  const int64_t step = opt(step_v, "slice step").value_or(1);
  if (step == 0) fail("slice step cannot be zero");
  std::u32string text;
  int64_t n;
  if (obj.is_string()) {
    text = utf8_decode(obj.as_string());
    n = int64_t(text.size());
  } else if (obj.is_list()) {
    n = int64_t(obj.as_list()->items.size());
  } else if (obj.is_undefined()) {
    fail_undefined(obj);
  } else {
    return Value::undefined(fmt::format("{} has no element slice", object_type(obj)));
  }
  auto clamp = [&](std::optional<int64_t> v, int64_t def, int64_t lo, int64_t hi) {
    if (!v) return def;
    int64_t x = *v;
    if (x < 0) x += n;
    return std::clamp(x, lo, hi);
  };
  const int64_t start = step > 0 ? clamp(start_o, 0, 0, n) : clamp(start_o, n - 1, -1, n - 1);
  const int64_t stop = step > 0 ? clamp(stop_o, n, 0, n) : clamp(stop_o, -1, -1, n - 1);
  std::vector<int64_t> idx;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) idx.push_back(i);
  if (obj.is_string()) {
    std::u32string out;
    for (int64_t i : idx) out += text[size_t(i)];
    return Value(utf8_encode(out));
  }
  std::vector<Value> items;
  for (int64_t i : idx) items.push_back(obj.as_list()->items[size_t(i)]);
  return Value::list(std::move(items), obj.as_list()->is_tuple);
}

// Python's round(x, ndigits) on a float: correctly rounded, ties to even.
double python_round(double x, int64_t ndigits) {
  if (!std::isfinite(x)) return x;
  if (ndigits == 0) return std::nearbyint(x);
  char buf[512];
  if (ndigits > 0) {
    std::snprintf(buf, sizeof(buf), "%.*f", int(std::min<int64_t>(ndigits, 300)), x);
    return std::strtod(buf, nullptr);
  }
  const double p = std::pow(10.0, double(-ndigits));
  return std::nearbyint(x / p) * p;
}

class Interpreter {
 public:
  Interpreter(const DictData& context, const RenderOptions& options) : options_(options) {
    globals_ = std::make_shared<Frame>();
    install_globals();
    auto ctx = std::make_shared<Frame>();
    ctx->parent = globals_;
    ctx->vars = context;
    root_ = std::make_shared<Frame>();
    root_->parent = ctx;
  }

  std::string run(const Program& program) {
    std::string out;
    try {
      if (exec(program.body, root_, out) != Flow::kNormal) fail("'break' or 'continue' outside a loop");
    } catch (const RuntimeError& e) {
      TPMOE_FAIL("chat template error at line {}: {}", line_, e.message);
    } catch (const RaisedByTemplate& e) {
      TPMOE_FAIL("chat template raised an exception (line {}): {}", line_, e.message);
    }
    return out;
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  static constexpr int kMaxMacroDepth = 256;
  // The sandbox's limit on range() (Jinja2's MAX_RANGE).
  static constexpr int64_t kMaxRange = 100000;
  // The largest string or list `*` may build (bytes or items): a guard against a template exhausting
  // memory, far above anything a prompt needs.
  static constexpr uint64_t kMaxRepeat = uint64_t(1) << 26;

  // Statements -------------------------------------------------------------------------------------

  Flow exec(const Body& body, const FramePtr& frame, std::string& out) {
    for (const auto& node : body) {
      const Flow flow = exec(*node, frame, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Node& node, const FramePtr& frame, std::string& out) {
    line_ = node.line;
    switch (node.kind) {
      case Node::Kind::kText: out += node.text; return Flow::kNormal;
      case Node::Kind::kOutput: out += to_str(eval(*node.expr, frame)); return Flow::kNormal;
      case Node::Kind::kIf:
        for (size_t i = 0; i < node.conds.size(); ++i)
          if (truthy(eval(*node.conds[i], frame))) return exec(node.bodies[i], frame, out);
        return exec(node.else_body, frame, out);
      case Node::Kind::kFor: return exec_for(node, frame, out);
      case Node::Kind::kSet: {
        Value value = eval(*node.expr, frame);
        line_ = node.line;
        if (!node.attr.empty()) {
          const Value target = lookup(node.targets[0], frame);
          if (!target.is_namespace()) fail("cannot assign attribute on non-namespace object");
          target.as_namespace()->attrs.set(node.attr, std::move(value));
        } else {
          assign(node.targets, std::move(value), *frame);
        }
        return Flow::kNormal;
      }
      case Node::Kind::kSetBlock: {
        auto inner = child(frame);
        std::string captured;
        exec_body_no_flow(node.bodies[0], inner, captured);
        Value value(std::move(captured));
        if (node.filter) value = apply_filter_chain(*node.filter, std::move(value), frame);
        frame->vars.set(node.targets[0], std::move(value));
        return Flow::kNormal;
      }
      case Node::Kind::kMacro: frame->vars.set(node.name, make_macro(node, frame)); return Flow::kNormal;
      case Node::Kind::kBreak: return Flow::kBreak;
      case Node::Kind::kContinue: return Flow::kContinue;
      case Node::Kind::kFilterBlock: {
        std::string captured;
        exec_body_no_flow(node.bodies[0], child(frame), captured);
        out += to_str(apply_filter_chain(*node.filter, Value(std::move(captured)), frame));
        return Flow::kNormal;
      }
      case Node::Kind::kWith: {
        auto inner = child(frame);
        for (size_t i = 0; i < node.targets.size(); ++i) inner->vars.set(node.targets[i], eval(*node.values[i], frame));
        return exec(node.bodies[0], inner, out);
      }
      case Node::Kind::kScope: return exec(node.bodies[0], child(frame), out);
    }
    return Flow::kNormal;
  }

  void exec_body_no_flow(const Body& body, const FramePtr& frame, std::string& out) {
    if (exec(body, frame, out) != Flow::kNormal) fail("'break' or 'continue' outside a loop");
  }

  static FramePtr child(const FramePtr& parent) {
    auto f = std::make_shared<Frame>();
    f->parent = parent;
    return f;
  }

  void assign(const std::vector<std::string>& targets, Value value, Frame& frame) {
    if (targets.size() == 1) {
      frame.vars.set(targets[0], std::move(value));
      return;
    }
    std::vector<Value> items = iterate(value);
    if (items.size() > targets.size()) fail(fmt::format("too many values to unpack (expected {})", targets.size()));
    if (items.size() < targets.size())
      fail(fmt::format("not enough values to unpack (expected {}, got {})", targets.size(), items.size()));
    for (size_t i = 0; i < targets.size(); ++i) frame.vars.set(targets[i], items[i]);
  }

  Flow exec_for(const Node& node, const FramePtr& frame, std::string& out) {
    const Value iterable = eval(*node.expr, frame);
    std::vector<Value> items = iterate(iterable);
    if (node.cond) {
      std::vector<Value> kept;
      for (auto& item : items) {
        auto f = child(frame);
        assign(node.targets, item, *f);
        if (truthy(eval(*node.cond, f))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    const int64_t n = int64_t(items.size());
    for (int64_t i = 0; i < n; ++i) {
      auto f = child(frame);
      assign(node.targets, items[size_t(i)], *f);
      auto loop = std::make_shared<DictData>();
      loop->set("index", Value(i + 1));
      loop->set("index0", Value(i));
      loop->set("revindex", Value(n - i));
      loop->set("revindex0", Value(n - i - 1));
      loop->set("first", Value(i == 0));
      loop->set("last", Value(i == n - 1));
      loop->set("length", Value(n));
      loop->set("depth", Value(1));
      loop->set("depth0", Value(0));
      loop->set("previtem", i > 0 ? items[size_t(i - 1)] : Value::undefined("there is no previous item"));
      loop->set("nextitem", i + 1 < n ? items[size_t(i + 1)] : Value::undefined("there is no next item"));
      loop->set("cycle", Value::function("loop.cycle", [i](CallArgs& a) -> Value {
                  if (a.args.empty()) fail("no items for cycling given");
                  return a.args[size_t(i) % a.args.size()];
                }));
      f->vars.set("loop", Value(std::move(loop)));
      const Flow flow = exec(node.bodies[0], f, out);
      if (flow == Flow::kBreak) break;
    }
    if (n == 0) return exec(node.else_body, child(frame), out);
    return Flow::kNormal;
  }

  Value make_macro(const Node& node, const FramePtr& scope) {
    const Node* macro = &node;
    // The scope holds the macro and the macro reads the scope: the interpreter owns the scope (until
    // the render ends) and the macro points at it, so no reference cycle leaks them.
    scopes_.push_back(scope);
    Frame* defined_in = scope.get();
    return Value::function(node.name, [this, macro, defined_in](CallArgs& a) -> Value {
      if (a.args.size() > macro->params.size())
        fail(fmt::format("macro '{}' takes not more than {} argument(s)", macro->name, macro->params.size()));
      for (const auto& [k, v] : a.kwargs)
        if (std::find(macro->params.begin(), macro->params.end(), k) == macro->params.end())
          fail(fmt::format("macro '{}' takes no keyword argument '{}'", macro->name, k));
      if (macro_depth_ >= kMaxMacroDepth)
        fail(fmt::format("maximum recursion depth exceeded in macro '{}'", macro->name));
      auto f = std::make_shared<Frame>();
      f->parent = std::shared_ptr<Frame>(std::shared_ptr<Frame>(), defined_in);  // non-owning
      for (size_t i = 0; i < macro->params.size(); ++i) {
        const Value* given = a.get(i, macro->params[i]);
        if (given) {
          f->vars.set(macro->params[i], *given);
        } else if (macro->defaults[i]) {
          f->vars.set(macro->params[i], eval(*macro->defaults[i], f));
        } else {
          f->vars.set(macro->params[i],
                      Value::undefined(fmt::format("parameter '{}' was not provided", macro->params[i])));
        }
      }
      const int saved_line = line_;
      ++macro_depth_;
      std::string out;
      exec_body_no_flow(macro->bodies[0], f, out);
      --macro_depth_;
      line_ = saved_line;
      return Value(std::move(out));
    });
  }

  Value lookup(const std::string& name, const FramePtr& frame) const {
    for (const Frame* f = frame.get(); f; f = f->parent.get())
      if (const Value* v = f->vars.find(name)) return *v;
    return Value::undefined(fmt::format("'{}' is undefined", name));
  }

  // Expressions ------------------------------------------------------------------------------------

  Value eval(const Expr& e, const FramePtr& frame) {
    switch (e.kind) {
      case Expr::Kind::kLiteral: return e.literal;
      case Expr::Kind::kName: return lookup(e.name, frame);
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        std::vector<Value> items;
        for (const auto& item : e.items) items.push_back(eval(*item, frame));
        return Value::list(std::move(items), e.kind == Expr::Kind::kTuple);
      }
      case Expr::Kind::kDict: {
        auto d = std::make_shared<DictData>();
        for (size_t i = 0; i < e.items.size(); i += 2) {
          const Value key = eval(*e.items[i], frame);
          if (!key.is_string())
            fail(fmt::format("dict keys must be strings in chat templates, got '{}'", key.type_name()));
          d->set(key.as_string(), eval(*e.items[i + 1], frame));
        }
        return Value(std::move(d));
      }
      case Expr::Kind::kGetAttr: return get_attr(eval(*e.items[0], frame), e.name);
      case Expr::Kind::kGetItem: return get_item(eval(*e.items[0], frame), eval(*e.items[1], frame));
      case Expr::Kind::kSlice: {
        const Value obj = eval(*e.items[0], frame);
        auto part = [&](size_t i) { return e.items[i] ? eval(*e.items[i], frame) : Value(None{}); };
        return slice(obj, part(1), part(2), part(3));
      }
      case Expr::Kind::kCall: {
        const Value callee = eval(*e.items[0], frame);
        CallArgs args = eval_args(e, frame);
        return call(callee, args);
      }
      case Expr::Kind::kFilter: {
        Value operand = eval(*e.items[0], frame);
        return apply_filter(e, std::move(operand), frame);
      }
      case Expr::Kind::kTest: {
        const Value operand = eval(*e.items[0], frame);
        CallArgs args = eval_args(e, frame);
        return Value(apply_test(e.name, operand, args));
      }
      case Expr::Kind::kUnary: {
        const Value v = eval(*e.items[0], frame);
        if (v.is_undefined()) fail_undefined(v);
        if (!v.is_number()) fail(fmt::format("bad operand type for unary {}: '{}'", e.name, v.type_name()));
        if (e.name == "+") return v.is_bool() ? Value(int64_t(v.as_bool())) : v;
        if (v.is_float()) return Value(-v.as_float());
        return Value(-(v.is_bool() ? int64_t(v.as_bool()) : v.as_int()));
      }
      case Expr::Kind::kBinary: return binary(e.name, eval(*e.items[0], frame), eval(*e.items[1], frame));
      case Expr::Kind::kConcat: {
        std::string s;
        for (const auto& item : e.items) s += to_str(eval(*item, frame));
        return Value(std::move(s));
      }
      case Expr::Kind::kCompare: {
        Value left = eval(*e.items[0], frame);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.items[i + 1], frame);
          if (!compare_op(e.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::Kind::kAnd: {
        Value left = eval(*e.items[0], frame);
        return truthy(left) ? eval(*e.items[1], frame) : left;
      }
      case Expr::Kind::kOr: {
        Value left = eval(*e.items[0], frame);
        return truthy(left) ? left : eval(*e.items[1], frame);
      }
      case Expr::Kind::kNot: return Value(!truthy(eval(*e.items[0], frame)));
      case Expr::Kind::kCondExpr:
        if (truthy(eval(*e.items[1], frame))) return eval(*e.items[0], frame);
        if (e.items[2]) return eval(*e.items[2], frame);
        return Value::undefined(fmt::format(
            "the inline if-expression on line {} evaluated to false and no else section was defined.", e.line));
    }
    return Value();
  }

  CallArgs eval_args(const Expr& e, const FramePtr& frame) {
    CallArgs a;
    for (size_t i = 1; i < e.items.size(); ++i) a.args.push_back(eval(*e.items[i], frame));
    for (const auto& [k, v] : e.kwargs) a.kwargs.emplace_back(k, eval(*v, frame));
    return a;
  }

  Value call(const Value& callee, CallArgs& args) {
    if (callee.is_undefined()) fail_undefined(callee);
    if (!callee.is_callable()) fail(fmt::format("'{}' object is not callable", callee.type_name()));
    return callee.as_callable()->fn(args);
  }

  bool compare_op(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "in") return contains(b, a);
    if (op == "not in") return !contains(b, a);
    if (a.is_undefined()) fail_undefined(a);
    if (b.is_undefined()) fail_undefined(b);
    const int c = compare(a, b);
    if (op == "<") return c < 0;
    if (op == ">") return c > 0;
    if (op == "<=") return c <= 0;
    return c >= 0;
  }

  static Value binary(const std::string& op, const Value& a, const Value& b) {
    if (a.is_undefined()) fail_undefined(a);
    if (b.is_undefined()) fail_undefined(b);
    const bool both_numbers = a.is_number() && b.is_number();
    const bool ints = both_numbers && !a.is_float() && !b.is_float();
    auto as_i = [](const Value& v) { return v.is_bool() ? int64_t(v.as_bool()) : v.as_int(); };
    auto unsupported = [&]() -> Value {
      fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, a.type_name(), b.type_name()));
    };
    // Python integers are unbounded; ours are 64-bit, so overflow is an error rather than a wrong number.
    auto overflow = [&]() -> Value {
      fail(fmt::format("integer overflow in {} (Python's big integers are not supported)", op));
    };
    int64_t r = 0;
    if (op == "+") {
      if (ints) return __builtin_add_overflow(as_i(a), as_i(b), &r) ? overflow() : Value(r);
      if (both_numbers) return Value(a.to_double() + b.to_double());
      if (a.is_string() && b.is_string()) return Value(a.as_string() + b.as_string());
      if (a.is_list() && b.is_list() && a.as_list()->is_tuple == b.as_list()->is_tuple) {
        std::vector<Value> items = a.as_list()->items;
        items.insert(items.end(), b.as_list()->items.begin(), b.as_list()->items.end());
        return Value::list(std::move(items), a.as_list()->is_tuple);
      }
      if (a.is_string()) fail(fmt::format("can only concatenate str (not \"{}\") to str", b.type_name()));
      if (a.is_list() && !a.as_list()->is_tuple)
        fail(fmt::format("can only concatenate list (not \"{}\") to list", b.type_name()));
      return unsupported();
    }
    if (op == "-") {
      if (ints) return __builtin_sub_overflow(as_i(a), as_i(b), &r) ? overflow() : Value(r);
      if (both_numbers) return Value(a.to_double() - b.to_double());
      return unsupported();
    }
    if (op == "*") {
      if (ints) return __builtin_mul_overflow(as_i(a), as_i(b), &r) ? overflow() : Value(r);
      if (both_numbers) return Value(a.to_double() * b.to_double());
      const Value* seq = a.is_string() || a.is_list() ? &a : (b.is_string() || b.is_list() ? &b : nullptr);
      const Value* count = seq == &a ? &b : &a;
      if (seq && (count->is_int() || count->is_bool())) {
        const int64_t times = std::max<int64_t>(0, as_i(*count));
        const size_t unit = seq->is_string() ? seq->as_string().size() : seq->as_list()->items.size();
        if (unit > 0 && uint64_t(times) > kMaxRepeat / unit) fail("repetition result too large");
        if (seq->is_string()) {
          std::string s;
          for (int64_t i = 0; i < times; ++i) s += seq->as_string();
          return Value(std::move(s));
        }
        std::vector<Value> items;
        for (int64_t i = 0; i < times; ++i)
          items.insert(items.end(), seq->as_list()->items.begin(), seq->as_list()->items.end());
        return Value::list(std::move(items), seq->as_list()->is_tuple);
      }
      if (seq) fail(fmt::format("can't multiply sequence by non-int of type '{}'", count->type_name()));
      return unsupported();
    }
    if (op == "/") {
      if (!both_numbers) return unsupported();
      if (b.to_double() == 0) fail("division by zero");
      return Value(a.to_double() / b.to_double());
    }
    if (op == "//") {
      if (!both_numbers) return unsupported();
      if (b.to_double() == 0) fail("integer division or modulo by zero");
      if (ints) {
        const int64_t x = as_i(a), y = as_i(b);
        int64_t q = x / y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
        return Value(q);
      }
      return Value(std::floor(a.to_double() / b.to_double()));
    }
    if (op == "%") {
      if (a.is_string()) return Value(percent_format(a.as_string(), b));
      if (!both_numbers) return unsupported();
      if (b.to_double() == 0) fail("integer division or modulo by zero");
      if (ints) {
        const int64_t x = as_i(a), y = as_i(b);
        int64_t r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) r += y;
        return Value(r);
      }
      const double x = a.to_double(), y = b.to_double();
      double r = std::fmod(x, y);
      if (r != 0 && ((r < 0) != (y < 0))) r += y;
      return Value(r);
    }
    if (op == "**") {
      if (!both_numbers) return unsupported();
      if (ints && as_i(b) >= 0) {
        int64_t p = 1;
        for (int64_t i = 0, base = as_i(a); i < as_i(b); ++i) {
          if (__builtin_mul_overflow(p, base, &p)) return overflow();
          if (p == 0 || p == 1) break;  // 0 ** n, 1 ** n
          if (p == -1 && base == -1) {
            p = as_i(b) % 2 ? -1 : 1;
            break;
          }
        }
        return Value(p);
      }
      return Value(std::pow(a.to_double(), b.to_double()));
    }
    fail(fmt::format("unknown operator '{}'", op));
  }

  // Attribute and item access: Python's getattr first, then getitem (Jinja's environment.getattr), or
  // the other way round for `x[key]`.
  Value get_attr(const Value& obj, const std::string& name) {
    if (obj.is_undefined()) fail_undefined(obj);
    // A method (or the undefined that stands for a method the sandbox forbids) wins over a dict key.
    if (Value method = method_of(obj, name); !method.is_undefined() || !method.undefined_hint().empty()) return method;
    if (obj.is_dict()) {
      if (const Value* v = obj.as_dict()->find(name)) return *v;
    } else if (obj.is_namespace()) {
      if (const Value* v = obj.as_namespace()->attrs.find(name)) return *v;
    }
    return missing_attribute(obj, name);
  }

  Value get_item(const Value& obj, const Value& key) {
    if (obj.is_undefined()) fail_undefined(obj);
    if (key.is_undefined()) fail_undefined(key);
    if (obj.is_dict() && key.is_string()) {
      if (const Value* v = obj.as_dict()->find(key.as_string())) return *v;
    } else if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
      int64_t i = key.is_bool() ? int64_t(key.as_bool()) : key.as_int();
      if (obj.is_list()) {
        const auto& items = obj.as_list()->items;
        if (i < 0) i += int64_t(items.size());
        if (i >= 0 && i < int64_t(items.size())) return items[size_t(i)];
      } else {
        const std::u32string u = utf8_decode(obj.as_string());
        if (i < 0) i += int64_t(u.size());
        if (i >= 0 && i < int64_t(u.size())) return Value(utf8_encode(u.substr(size_t(i), 1)));
      }
      return missing_element(obj, key);
    }
    if (key.is_string()) {
      Value method = method_of(obj, key.as_string());
      if (!method.is_undefined() || !method.undefined_hint().empty()) return method;
      if (obj.is_namespace())
        if (const Value* v = obj.as_namespace()->attrs.find(key.as_string())) return *v;
      return missing_attribute(obj, key.as_string());
    }
    return missing_element(obj, key);
  }

  // A bound method of a str, dict or list; an undefined with an "unsafe" hint for the methods the
  // immutable sandbox forbids; a plain undefined (empty hint) when there is no such method.
  Value method_of(const Value& obj, const std::string& name) {
    static const char* kStrMethods[] = {
        "strip",   "lstrip", "rstrip",       "split",        "rsplit",     "splitlines", "startswith", "endswith",
        "replace", "upper",  "lower",        "title",        "capitalize", "find",       "rfind",      "index",
        "rindex",  "count",  "join",         "isdigit",      "isalpha",    "isalnum",    "isspace",    "islower",
        "isupper", "format", "removeprefix", "removesuffix", "swapcase"};
    static const char* kDictMethods[] = {"items", "keys", "values", "get", "copy"};
    static const char* kDictUnsafe[] = {"pop", "popitem", "setdefault", "update", "clear"};
    static const char* kListMethods[] = {"index", "count", "copy"};
    static const char* kListUnsafe[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear"};
    auto in = [&](const auto& list) { return std::find(std::begin(list), std::end(list), name) != std::end(list); };
    auto unsafe = [&]() {
      return Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.", name, obj.type_name()));
    };
    if (obj.is_string() && in(kStrMethods)) {
      const std::string s = obj.as_string();
      return Value::function("str." + name, [this, s, name](CallArgs& a) { return string_method(s, name, a); });
    }
    if (obj.is_dict()) {
      if (in(kDictUnsafe)) return unsafe();
      if (in(kDictMethods)) {
        const Value d = obj;
        return Value::function("dict." + name, [d, name](CallArgs& a) { return dict_method(d, name, a); });
      }
    }
    if (obj.is_list()) {
      if (in(kListUnsafe)) return unsafe();
      if (in(kListMethods)) {
        const Value l = obj;
        return Value::function("list." + name, [l, name](CallArgs& a) -> Value {
          if (name == "copy") return Value::list(l.as_list()->items, l.as_list()->is_tuple);
          if (a.args.size() != 1) fail(fmt::format("list.{}() takes exactly one argument", name));
          int64_t count = 0;
          const auto& items = l.as_list()->items;
          for (size_t i = 0; i < items.size(); ++i) {
            if (!equals(items[i], a.args[0])) continue;
            if (name == "index") return Value(int64_t(i));
            ++count;
          }
          if (name == "index") fail(fmt::format("{} is not in list", repr(a.args[0])));
          return Value(count);
        });
      }
    }
    return Value::undefined("");
  }

  static Value dict_method(const Value& d, const std::string& name, CallArgs& a) {
    const auto& items = d.as_dict()->items;
    if (name == "items" || name == "keys" || name == "values") {
      if (!a.args.empty()) fail(fmt::format("dict.{}() takes no arguments", name));
      std::vector<Value> out;
      for (const auto& [k, v] : items) {
        if (name == "items") {
          out.push_back(Value::list({Value(k), v}, true));
        } else {
          out.push_back(name == "keys" ? Value(k) : v);
        }
      }
      return Value::list(std::move(out));
    }
    if (name == "copy") return Value(std::make_shared<DictData>(*d.as_dict()));
    // get(key, default=None)
    if (a.args.empty() || a.args.size() > 2) fail("dict.get() takes one or two arguments");
    if (a.args[0].is_string())
      if (const Value* v = d.as_dict()->find(a.args[0].as_string())) return *v;
    return a.args.size() > 1 ? a.args[1] : Value(None{});
  }

  Value string_method(const std::string& s, const std::string& name, CallArgs& a) {
    auto arg = [&](size_t i) -> const Value* { return i < a.args.size() ? &a.args[i] : nullptr; };
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      return Value(utf8_encode(strip_chars(utf8_decode(s), arg(0), name != "rstrip", name != "lstrip")));
    }
    if (name == "split" || name == "rsplit") {
      const Value* sep = a.get(0, "sep");
      const Value* maxsplit = a.get(1, "maxsplit");
      return Value::list(str_split(s, sep, maxsplit ? require_int(*maxsplit, "maxsplit") : -1, name == "rsplit"));
    }
    if (name == "splitlines") {
      std::vector<Value> out;
      for (auto& line : splitlines(s, arg(0) && truthy(*arg(0)))) out.emplace_back(std::move(line));
      return Value::list(std::move(out));
    }
    if (name == "startswith" || name == "endswith") {
      if (!arg(0)) fail(fmt::format("{}() takes at least 1 argument", name));
      std::u32string u = utf8_decode(s);
      int64_t n = int64_t(u.size());
      int64_t start = arg(1) && !arg(1)->is_none() ? require_int(*arg(1), "start") : 0;
      int64_t end = arg(2) && !arg(2)->is_none() ? require_int(*arg(2), "end") : n;
      if (start < 0) start = std::max<int64_t>(0, start + n);
      if (end < 0) end = std::max<int64_t>(0, end + n);
      start = std::min(start, n), end = std::min(end, n);
      const std::string sub = start <= end ? utf8_encode(u.substr(size_t(start), size_t(end - start))) : "";
      std::vector<Value> options = arg(0)->is_list() ? arg(0)->as_list()->items : std::vector<Value>{*arg(0)};
      for (const auto& o : options) {
        const std::string& p = require_string(o, fmt::format("{}() argument", name).c_str());
        if (start > end) continue;
        const bool hit = name == "startswith"
                             ? sub.compare(0, p.size(), p) == 0 && sub.size() >= p.size()
                             : sub.size() >= p.size() && sub.compare(sub.size() - p.size(), p.size(), p) == 0;
        if (hit) return Value(true);
      }
      return Value(false);
    }
    if (name == "replace") {
      if (a.args.size() < 2) fail("replace() takes at least 2 arguments");
      const int64_t count = arg(2) ? require_int(*arg(2), "count") : -1;
      return Value(str_replace(s, require_string(a.args[0], "replace() argument"),
                               require_string(a.args[1], "replace() argument"), count));
    }
    if (name == "upper") return Value(str_upper(s));
    if (name == "lower") return Value(str_lower(s));
    if (name == "title") return Value(str_title_python(s));
    if (name == "capitalize") return Value(str_capitalize(s));
    if (name == "swapcase") {
      std::u32string out;
      for (char32_t c : utf8_decode(s)) out += is_cased_upper(c) ? to_lower_cp(c) : to_upper_cp(c);
      return Value(utf8_encode(out));
    }
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
      if (!arg(0)) fail(fmt::format("{}() takes at least 1 argument", name));
      const std::string& sub = require_string(*arg(0), fmt::format("{}() argument", name).c_str());
      if (name == "count") {
        if (sub.empty()) return Value(int64_t(utf8_decode(s).size()) + 1);
        int64_t c = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++c;
        return Value(c);
      }
      const size_t at = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
      if (at == std::string::npos) {
        if (name == "index" || name == "rindex") fail("substring not found");
        return Value(int64_t(-1));
      }
      return Value(int64_t(utf8_decode(s.substr(0, at)).size()));
    }
    if (name == "join") {
      if (!arg(0)) fail("join() takes exactly one argument");
      std::string out;
      bool first = true;
      for (const auto& item : iterate(*arg(0))) {
        if (!item.is_string()) fail(fmt::format("sequence item: expected str instance, {} found", item.type_name()));
        if (!first) out += s;
        first = false;
        out += item.as_string();
      }
      return Value(std::move(out));
    }
    if (name == "removeprefix" || name == "removesuffix") {
      if (!arg(0)) fail(fmt::format("{}() takes exactly one argument", name));
      const std::string& p = require_string(*arg(0), fmt::format("{}() argument", name).c_str());
      if (name == "removeprefix") return Value(s.compare(0, p.size(), p) == 0 ? s.substr(p.size()) : s);
      return Value(s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0
                       ? s.substr(0, s.size() - p.size())
                       : s);
    }
    if (name == "format") return Value(brace_format(s, a));
    // is* predicates
    std::u32string u = utf8_decode(s);
    if (u.empty()) return Value(false);
    auto all = [&](auto pred) { return std::all_of(u.begin(), u.end(), pred); };
    if (name == "isspace") return Value(all(is_python_space));
    if (name == "isdigit") return Value(all([](char32_t c) { return c >= U'0' && c <= U'9'; }));
    if (name == "isalpha") return Value(all([](char32_t c) { return is_cased_lower(c) || is_cased_upper(c); }));
    if (name == "isalnum")
      return Value(all([](char32_t c) { return (c >= U'0' && c <= U'9') || is_cased_lower(c) || is_cased_upper(c); }));
    bool any_cased = false;
    for (char32_t c : u) any_cased |= is_cased_lower(c) || is_cased_upper(c);
    if (name == "islower") return Value(any_cased && !std::any_of(u.begin(), u.end(), is_cased_upper));
    if (name == "isupper")
      return Value(any_cased && !std::any_of(u.begin(), u.end(),
                                             [](char32_t c) { return is_cased_lower(c) && !is_cased_upper(c); }));
    fail(fmt::format("'str' object has no attribute '{}'", name));
  }

  // Filters ----------------------------------------------------------------------------------------

  Value apply_filter_chain(const Expr& filter, Value operand, const FramePtr& frame) {
    // A chain parsed with a null innermost operand: apply from the innermost filter out.
    std::vector<const Expr*> chain;
    for (const Expr* f = &filter; f; f = f->items[0] ? f->items[0].get() : nullptr) chain.push_back(f);
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) operand = apply_filter(**it, std::move(operand), frame);
    return operand;
  }

  Value apply_filter(const Expr& e, Value operand, const FramePtr& frame) {
    CallArgs args = eval_args(e, frame);
    line_ = e.line;
    return filter(e.name, operand, args);
  }

  Value attribute_of(const Value& item, const std::string& path) {
    // Jinja's make_attrgetter: dotted paths, integer parts index.
    Value v = item;
    size_t start = 0;
    while (true) {
      const size_t dot = path.find('.', start);
      const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      int64_t index;
      if (!part.empty() &&
          std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit((unsigned char)c); }) &&
          parse_python_int(part, index)) {
        v = get_item(v, Value(index));
      } else {
        v = get_item(v, Value(part));
      }
      if (dot == std::string::npos) return v;
      start = dot + 1;
    }
  }

  Value filter(const std::string& name, const Value& v, CallArgs& a) {
    auto arg = [&](size_t i, const char* key) { return a.get(i, key); };
    if (name == "tojson") {
      // Hugging Face's override: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
      JsonOptions o;
      if (const Value* x = arg(0, "ensure_ascii")) o.ensure_ascii = truthy(*x);
      if (const Value* x = arg(1, "indent"); x && !x->is_none()) {
        o.has_indent = true;
        o.item_separator = ",";
        if (x->is_string()) {
          o.indent_string = x->as_string();
        } else {
          o.indent_string = std::string(size_t(std::max<int64_t>(0, require_int(*x, "tojson indent"))), ' ');
        }
      }
      if (const Value* x = arg(2, "separators"); x && !x->is_none()) {
        const auto items = iterate(*x);
        if (items.size() != 2) fail("tojson separators must be a pair (item_separator, key_separator)");
        o.item_separator = require_string(items[0], "tojson separator");
        o.key_separator = require_string(items[1], "tojson separator");
      }
      if (const Value* x = arg(3, "sort_keys")) o.sort_keys = truthy(*x);
      return Value(to_json(v, o));
    }
    if (name == "trim") {
      return Value(utf8_encode(strip_chars(utf8_decode(to_str(v)), arg(0, "chars"), true, true)));
    }
    if (name == "length" || name == "count") return Value(length(v));
    if (name == "default" || name == "d") {
      const Value* def = arg(0, "default_value");
      const Value* boolean = arg(1, "boolean");
      const bool use_default = v.is_undefined() || (boolean && truthy(*boolean) && !truthy(v));
      if (use_default) return def ? *def : Value("");
      return v;
    }
    if (name == "join") {
      const Value* sep = arg(0, "d");
      const Value* attribute = arg(1, "attribute");
      std::string out;
      bool first = true;
      for (const auto& item : iterate(v)) {
        if (!first) out += sep ? to_str(*sep) : "";
        first = false;
        out += to_str(attribute && !attribute->is_none() ? attribute_of(item, to_str(*attribute)) : item);
      }
      return Value(std::move(out));
    }
    if (name == "upper") return Value(str_upper(to_str(v)));
    if (name == "lower") return Value(str_lower(to_str(v)));
    if (name == "capitalize") return Value(str_capitalize(to_str(v)));
    if (name == "title") {
      // Jinja's title: words begin after runs of '-', whitespace, '(', '{', '[', '<'.
      std::u32string u = utf8_decode(to_str(v)), out;
      bool start = true;
      for (char32_t c : u) {
        const bool sep = c == U'-' || c == U'(' || c == U'{' || c == U'[' || c == U'<' || is_python_space(c);
        out += sep ? c : (start ? to_upper_cp(c) : to_lower_cp(c));
        start = sep;
      }
      return Value(utf8_encode(out));
    }
    if (name == "string" || name == "safe") return Value(to_str(v));
    if (name == "e" || name == "escape") {
      std::string out;
      for (char c : to_str(v)) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
      }
      return Value(std::move(out));
    }
    if (name == "first" || name == "last") {
      auto items = iterate(v);
      if (items.empty()) return Value::undefined(fmt::format("No {} item, sequence was empty.", name));
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") return Value::list(iterate(v));
    if (name == "items") {
      if (v.is_undefined()) return Value::list({});
      if (!v.is_dict()) fail("Can only get item pairs from a mapping.");
      CallArgs none;
      return dict_method(v, "items", none);
    }
    if (name == "replace") {
      if (a.args.size() < 2) fail("replace filter takes old and new strings");
      const Value* count = arg(2, "count");
      return Value(str_replace(to_str(v), to_str(a.args[0]), to_str(a.args[1]),
                               count && !count->is_none() ? require_int(*count, "count") : -1));
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::u32string u = utf8_decode(v.as_string());
        std::reverse(u.begin(), u.end());
        return Value(utf8_encode(u));
      }
      auto items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    }
    if (name == "int") {
      const Value* def = arg(0, "default");
      const Value fallback = def ? *def : Value(int64_t(0));
      if (v.is_bool()) return Value(int64_t(v.as_bool()));
      if (v.is_int()) return v;
      if (v.is_float()) return std::isfinite(v.as_float()) ? Value(int64_t(std::trunc(v.as_float()))) : fallback;
      if (v.is_string()) {
        int64_t i;
        if (parse_python_int(v.as_string(), i)) return Value(i);
        double d;
        if (parse_python_float(v.as_string(), d) && std::isfinite(d)) return Value(int64_t(std::trunc(d)));
      }
      return fallback;
    }
    if (name == "float") {
      const Value* def = arg(0, "default");
      const Value fallback = def ? *def : Value(0.0);
      if (v.is_number()) return Value(v.to_double());
      double d;
      if (v.is_string() && parse_python_float(v.as_string(), d)) return Value(d);
      return fallback;
    }
    if (name == "abs") {
      if (!v.is_number()) fail(fmt::format("bad operand type for abs(): '{}'", v.type_name()));
      if (v.is_float()) return Value(std::fabs(v.as_float()));
      const int64_t i = v.is_bool() ? int64_t(v.as_bool()) : v.as_int();
      return Value(i < 0 ? -i : i);
    }
    if (name == "round") {
      const Value* precision = arg(0, "precision");
      const Value* method = arg(1, "method");
      const int64_t p = precision ? require_int(*precision, "precision") : 0;
      const std::string m = method ? to_str(*method) : "common";
      if (m != "common" && m != "ceil" && m != "floor") fail("method must be common, ceil or floor");
      if (!v.is_number()) fail(fmt::format("type {} doesn't define __round__ method", v.type_name()));
      if (m == "common") {
        if (!v.is_float()) return v.is_bool() ? Value(int64_t(v.as_bool())) : v;  // round(int, n) stays an int
        return Value(python_round(v.as_float(), p));
      }
      const double scale = std::pow(10.0, double(p));
      const double x = v.to_double() * scale;
      return Value((m == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
    }
    if (name == "sum") {
      const Value* attribute = arg(0, "attribute");
      const Value* start = arg(1, "start");
      Value total = start ? *start : Value(int64_t(0));
      for (const auto& item : iterate(v))
        total = binary("+", total, attribute && !attribute->is_none() ? attribute_of(item, to_str(*attribute)) : item);
      return total;
    }
    if (name == "min" || name == "max") {
      const Value* cs = arg(0, "case_sensitive");
      const Value* attribute = arg(1, "attribute");
      auto items = iterate(v);
      if (items.empty()) return Value::undefined(fmt::format("No aggregated item, sequence was empty."));
      auto key = [&](const Value& item) {
        Value k = attribute && !attribute->is_none() ? attribute_of(item, to_str(*attribute)) : item;
        if (!(cs && truthy(*cs)) && k.is_string()) k = Value(str_lower(k.as_string()));
        return k;
      };
      size_t best = 0;
      for (size_t i = 1; i < items.size(); ++i) {
        const int c = compare(key(items[i]), key(items[best]));
        if (name == "min" ? c < 0 : c > 0) best = i;
      }
      return items[best];
    }
    if (name == "sort" || name == "unique" || name == "dictsort") return sort_filter(name, v, a);
    if (name == "map") {
      std::vector<Value> out;
      const Value* attribute = nullptr;
      for (const auto& [k, val] : a.kwargs)
        if (k == "attribute") attribute = &val;
      if (attribute) {
        const Value* def = nullptr;
        for (const auto& [k, val] : a.kwargs)
          if (k == "default") def = &val;
        for (const auto& item : iterate(v)) {
          Value x = attribute_of(item, to_str(*attribute));
          out.push_back(x.is_undefined() && def ? *def : x);
        }
        return Value::list(std::move(out));
      }
      if (a.args.empty()) fail("map requires a filter name or attribute=");
      const std::string fname = require_string(a.args[0], "map filter name");
      CallArgs rest;
      rest.args.assign(a.args.begin() + 1, a.args.end());
      rest.kwargs = a.kwargs;
      if (!is_known_filter(fname)) fail(fmt::format("no filter named '{}'", fname));
      for (const auto& item : iterate(v)) {
        CallArgs copy = rest;
        out.push_back(filter(fname, item, copy));
      }
      return Value::list(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool by_attr = name.size() > 6;
      const bool keep_if = name[0] == 's';
      size_t next = 0;
      std::string attribute;
      if (by_attr) {
        if (a.args.empty()) fail(fmt::format("{} requires an attribute name", name));
        attribute = to_str(a.args[next++]);
      }
      std::string test_name;
      if (next < a.args.size()) test_name = require_string(a.args[next++], "test name");
      if (!test_name.empty() && !is_known_test(test_name)) fail(fmt::format("no test named '{}'", test_name));
      CallArgs test_args;
      test_args.args.assign(a.args.begin() + long(next), a.args.end());
      test_args.kwargs = a.kwargs;
      std::vector<Value> out;
      for (const auto& item : iterate(v)) {
        const Value x = by_attr ? attribute_of(item, attribute) : item;
        const bool passed = test_name.empty() ? truthy(x) : apply_test(test_name, x, test_args);
        if (passed == keep_if) out.push_back(item);
      }
      return Value::list(std::move(out));
    }
    if (name == "attr") {
      if (a.args.empty()) fail("attr requires a name");
      const std::string attr_name = to_str(a.args[0]);
      if (v.is_undefined()) fail_undefined(v);
      Value method = method_of(v, attr_name);
      if (!method.is_undefined() || !method.undefined_hint().empty()) return method;
      if (v.is_namespace())
        if (const Value* x = v.as_namespace()->attrs.find(attr_name)) return *x;
      return missing_attribute(v, attr_name);
    }
    if (name == "indent") {
      const Value* width = arg(0, "width");
      const Value* first = arg(1, "first");
      const Value* blank = arg(2, "blank");
      const std::string pad = width && width->is_string()
                                  ? width->as_string()
                                  : std::string(size_t(width ? require_int(*width, "width") : 4), ' ');
      const auto lines = splitlines(to_str(v) + "\n", false);
      std::string rv;
      if (blank && truthy(*blank)) {
        for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + pad : "") + lines[i];
      } else if (!lines.empty()) {
        rv = lines[0];
        for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : pad + lines[i]);
      }
      if (first && truthy(*first)) rv = pad + rv;
      return Value(std::move(rv));
    }
    if (name == "wordcount") {
      int64_t words = 0;
      bool in_word = false;
      for (char32_t c : utf8_decode(to_str(v))) {
        const bool w = c == U'_' || (c >= U'0' && c <= U'9') || is_cased_lower(c) || is_cased_upper(c) || c > 0x2e7f;
        if (w && !in_word) ++words;
        in_word = w;
      }
      return Value(words);
    }
    if (name == "format") {
      if (!a.kwargs.empty() && !a.args.empty()) fail("can't handle positional and keyword arguments at the same time");
      Value args_v = Value::list(a.args, true);
      if (!a.kwargs.empty()) {
        auto d = std::make_shared<DictData>();
        for (const auto& [k, x] : a.kwargs) d->set(k, x);
        args_v = Value(std::move(d));
      }
      return Value(percent_format(to_str(v), args_v));
    }
    fail(fmt::format("no filter named '{}'", name));
  }

  Value sort_filter(const std::string& name, const Value& v, CallArgs& a) {
    if (name == "dictsort") {
      if (!v.is_dict()) fail("dictsort requires a mapping");
      const Value* cs = a.get(0, "case_sensitive");
      const Value* by = a.get(1, "by");
      const Value* reverse = a.get(2, "reverse");
      const bool by_value = by && to_str(*by) == "value";
      std::vector<Value> items;
      for (const auto& [k, x] : v.as_dict()->items) items.push_back(Value::list({Value(k), x}, true));
      auto key = [&](const Value& item) {
        Value k = item.as_list()->items[by_value ? 1 : 0];
        if (!(cs && truthy(*cs)) && k.is_string()) k = Value(str_lower(k.as_string()));
        return k;
      };
      std::stable_sort(items.begin(), items.end(),
                       [&](const Value& x, const Value& y) { return compare(key(x), key(y)) < 0; });
      if (reverse && truthy(*reverse)) std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    }
    const bool is_sort = name == "sort";
    const Value* reverse = is_sort ? a.get(0, "reverse") : nullptr;
    const Value* cs = a.get(is_sort ? 1 : 0, "case_sensitive");
    const Value* attribute = a.get(is_sort ? 2 : 1, "attribute");
    auto key = [&](const Value& item) {
      Value k = attribute && !attribute->is_none() ? attribute_of(item, to_str(*attribute)) : item;
      if (!(cs && truthy(*cs)) && k.is_string()) k = Value(str_lower(k.as_string()));
      return k;
    };
    std::vector<Value> items = iterate(v);
    if (is_sort) {
      const bool rev = reverse && truthy(*reverse);
      // Python's sort(reverse=True) keeps equal items in their original order.
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        return rev ? compare(key(y), key(x)) < 0 : compare(key(x), key(y)) < 0;
      });
      return Value::list(std::move(items));
    }
    std::vector<Value> out, seen;
    for (const auto& item : items) {
      const Value k = key(item);
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, k); })) {
        seen.push_back(k);
        out.push_back(item);
      }
    }
    return Value::list(std::move(out));
  }

  // Tests ------------------------------------------------------------------------------------------

  static bool is_known_test(const std::string& name) {
    static const char* kTests[] = {"defined",  "undefined", "none",    "boolean", "false",    "true",        "integer",
                                   "float",    "number",    "string",  "mapping", "iterable", "sequence",    "callable",
                                   "sameas",   "escaped",   "in",      "odd",     "even",     "divisibleby", "lower",
                                   "upper",    "eq",        "equalto", "==",      "ne",       "!=",          "lt",
                                   "lessthan", "<",         "le",      "<=",      "gt",       "greaterthan", ">",
                                   "ge",       ">=",        "filter",  "test"};
    return std::find(std::begin(kTests), std::end(kTests), name) != std::end(kTests);
  }

  static bool is_known_filter(const std::string& name) {
    static const char* kFilters[] = {
        "tojson", "trim",       "length",     "count",      "default", "d",      "join",      "upper",
        "lower",  "capitalize", "title",      "string",     "safe",    "e",      "escape",    "first",
        "last",   "list",       "items",      "replace",    "reverse", "int",    "float",     "abs",
        "round",  "sum",        "min",        "max",        "sort",    "unique", "dictsort",  "map",
        "select", "reject",     "selectattr", "rejectattr", "attr",    "indent", "wordcount", "format"};
    return std::find(std::begin(kFilters), std::end(kFilters), name) != std::end(kFilters);
  }

  bool apply_test(const std::string& name, const Value& v, CallArgs& a) {
    auto arg0 = [&]() -> const Value& {
      if (a.args.empty()) fail(fmt::format("test '{}' needs an argument", name));
      return a.args[0];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.is_bool();
    if (name == "true") return v.is_bool() && v.as_bool();
    if (name == "false") return v.is_bool() && !v.as_bool();
    if (name == "integer") return v.is_int();
    if (name == "float") return v.is_float();
    if (name == "number") return v.is_number();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict();
    // Undefined iterates as empty and has a length in Jinja, so it is iterable and a sequence.
    if (name == "iterable") return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
    if (name == "sequence") return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
    if (name == "callable") return v.is_callable() || v.is_undefined();
    if (name == "escaped") return false;
    if (name == "sameas") {
      const Value& o = arg0();
      if (v.is_none() || o.is_none()) return v.is_none() && o.is_none();
      if (v.is_bool() || o.is_bool()) return v.is_bool() && o.is_bool() && v.as_bool() == o.as_bool();
      if (v.is_int() && o.is_int()) return v.as_int() == o.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
      if (v.is_list() && o.is_list()) return v.as_list() == o.as_list();
      if (v.is_dict() && o.is_dict()) return v.as_dict() == o.as_dict();
      if (v.is_namespace() && o.is_namespace()) return v.as_namespace() == o.as_namespace();
      if (v.is_callable() && o.is_callable()) return v.as_callable() == o.as_callable();
      return false;
    }
    if (name == "in") return contains(arg0(), v);
    if (name == "odd" || name == "even") {
      const int64_t i = require_int(v, "odd/even test value");
      return (((i % 2) + 2) % 2 == 1) == (name == "odd");
    }
    if (name == "divisibleby") {
      const Value r = binary("%", v, arg0());
      return equals(r, Value(int64_t(0)));
    }
    if (name == "lower" || name == "upper") {
      CallArgs none;
      return truthy(string_method(to_str(v), name == "lower" ? "islower" : "isupper", none));
    }
    if (name == "eq" || name == "equalto" || name == "==") return equals(v, arg0());
    if (name == "ne" || name == "!=") return !equals(v, arg0());
    if (name == "lt" || name == "lessthan" || name == "<") return compare_op("<", v, arg0());
    if (name == "le" || name == "<=") return compare_op("<=", v, arg0());
    if (name == "gt" || name == "greaterthan" || name == ">") return compare_op(">", v, arg0());
    if (name == "ge" || name == ">=") return compare_op(">=", v, arg0());
    if (name == "filter") return v.is_string() && is_known_filter(v.as_string());
    if (name == "test") return v.is_string() && is_known_test(v.as_string());
    fail(fmt::format("no test named '{}'", name));
  }

  // Globals ----------------------------------------------------------------------------------------

  void install_globals() {
    auto& g = globals_->vars;
    g.set("range", Value::function("range", [](CallArgs& a) -> Value {
            if (a.args.empty() || a.args.size() > 3) fail("range expected 1 to 3 arguments");
            int64_t start = 0, stop, step = 1;
            if (a.args.size() == 1) {
              stop = require_int(a.args[0], "range() argument");
            } else {
              start = require_int(a.args[0], "range() argument");
              stop = require_int(a.args[1], "range() argument");
              if (a.args.size() == 3) step = require_int(a.args[2], "range() argument");
            }
            if (step == 0) fail("range() arg 3 must not be zero");
            std::vector<Value> items;
            for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
              if (int64_t(items.size()) >= kMaxRange)
                fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
              items.emplace_back(i);
            }
            return Value::list(std::move(items));
          }));
    auto make_mapping = [](CallArgs& a, const char* what) {
      auto d = std::make_shared<DictData>();
      if (a.args.size() > 1) fail(fmt::format("{} expected at most 1 positional argument", what));
      if (!a.args.empty()) {
        const Value& init = a.args[0];
        if (init.is_dict()) {
          *d = *init.as_dict();
        } else {
          for (const auto& pair : iterate(init)) {
            auto kv = iterate(pair);
            if (kv.size() != 2) fail(fmt::format("{}: sequence elements must be pairs", what));
            d->set(require_string(kv[0], "key"), kv[1]);
          }
        }
      }
      for (auto& [k, v] : a.kwargs) d->set(k, v);
      return d;
    };
    g.set("namespace", Value::function("namespace", [make_mapping](CallArgs& a) -> Value {
            auto ns = std::make_shared<NamespaceData>();
            ns->attrs = *make_mapping(a, "namespace");
            return Value(std::move(ns));
          }));
    g.set("dict",
          Value::function("dict", [make_mapping](CallArgs& a) -> Value { return Value(make_mapping(a, "dict")); }));
    g.set("raise_exception", Value::function("raise_exception", [](CallArgs& a) -> Value {
            throw RaisedByTemplate{a.args.empty() ? std::string() : to_str(a.args[0])};
          }));
    g.set("strftime_now", Value::function("strftime_now", [this](CallArgs& a) -> Value {
            if (a.args.size() != 1) fail("strftime_now takes exactly one argument (the format)");
            const std::string& format = require_string(a.args[0], "strftime_now format");
            const std::time_t now = options_.now ? *options_.now : std::time(nullptr);
            std::tm tm{};
            localtime_r(&now, &tm);
            char buf[1024];
            const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &tm);
            if (n == 0 && !format.empty()) fail("strftime_now: format produced no output or is too long");
            return Value(std::string(buf, n));
          }));
  }

  const RenderOptions& options_;
  FramePtr globals_, root_;
  std::vector<FramePtr> scopes_;  // scopes that define macros, alive until the render ends
  int line_ = 0;
  int macro_depth_ = 0;
};

}  // namespace

std::string render(const Program& program, const DictData& context, const RenderOptions& options) {
  Interpreter interpreter(context, options);
  return interpreter.run(program);
}

}  // namespace tpmoe::text::jinja
