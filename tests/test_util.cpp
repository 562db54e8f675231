#include "test_util.h"

#include <sys/wait.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>

#include "io/safetensors.h"

namespace tpmoe::test {

std::filesystem::path fixtures_dir() {
  if (const char* env = std::getenv("TPMOE_FIXTURES")) return env;
  return TPMOE_FIXTURES_DIR;
}

std::filesystem::path make_temp_dir(const std::string& tag) {
  std::random_device rd;
  auto dir =
      std::filesystem::temp_directory_path() / ("tpmoe-" + tag + "-" + std::to_string(rd()) + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir;
}

CommandResult run_cli(const std::string& args) { return run_cli_with_prefix("", args); }

CommandResult run_cli_with_prefix(const std::string& prefix, const std::string& args) {
#ifdef TPMOE_CLI_PATH
  std::string cmd = std::string("timeout 120 ") + prefix + " '" + TPMOE_CLI_PATH + "' " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) throw std::runtime_error("popen failed: " + cmd);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  int status = pclose(pipe);
  if (WIFSIGNALED(status)) return {128 + WTERMSIG(status), out};  // timeout re-raises the child's signal
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128, out};
#else
  throw std::runtime_error("run_cli: test built without TPMOE_CLI_PATH");
#endif
}

FixtureReference load_fixture_reference() {
  const auto file = io::SafetensorsSet::open_file(fixtures_dir() / "m3-tiny" / "reference.safetensors");
  FixtureReference r;
  const auto* ids = file.find("input_ids");
  const auto* gen = file.find("generated_ids");
  const auto* prefill = file.find("prefill_logits");
  const auto* steps = file.find("step_logits");
  if (!ids || !gen || !prefill || !steps) throw std::runtime_error("reference.safetensors: a tensor is missing");
  r.B = ids->shape[0], r.P = ids->shape[1], r.G = gen->shape[1], r.V = prefill->shape[2];
  const auto iv = io::to_i64(*ids), gv = io::to_i64(*gen);
  for (int64_t b = 0; b < r.B; ++b) {
    r.prompts.emplace_back(iv.begin() + b * r.P, iv.begin() + (b + 1) * r.P);
    r.generated.emplace_back(gv.begin() + b * r.G, gv.begin() + (b + 1) * r.G);
  }
  r.prefill_logits = io::to_f32(*prefill);
  r.step_logits = io::to_f32(*steps);
  return r;
}

std::vector<float> concat(const std::vector<std::vector<float>>& rows) {
  std::vector<float> out;
  for (const auto& r : rows) out.insert(out.end(), r.begin(), r.end());
  return out;
}

double relative_l2(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;  // NaN never passes
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace tpmoe::test
