// Tokenizer encode throughput (CPU, one thread): the m3 preset's byte-level BPE tokenizer over English
// text - Debian's license files where present, else generated prose - in MB of UTF-8 a second of the
// thread's CPU time (shared machines: wall time would measure the neighbours). Prints the first pass
// (cold word cache) and the median of the warm passes next to the target, 20 MB/s; it is a benchmark,
// not a test, so nothing here fails on a slow machine.
//
//   bench_tokenize [--reps N] [--text FILE]
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "text/tokenizer.h"
#include "text/utf8.h"

namespace fs = std::filesystem;
using tpmoe::text::Tokenizer;

namespace {

constexpr double kTargetMbPerS = 20.0;

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// The license files' valid UTF-8 (at least 100 kB of it), else 300 kB of generated prose.
std::string english_text() {
  std::string text;
  const fs::path licenses = "/usr/share/common-licenses";
  if (fs::is_directory(licenses))
    for (const auto& e : fs::directory_iterator(licenses)) {
      if (!e.is_regular_file()) continue;
      const std::string s = read_file(e.path());
      if (tpmoe::text::find_invalid_utf8(s) == std::string_view::npos) text += s;
    }
  if (text.size() >= 100000) return text;
  text.clear();
  std::mt19937 rng(3);
  const char* words[] = {"the",     "model", "reads", "text",   "and",  "writes",  "tokens", "quickly", "while",
                         "experts", "share", "work",  "across", "many", "devices", "in",     "parallel"};
  while (text.size() < 300000) text += std::string(words[rng() % std::size(words)]) + (rng() % 9 ? " " : ".\n");
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 9;
  std::string text_file;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--text") && i + 1 < argc) {
      text_file = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_tokenize [--reps N] [--text FILE]\n");
      return 2;
    }
  }
  std::string text;
  if (!text_file.empty()) {
    if (!fs::is_regular_file(text_file)) {
      std::fprintf(stderr, "bench_tokenize: %s: no such file (or not a regular file)\n", text_file.c_str());
      return 1;
    }
    text = read_file(text_file);
    if (tpmoe::text::find_invalid_utf8(text) != std::string_view::npos) {
      std::fprintf(stderr, "bench_tokenize: %s is not valid UTF-8\n", text_file.c_str());
      return 1;
    }
  } else {
    text = english_text();
  }
  const Tokenizer t = Tokenizer::from_json(tpmoe::text::make_preset_tokenizer_json(200064), "m3 preset");
  double t0 = thread_cpu_seconds();
  size_t tokens = t.encode(text).size();
  const double cold = thread_cpu_seconds() - t0;
  std::vector<double> warm;
  for (int r = 0; r < reps; ++r) {
    t0 = thread_cpu_seconds();
    tokens = t.encode(text).size();
    warm.push_back(thread_cpu_seconds() - t0);
  }
  std::sort(warm.begin(), warm.end());
  const double mb = double(text.size()) / 1e6, median = warm[warm.size() / 2];
  std::printf("encode, m3 preset tokenizer, one thread, CPU time: %.2f MB -> %zu tokens (%.2f bytes a token)\n", mb,
              tokens, double(text.size()) / double(std::max<size_t>(tokens, 1)));
  std::printf("first pass %.1f MB/s; warm (median of %d) %.1f MB/s, best %.1f MB/s; target %.0f MB/s\n", mb / cold,
              reps, mb / median, mb / warm.front(), kTargetMbPerS);
  return 0;
}
