// Argument checks and the error-reporting main of the GPU benchmarks (bench_cuda_*), which compile
// under nvcc, where core/error.h's formatting does not: plain std::string messages. Host code.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace tpmoe::bench {

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// A whole non-negative decimal number, or an error naming the option.
inline long long parse_count(const std::string& option, const char* text) {
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  require(end != text && *end == '\0' && v >= 0, option + ": '" + text + "' is not a non-negative whole number");
  return v;
}

// A comma-separated list of whole numbers in [1, most], or an error naming the option.
inline std::vector<int> parse_list(const std::string& option, const char* text, int most) {
  std::vector<int> out;
  std::string item;
  for (const char* p = text;; ++p) {
    if (*p != ',' && *p != '\0') {
      item += *p;
      continue;
    }
    const long long v = parse_count(option, item.c_str());
    require(v > 0 && v <= most, option + ": '" + text + "' is not a list of numbers from 1 to " + std::to_string(most));
    out.push_back(int(v));
    item.clear();
    if (*p == '\0') break;
  }
  return out;
}

// run(argc, argv)'s exit code, or 1 with the error on stderr after the benchmark's name.
template <class Run>
int guarded_main(const char* name, Run run, int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace tpmoe::bench
