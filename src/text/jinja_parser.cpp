// Lexer and parser of the Jinja2 subset chat templates use.
//
// The lexer reproduces Jinja2's whitespace rules under Hugging Face's settings: newlines normalized to
// "\n" and one trailing newline dropped (keep_trailing_newline=False); trim_blocks drops the newline
// right after a block or comment tag; lstrip_blocks drops spaces and tabs before a block or comment
// tag that starts its line; "-" strips all whitespace on its side, "+" disables lstrip. Inside a tag,
// an end delimiter does not count while a bracket is open (Jinja's balancing stack), so
// `{{ {'a': {'b': 1}} }}` lexes.
//
// The parser is a recursive descent over Jinja2's grammar and precedence (lowest first): `x if c else
// y`, or, and, not, comparisons (chained; in, not in), + -, ~, * / // %, **, unary - +, then primary
// with postfix `.attr`, `[key]`, `[a:b:c]`, `(args)`, `| filter`, `is test`.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "text/jinja_ast.h"

namespace tpmoe::text::jinja {
namespace {

struct Token {
  enum class Kind { kData, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };
  Kind kind;
  std::string text;  // data text, name, operator, decoded string
  Value number;
  size_t offset = 0;
};

const char* kind_name(Token::Kind k) {
  switch (k) {
    case Token::Kind::kData: return "template data";
    case Token::Kind::kVarBegin: return "'{{'";
    case Token::Kind::kVarEnd: return "end of print statement ('}}')";
    case Token::Kind::kBlockBegin: return "'{%'";
    case Token::Kind::kBlockEnd: return "end of statement block ('%}')";
    case Token::Kind::kName: return "name";
    case Token::Kind::kString: return "string";
    case Token::Kind::kInt: return "integer";
    case Token::Kind::kFloat: return "float";
    case Token::Kind::kOp: return "operator";
    case Token::Kind::kEof: return "end of template";
  }
  return "token";
}

class Lexer {
 public:
  explicit Lexer(const std::string& raw) {
    // Newlines normalized to "\n"; one trailing newline dropped (Jinja2's keep_trailing_newline=False).
    src_.reserve(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\r') {
        src_ += '\n';
        if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
      } else {
        src_ += raw[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::pair<int, int> position(size_t offset) const {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const size_t line = size_t(it - line_starts_.begin());
    return {int(line), int(offset - line_starts_[line - 1]) + 1};
  }

  [[noreturn]] void error(size_t offset, const std::string& message) const {
    const auto [line, column] = position(offset);
    TPMOE_FAIL("chat template syntax error at line {}, column {}: {}", line, column, message);
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    const size_t n = src_.size();
    while (pos < n) {
      const size_t start = find_tag(pos);
      if (start == std::string::npos) {
        push_data(src_.substr(pos), pos);
        break;
      }
      const char kind = src_[start + 1];
      const char sign = start + 2 < n && (src_[start + 2] == '-' || src_[start + 2] == '+') ? src_[start + 2] : 0;
      std::string text = src_.substr(pos, start - pos);
      if (sign == '-') {
        text = rstrip_space(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: spaces and tabs between the line start and a block or comment tag go.
        const size_t line_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((line_pos > 0 || line_starting) && line_pos < text.size() &&
            std::all_of(text.begin() + line_pos, text.end(), [](char c) { return is_space(c); }))
          text.resize(line_pos);
      }
      push_data(std::move(text), pos);
      pos = start + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        const size_t end = src_.find("#}", pos);
        if (end == std::string::npos) error(start, "missing end of comment tag");
        const char end_sign = end > pos ? src_[end - 1] : 0;
        pos = end + 2;
        if (end_sign == '-') {
          while (pos < n && is_space(src_[pos])) ++pos;
        } else if (end_sign != '+' && pos < n && src_[pos] == '\n') {
          ++pos;  // trim_blocks
        }
        line_starting = src_[pos - 1] == '\n';
        continue;
      }
      if (kind == '%' && is_raw_begin(pos)) {
        pos = lex_raw(start, pos, line_starting);
        continue;
      }
      pos = lex_tag(kind == '{', start, pos);
      line_starting = src_[pos - 1] == '\n';
    }
    tokens_.push_back(Token{Token::Kind::kEof, "", Value(), n});
    return std::move(tokens_);
  }

  const std::string& source() const { return src_; }

 private:
  static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
  static bool is_name_start(char c) { return std::isalpha((unsigned char)c) || c == '_'; }
  static bool is_name_char(char c) { return std::isalnum((unsigned char)c) || c == '_'; }

  static std::string rstrip_space(const std::string& s) {
    size_t end = s.size();
    while (end > 0 && is_space(s[end - 1])) --end;
    return s.substr(0, end);
  }

  size_t find_tag(size_t pos) const {
    size_t best = std::string::npos;
    for (const char* open : {"{{", "{%", "{#"}) best = std::min(best, src_.find(open, pos));
    return best;
  }

  void push_data(std::string text, size_t offset) {
    if (!text.empty()) tokens_.push_back(Token{Token::Kind::kData, std::move(text), Value(), offset});
  }

  // `{% raw %}` (with optional - / + and spaces) starting right after "{%" and its sign.
  bool is_raw_begin(size_t pos) const {
    size_t p = pos;
    while (p < src_.size() && is_space(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    while (p < src_.size() && is_space(src_[p])) ++p;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
    return src_.compare(p, 2, "%}") == 0;
  }

  // The text of a raw block, verbatim, up to {% endraw %}. Returns the position after it.
  size_t lex_raw(size_t start, size_t pos, bool& line_starting) {
    size_t p = src_.find("%}", pos);
    const bool strip_after_begin = src_[p - 1] == '-';
    p += 2;
    if (strip_after_begin)
      while (p < src_.size() && is_space(src_[p])) ++p;
    const size_t content_start = p;
    for (size_t q = src_.find("{%", p); q != std::string::npos; q = src_.find("{%", q + 2)) {
      size_t r = q + 2;
      const char sign = r < src_.size() && (src_[r] == '-' || src_[r] == '+') ? src_[r] : 0;
      if (sign) ++r;
      while (r < src_.size() && is_space(src_[r])) ++r;
      if (src_.compare(r, 6, "endraw") != 0) continue;
      r += 6;
      while (r < src_.size() && is_space(src_[r])) ++r;
      const char end_sign = r < src_.size() && (src_[r] == '-' || src_[r] == '+') ? src_[r] : 0;
      if (end_sign) ++r;
      if (src_.compare(r, 2, "%}") != 0) continue;
      r += 2;
      std::string text = src_.substr(content_start, q - content_start);
      if (sign == '-') {
        text = rstrip_space(text);
      } else if (sign != '+') {
        const size_t line_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if (line_pos > 0 && line_pos < text.size() &&
            std::all_of(text.begin() + line_pos, text.end(), [](char c) { return is_space(c); }))
          text.resize(line_pos);
      }
      push_data(std::move(text), content_start);
      if (end_sign == '-') {
        while (r < src_.size() && is_space(src_[r])) ++r;
      } else if (end_sign != '+' && r < src_.size() && src_[r] == '\n') {
        ++r;
      }
      line_starting = src_[r - 1] == '\n';
      return r;
    }
    error(start, "missing end of raw directive");
  }

  // Tokens of one {{ }} or {% %} tag. Returns the position after its end delimiter (and after the
  // whitespace that "-" or trim_blocks removes).
  size_t lex_tag(bool variable, size_t start, size_t pos) {
    tokens_.push_back(Token{variable ? Token::Kind::kVarBegin : Token::Kind::kBlockBegin, "", Value(), start});
    const size_t n = src_.size();
    std::vector<char> balance;
    const char* end = variable ? "}}" : "%}";
    while (true) {
      while (pos < n && is_space(src_[pos])) ++pos;
      if (pos >= n)
        error(start,
              variable ? "unexpected end of template, expected '}}'" : "unexpected end of template, expected '%}'");
      if (balance.empty()) {
        const bool minus = src_[pos] == '-' && src_.compare(pos + 1, 2, end) == 0;
        const bool plus = !variable && src_[pos] == '+' && src_.compare(pos + 1, 2, end) == 0;
        if (minus || plus || src_.compare(pos, 2, end) == 0) {
          tokens_.push_back(Token{variable ? Token::Kind::kVarEnd : Token::Kind::kBlockEnd, "", Value(), pos});
          pos += (minus || plus) ? 3 : 2;
          if (minus) {
            while (pos < n && is_space(src_[pos])) ++pos;
          } else if (!variable && !plus && pos < n && src_[pos] == '\n') {
            ++pos;  // trim_blocks
          }
          return pos;
        }
      }
      const char c = src_[pos];
      if (c == '\'' || c == '"') {
        pos = lex_string(pos);
      } else if (std::isdigit((unsigned char)c)) {
        pos = lex_number(pos);
      } else if (is_name_start(c)) {
        size_t e = pos;
        while (e < n && is_name_char(src_[e])) ++e;
        tokens_.push_back(Token{Token::Kind::kName, src_.substr(pos, e - pos), Value(), pos});
        pos = e;
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[",
                                     "]",  "(",  ")",  "{",  "}",  ">",  "<", "=", ".", ":", "|", ",", ";"};
        const char* op = nullptr;
        for (const char* o : kOps)
          if (src_.compare(pos, std::strlen(o), o) == 0) {
            op = o;
            break;
          }
        if (!op) error(pos, fmt::format("unexpected char '{}'", c));
        if (*op == '(' || *op == '[' || *op == '{') {
          balance.push_back(*op);
        } else if (*op == ')' || *op == ']' || *op == '}') {
          const char want = *op == ')' ? '(' : (*op == ']' ? '[' : '{');
          if (balance.empty()) error(pos, fmt::format("unexpected '{}'", op));
          if (balance.back() != want)
            error(pos, fmt::format("unexpected '{}', expected the closing bracket of '{}'", op, balance.back()));
          balance.pop_back();
        }
        tokens_.push_back(Token{Token::Kind::kOp, op, Value(), pos});
        pos += std::strlen(op);
      }
    }
  }

  // A string literal with Python's escapes (Jinja decodes them with "unicode-escape").
  size_t lex_string(size_t pos) {
    const char quote = src_[pos];
    std::string out;
    size_t p = pos + 1;
    const size_t n = src_.size();
    auto hex = [&](size_t at, int digits) -> char32_t {
      if (at + digits > n) error(at, "truncated escape in string literal");
      char32_t v = 0;
      for (int i = 0; i < digits; ++i) {
        const char h = src_[at + i];
        if (!std::isxdigit((unsigned char)h)) error(at, "invalid hex escape in string literal");
        v = v * 16 + char32_t(std::isdigit((unsigned char)h) ? h - '0' : std::tolower(h) - 'a' + 10);
      }
      return v;
    };
    while (true) {
      if (p >= n) error(pos, "unterminated string literal");
      const char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++p;
        continue;
      }
      if (p + 1 >= n) error(pos, "unterminated string literal");
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x': utf8_append(out, hex(p, 2)), p += 2; break;
        case 'u': utf8_append(out, hex(p, 4)), p += 4; break;
        case 'U': utf8_append(out, hex(p, 8)), p += 8; break;
        default:
          if (e >= '0' && e <= '7') {
            char32_t v = char32_t(e - '0');
            for (int i = 0; i < 2 && p < n && src_[p] >= '0' && src_[p] <= '7'; ++i, ++p)
              v = v * 8 + char32_t(src_[p] - '0');
            utf8_append(out, v);
          } else if (e == 'N') {
            error(p - 2, "\\N{...} escapes are not supported");
          } else {
            out += '\\';  // Python keeps unknown escapes as written
            out += e;
          }
      }
    }
    tokens_.push_back(Token{Token::Kind::kString, std::move(out), Value(), pos});
    return p + 1;
  }

  size_t lex_number(size_t pos) {
    const size_t n = src_.size();
    auto digits = [&](size_t p) {
      while (p < n && (std::isdigit((unsigned char)src_[p]) ||
                       (src_[p] == '_' && p + 1 < n && std::isdigit((unsigned char)src_[p + 1]))))
        ++p;
      return p;
    };
    size_t p = digits(pos);
    bool is_float = false;
    const bool after_dot = pos > 0 && src_[pos - 1] == '.';  // `x.0.1` is attribute access, not a float
    if (!after_dot && p + 1 < n && src_[p] == '.' && std::isdigit((unsigned char)src_[p + 1])) {
      p = digits(p + 1);
      is_float = true;
    }
    if (!after_dot && p < n && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < n && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < n && std::isdigit((unsigned char)src_[q])) {
        p = digits(q);
        is_float = true;
      }
    }
    std::string text = src_.substr(pos, p - pos);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    Token t{is_float ? Token::Kind::kFloat : Token::Kind::kInt, text, Value(), pos};
    try {
      t.number = is_float ? Value(std::stod(text)) : Value(int64_t(std::stoll(text)));
    } catch (const std::exception&) {
      error(pos, fmt::format("number literal '{}' out of range", text));
    }
    tokens_.push_back(std::move(t));
    return p;
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

class Parser {
 public:
  Parser(const Lexer& lexer, std::vector<Token> tokens) : lexer_(lexer), tokens_(std::move(tokens)) {}

  std::shared_ptr<const Program> run() {
    auto program = std::make_shared<Program>();
    program->body = subparse({});
    return program;
  }

 private:
  using Kind = Token::Kind;

  const Token& cur() const { return tokens_[pos_]; }
  const Token& peek(size_t k = 1) const { return tokens_[std::min(pos_ + k, tokens_.size() - 1)]; }
  void next() {
    if (pos_ + 1 < tokens_.size()) ++pos_;
  }
  bool is_op(const char* op) const { return cur().kind == Kind::kOp && cur().text == op; }
  bool is_name(const char* name) const { return cur().kind == Kind::kName && cur().text == name; }

  [[noreturn]] void error(const std::string& message) const { lexer_.error(cur().offset, message); }
  [[noreturn]] void unexpected(const std::string& expected) const {
    const Token& t = cur();
    std::string got = t.kind == Kind::kName || t.kind == Kind::kOp ? "'" + t.text + "'" : kind_name(t.kind);
    error(fmt::format("expected {}, got {}", expected, got));
  }
  void expect_op(const char* op) {
    if (!is_op(op)) unexpected(fmt::format("'{}'", op));
    next();
  }
  void expect(Kind kind) {
    if (cur().kind != kind) unexpected(kind_name(kind));
    next();
  }
  std::string expect_name() {
    if (cur().kind != Kind::kName) unexpected("a name");
    std::string name = cur().text;
    next();
    return name;
  }

  int line() const { return lexer_.position(cur().offset).first; }

  ExprPtr make(Expr::Kind kind, const Token& at) const {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    const auto [l, c] = lexer_.position(at.offset);
    e->line = l;
    e->column = c;
    return e;
  }
  NodePtr make_node(Node::Kind kind, size_t offset) const {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->line = lexer_.position(offset).first;
    return n;
  }

  // Statements until a block tag whose first name is in `end_names` (left current, after "{%").
  // Nesting deeper than this (blocks in blocks, parentheses in parentheses) is an error rather than a
  // stack overflow; real templates nest a handful of levels.
  static constexpr int kMaxDepth = 200;
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxDepth) p.error(fmt::format("template nests deeper than {} levels", kMaxDepth));
    }
    ~DepthGuard() { --p.depth_; }
  };

  Body subparse(const std::vector<std::string>& end_names) {
    DepthGuard guard(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.kind == Kind::kEof) {
        if (end_names.empty()) return body;
        std::string names;
        for (const auto& e : end_names) names += (names.empty() ? "'" : " or '") + e + "'";
        error(fmt::format("unexpected end of template; looking for the tag {}", names));
      }
      if (t.kind == Kind::kData) {
        auto node = make_node(Node::Kind::kText, t.offset);
        node->text = t.text;
        body.push_back(std::move(node));
        next();
      } else if (t.kind == Kind::kVarBegin) {
        auto node = make_node(Node::Kind::kOutput, t.offset);
        next();
        node->expr = parse_tuple(true);
        expect(Kind::kVarEnd);
        body.push_back(std::move(node));
      } else if (t.kind == Kind::kBlockBegin) {
        next();
        if (cur().kind != Kind::kName) unexpected("a tag name");
        if (std::find(end_names.begin(), end_names.end(), cur().text) != end_names.end()) return body;
        body.push_back(parse_statement());
      } else {
        unexpected("template data or a tag");
      }
    }
  }

  NodePtr parse_statement() {
    const Token& t = cur();
    const std::string tag = t.text;
    if (tag == "if") return parse_if();
    if (tag == "for") return parse_for();
    if (tag == "set") return parse_set();
    if (tag == "macro") return parse_macro();
    if (tag == "break" || tag == "continue") {
      auto node = make_node(tag == "break" ? Node::Kind::kBreak : Node::Kind::kContinue, t.offset);
      next();
      expect(Kind::kBlockEnd);
      return node;
    }
    if (tag == "generation") return parse_wrapped(Node::Kind::kScope, "endgeneration");
    if (tag == "filter") return parse_filter_block();
    if (tag == "with") return parse_with();
    if (tag == "call" || tag == "include" || tag == "import" || tag == "from" || tag == "extends" || tag == "block")
      error(fmt::format("the '{}' tag is not supported in chat templates", tag));
    if (tag == "elif" || tag == "else" || tag == "endif" || tag == "endfor" || tag == "endmacro" || tag == "endset")
      error(fmt::format("unexpected '{}' tag with no open block to close", tag));
    error(fmt::format("unknown tag '{}'", tag));
  }

  NodePtr parse_if() {
    auto node = make_node(Node::Kind::kIf, cur().offset);
    next();
    while (true) {
      node->conds.push_back(parse_tuple(false));
      expect(Kind::kBlockEnd);
      node->bodies.push_back(subparse({"elif", "else", "endif"}));
      const std::string tag = cur().text;
      next();
      if (tag == "elif") continue;
      if (tag == "else") {
        expect(Kind::kBlockEnd);
        node->else_body = subparse({"endif"});
        next();
      }
      expect(Kind::kBlockEnd);
      return node;
    }
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = is_op("(");
    if (paren) next();
    names.push_back(expect_name());
    while (is_op(",")) {
      next();
      if (cur().kind != Kind::kName) break;
      names.push_back(expect_name());
    }
    if (paren) expect_op(")");
    return names;
  }

  NodePtr parse_for() {
    auto node = make_node(Node::Kind::kFor, cur().offset);
    next();
    node->targets = parse_targets();
    if (!is_name("in")) unexpected("'in'");
    next();
    node->expr = parse_tuple(false);
    if (is_name("if")) {
      next();
      node->cond = parse_expression(true);
    }
    if (is_name("recursive")) error("recursive for loops are not supported");
    expect(Kind::kBlockEnd);
    node->bodies.push_back(subparse({"endfor", "else"}));
    if (cur().text == "else") {
      next();
      expect(Kind::kBlockEnd);
      node->else_body = subparse({"endfor"});
    }
    next();
    expect(Kind::kBlockEnd);
    return node;
  }

  NodePtr parse_set() {
    const size_t offset = cur().offset;
    next();
    std::vector<std::string> targets;
    std::string attr;
    if (cur().kind == Kind::kName && peek().kind == Kind::kOp && peek().text == ".") {
      targets.push_back(expect_name());
      next();
      attr = expect_name();
    } else {
      targets = parse_targets();
    }
    if (is_op("=")) {
      next();
      auto node = make_node(Node::Kind::kSet, offset);
      node->targets = std::move(targets);
      node->attr = std::move(attr);
      node->expr = parse_tuple(true);
      expect(Kind::kBlockEnd);
      return node;
    }
    if (!attr.empty() || targets.size() != 1) unexpected("'='");
    auto node = make_node(Node::Kind::kSetBlock, offset);
    node->targets = std::move(targets);
    if (is_op("|")) node->filter = parse_filters(nullptr);
    expect(Kind::kBlockEnd);
    node->bodies.push_back(subparse({"endset"}));
    next();
    expect(Kind::kBlockEnd);
    return node;
  }

  NodePtr parse_macro() {
    auto node = make_node(Node::Kind::kMacro, cur().offset);
    next();
    node->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!node->params.empty()) expect_op(",");
      if (is_op(")")) break;
      node->params.push_back(expect_name());
      if (is_op("=")) {
        next();
        node->defaults.push_back(parse_expression(true));
      } else {
        if (!node->defaults.empty() && node->defaults.back()) error("non-default argument follows default argument");
        node->defaults.push_back(nullptr);
      }
    }
    next();
    expect(Kind::kBlockEnd);
    node->bodies.push_back(subparse({"endmacro"}));
    next();
    if (cur().kind == Kind::kName) next();  // {% endmacro name %}
    expect(Kind::kBlockEnd);
    return node;
  }

  NodePtr parse_wrapped(Node::Kind kind, const char* end_tag) {
    auto node = make_node(kind, cur().offset);
    next();
    expect(Kind::kBlockEnd);
    node->bodies.push_back(subparse({end_tag}));
    next();
    expect(Kind::kBlockEnd);
    return node;
  }

  NodePtr parse_filter_block() {
    auto node = make_node(Node::Kind::kFilterBlock, cur().offset);
    next();
    node->filter = parse_filter_chain(nullptr, /*leading_pipe=*/false);
    expect(Kind::kBlockEnd);
    node->bodies.push_back(subparse({"endfilter"}));
    next();
    expect(Kind::kBlockEnd);
    return node;
  }

  NodePtr parse_with() {
    auto node = make_node(Node::Kind::kWith, cur().offset);
    next();
    while (cur().kind != Kind::kBlockEnd) {
      if (!node->targets.empty()) expect_op(",");
      node->targets.push_back(expect_name());
      expect_op("=");
      node->values.push_back(parse_expression(true));
    }
    next();
    node->bodies.push_back(subparse({"endwith"}));
    next();
    expect(Kind::kBlockEnd);
    return node;
  }

  // Expressions --------------------------------------------------------------------------------------

  ExprPtr parse_tuple(bool with_condexpr, bool explicit_parens = false) {
    const Token& start = cur();
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!is_op(",")) break;
        next();
        is_tuple = true;
      }
      if (cur().kind == Kind::kVarEnd || cur().kind == Kind::kBlockEnd || is_op(")") || is_name("in") ||
          (!items.empty() && is_name("if") && !with_condexpr))
        break;
      items.push_back(parse_expression(with_condexpr));
    }
    if (items.empty()) {
      if (!explicit_parens) unexpected("an expression");
      return tuple(start, std::move(items));  // ()
    }
    if (!is_tuple) return std::move(items[0]);
    return tuple(start, std::move(items));
  }

  ExprPtr tuple(const Token& at, std::vector<ExprPtr> items) {
    auto e = make(Expr::Kind::kTuple, at);
    e->items = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    const Token& at = cur();
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      next();
      auto e = make(Expr::Kind::kCondExpr, at);
      ExprPtr cond = parse_or();
      ExprPtr other;
      if (is_name("else")) {
        next();
        other = parse_condexpr();
      }
      e->items.push_back(std::move(expr));
      e->items.push_back(std::move(cond));
      e->items.push_back(std::move(other));
      expr = std::move(e);
    }
    return expr;
  }

  ExprPtr binary(Expr::Kind kind, const Token& at, ExprPtr a, ExprPtr b, std::string op = "") {
    auto e = make(kind, at);
    e->name = std::move(op);
    e->items.push_back(std::move(a));
    e->items.push_back(std::move(b));
    return e;
  }

  ExprPtr parse_or() {
    const Token& at = cur();
    ExprPtr left = parse_and();
    while (is_name("or")) {
      next();
      left = binary(Expr::Kind::kOr, at, std::move(left), parse_and());
    }
    return left;
  }

  ExprPtr parse_and() {
    const Token& at = cur();
    ExprPtr left = parse_not();
    while (is_name("and")) {
      next();
      left = binary(Expr::Kind::kAnd, at, std::move(left), parse_not());
    }
    return left;
  }

  ExprPtr parse_not() {
    DepthGuard guard(*this);
    if (is_name("not")) {
      auto e = make(Expr::Kind::kNot, cur());
      next();
      e->items.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const Token& at = cur();
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().kind == Kind::kOp && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                      cur().text == ">" || cur().text == "<=" || cur().text == ">=")) {
        op = cur().text;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && peek().kind == Kind::kName && peek().text == "in") {
        op = "not in";
        next();
        next();
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Kind::kCompare, at);
        cmp->items.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->items.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprPtr parse_math1() {
    const Token& at = cur();
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().text;
      next();
      left = binary(Expr::Kind::kBinary, at, std::move(left), parse_concat(), op);
    }
    return left;
  }

  ExprPtr parse_concat() {
    const Token& at = cur();
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto e = make(Expr::Kind::kConcat, at);
    e->items.push_back(std::move(first));
    while (is_op("~")) {
      next();
      e->items.push_back(parse_math2());
    }
    return e;
  }

  ExprPtr parse_math2() {
    const Token& at = cur();
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().text;
      next();
      left = binary(Expr::Kind::kBinary, at, std::move(left), parse_pow(), op);
    }
    return left;
  }

  ExprPtr parse_pow() {
    const Token& at = cur();
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      next();
      left = binary(Expr::Kind::kBinary, at, std::move(left), parse_unary(true), "**");
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      node = make(Expr::Kind::kUnary, cur());
      node->name = cur().text;
      next();
      node->items.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    if (t.kind == Kind::kName) {
      auto e = make(Expr::Kind::kLiteral, t);
      if (t.text == "true" || t.text == "True") {
        e->literal = Value(true);
      } else if (t.text == "false" || t.text == "False") {
        e->literal = Value(false);
      } else if (t.text == "none" || t.text == "None") {
        e->literal = Value(None{});
      } else {
        e->kind = Expr::Kind::kName;
        e->name = t.text;
      }
      next();
      return e;
    }
    if (t.kind == Kind::kString) {
      auto e = make(Expr::Kind::kLiteral, t);
      std::string s;
      while (cur().kind == Kind::kString) {  // adjacent literals concatenate, as in Python
        s += cur().text;
        next();
      }
      e->literal = Value(std::move(s));
      return e;
    }
    if (t.kind == Kind::kInt || t.kind == Kind::kFloat) {
      auto e = make(Expr::Kind::kLiteral, t);
      e->literal = t.number;
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      ExprPtr e = parse_tuple(true, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      auto e = make(Expr::Kind::kList, t);
      next();
      while (!is_op("]")) {
        if (!e->items.empty()) expect_op(",");
        if (is_op("]")) break;
        e->items.push_back(parse_expression(true));
      }
      next();
      return e;
    }
    if (is_op("{")) {
      auto e = make(Expr::Kind::kDict, t);
      next();
      while (!is_op("}")) {
        if (!e->items.empty()) expect_op(",");
        if (is_op("}")) break;
        e->items.push_back(parse_expression(true));
        expect_op(":");
        e->items.push_back(parse_expression(true));
      }
      next();
      return e;
    }
    unexpected("an expression");
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filters(std::move(node));
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Token& at = cur();
    if (is_op(".")) {
      next();
      if (cur().kind == Kind::kName) {
        auto e = make(Expr::Kind::kGetAttr, at);
        e->name = cur().text;
        e->items.push_back(std::move(node));
        next();
        return e;
      }
      if (cur().kind == Kind::kInt) {
        auto e = make(Expr::Kind::kGetItem, at);
        e->items.push_back(std::move(node));
        auto key = make(Expr::Kind::kLiteral, cur());
        key->literal = cur().number;
        e->items.push_back(std::move(key));
        next();
        return e;
      }
      unexpected("an attribute name");
    }
    next();  // [
    ExprPtr parts[3];
    bool is_slice = false;
    int part = 0;
    while (!is_op("]")) {
      if (is_op(":")) {
        is_slice = true;
        if (++part > 2) error("too many ':' in slice");
        next();
        continue;
      }
      if (parts[part]) unexpected("']'");
      parts[part] = parse_expression(true);
      if (!is_slice && is_op(",")) error("tuple subscripts are not supported");
    }
    next();
    if (!is_slice) {
      if (!parts[0]) error("empty subscript");
      auto e = make(Expr::Kind::kGetItem, at);
      e->items.push_back(std::move(node));
      e->items.push_back(std::move(parts[0]));
      return e;
    }
    auto e = make(Expr::Kind::kSlice, at);
    e->items.push_back(std::move(node));
    for (auto& p : parts) e->items.push_back(std::move(p));
    return e;
  }

  void parse_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) error("*args and **kwargs in calls are not supported");
      if (cur().kind == Kind::kName && peek().kind == Kind::kOp && peek().text == "=") {
        std::string key = cur().text;
        next();
        next();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!e.kwargs.empty()) error("positional argument follows keyword argument");
        e.items.push_back(parse_expression(true));
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = make(Expr::Kind::kCall, cur());
    e->items.push_back(std::move(node));
    parse_args(*e);
    return e;
  }

  // `| name(args) | name ...` applied to `node` (null for a filter block or a set block).
  ExprPtr parse_filters(ExprPtr node) { return parse_filter_chain(std::move(node), true); }

  ExprPtr parse_filter_chain(ExprPtr node, bool leading_pipe) {
    bool first = true;
    while (first || is_op("|")) {
      if (leading_pipe || !first) expect_op("|");
      first = false;
      auto e = make(Expr::Kind::kFilter, cur());
      e->name = expect_name();
      while (is_op(".")) {
        next();
        e->name += "." + expect_name();
      }
      e->items.push_back(std::move(node));
      if (is_op("(")) parse_args(*e);
      node = std::move(e);
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    const Token& at = cur();
    next();  // is
    bool negated = false;
    if (is_name("not")) {
      negated = true;
      next();
    }
    auto e = make(Expr::Kind::kTest, at);
    e->name = expect_name();
    while (is_op(".")) {
      next();
      e->name += "." + expect_name();
    }
    e->items.push_back(std::move(node));
    if (is_op("(")) {
      parse_args(*e);
    } else if ((cur().kind == Kind::kName || cur().kind == Kind::kString || cur().kind == Kind::kInt ||
                cur().kind == Kind::kFloat || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) error("you cannot chain multiple tests with 'is'");
      e->items.push_back(parse_postfix(parse_primary()));
    }
    if (!negated) return e;
    auto n = make(Expr::Kind::kNot, at);
    n->items.push_back(std::move(e));
    return n;
  }

  const Lexer& lexer_;
  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

std::shared_ptr<const Program> parse(const std::string& source) {
  Lexer lexer(source);
  std::vector<Token> tokens = lexer.run();
  return Parser(lexer, std::move(tokens)).run();
}

}  // namespace tpmoe::text::jinja
