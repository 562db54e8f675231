// How deeply a JSON text nests, read from its characters alone. Code that walks a parsed JSON value
// recursively (nlohmann::json's copies, dumps and comparisons; the schema readers here) needs stack
// in proportion to the value's nesting, so a deep enough value from outside - a request body, the
// arguments a client or the model writes as JSON text - would overflow it. Such text is measured
// before it is parsed and refused (or kept as plain text) past a limit.
#pragma once

#include <string_view>

namespace tpmoe::serve {

// The deepest nesting of arrays and objects in `text`, in one pass: brackets inside string literals
// do not count (escapes honoured), and the text need not be valid JSON (unbalanced closers count as
// nothing). Stops counting once past `limit` and returns limit + 1.
int json_nesting(std::string_view text, int limit);

}  // namespace tpmoe::serve
