// The syntax tree of a parsed chat template, and the entry points of the Jinja subset that chat
// templates use: parse() (lexer + parser, jinja_parser.cpp) and render() (interpreter, jinja_eval.cpp).
//
// The lexer follows Jinja2's rules as Hugging Face configures them (trim_blocks, lstrip_blocks, no
// trailing newline kept), so whitespace in the output matches Jinja2 byte for byte.
#pragma once

#include "text/jinja_value.h"

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tpmoe::text::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // items
    kTuple,     // items
    kDict,      // items: key, value, key, value, ...
    kGetAttr,   // items[0] . name
    kGetItem,   // items[0] [ items[1] ]
    kSlice,     // items[0] [ items[1] : items[2] : items[3] ] (null = omitted)
    kCall,      // items[0] ( items[1..], kwargs )
    kFilter,    // items[0] | name ( items[1..], kwargs ); items[0] null in a filter block
    kTest,      // items[0] is name ( items[1..], kwargs )
    kUnary,     // name ("-", "+") items[0]
    kBinary,    // items[0] name ("+", "-", "*", "/", "//", "%", "**") items[1]
    kConcat,    // items joined with ~
    kCompare,   // items[0] ops[0] items[1] ops[1] items[2] ... (chained, as in Python)
    kAnd,       // items[0] and items[1]
    kOr,        // items[0] or items[1]
    kNot,       // not items[0]
    kCondExpr,  // items[0] if items[1] else items[2] (items[2] null: undefined)
  };
  Kind kind;
  int line = 0, column = 0;
  Value literal;
  std::string name;
  std::vector<ExprPtr> items;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind {
    kText,         // text
    kOutput,       // {{ expr }}
    kIf,           // if conds[i]: bodies[i] ... else: else_body
    kFor,          // for targets in expr [if cond]: bodies[0] else: else_body
    kSet,          // set targets = expr, or set targets[0].attr = expr
    kSetBlock,     // set targets[0] [| filter] %} bodies[0] {% endset
    kMacro,        // macro name(params = defaults): bodies[0]
    kBreak,        //
    kContinue,     //
    kFilterBlock,  // filter filter %} bodies[0] {% endfilter
    kWith,         // with targets[i] = values[i]: bodies[0]
    kScope,        // a body run as is ({% generation %}, Hugging Face's assistant-mask marker)
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;    // output, for iterable, set value
  ExprPtr cond;    // for-loop filter
  ExprPtr filter;  // set-block / filter-block filter (a kFilter with a null operand)
  std::vector<ExprPtr> conds;
  std::vector<Body> bodies;
  Body else_body;
  std::vector<std::string> targets;
  std::string attr;  // set ns.attr
  std::string name;  // macro
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // one per param; null = no default
  std::vector<ExprPtr> values;    // with
};

struct Program {
  Body body;
};

// Parses a template; a syntax error throws tpmoe::Error naming the line and column.
std::shared_ptr<const Program> parse(const std::string& source);

struct RenderOptions {
  // The time strftime_now() formats (local time); unset: the current time.
  std::optional<std::time_t> now;
};

// Renders with `context` as the template's variables. Errors throw tpmoe::Error: a template error
// names the line; raise_exception(msg) carries the template's message.
std::string render(const Program& program, const DictData& context, const RenderOptions& options);

}  // namespace tpmoe::text::jinja
