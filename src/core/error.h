// One exception type for every error tpmoe reports, and the check macros that throw it.
//
// The library throws; only main() turns an Error into a message and an exit code. Nothing deep in
// the library calls exit(): that would skip communicator teardown and leave peer ranks hanging.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace tpmoe {

class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file, int line)
      : std::runtime_error(message), file_(file), line_(line) {}
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  const char* file_;
  int line_;
};

[[noreturn]] inline void throw_error(const char* file, int line, const std::string& message) {
  throw Error(message, file, line);
}

}  // namespace tpmoe

// TPMOE_CHECK(cond, fmt, args...): throws tpmoe::Error with a fmt-formatted message a user can act on
// (name the file, tensor or field).
#define TPMOE_CHECK(cond, ...)                                                       \
  do {                                                                               \
    if (!(cond)) ::tpmoe::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define TPMOE_FAIL(...) ::tpmoe::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))
