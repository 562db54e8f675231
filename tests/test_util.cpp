#include "test_util.h"

#include <sys/wait.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

#include "io/safetensors.h"

namespace tpmoe::test {

std::filesystem::path fixtures_dir() {
  if (const char* env = std::getenv("TPMOE_FIXTURES")) return env;
  return TPMOE_FIXTURES_DIR;
}

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::filesystem::path chat_template_path(const std::string& name) {
  return std::filesystem::path(__FILE__).parent_path() / "chat_template" / "templates" / name;
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
  return load_fixture_reference(fixtures_dir() / "m3-tiny" / "reference.safetensors");
}

FixtureReference load_fixture_reference(const std::filesystem::path& path) {
  const auto file = io::SafetensorsSet::open_file(path);
  FixtureReference r;
  const auto* ids = file.find("input_ids");
  const auto* gen = file.find("generated_ids");
  const auto* prefill = file.find("prefill_logits");
  const auto* steps = file.find("step_logits");
  if (!ids || !gen || !prefill || !steps) throw std::runtime_error(path.string() + ": a tensor is missing");
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

GenerateRequest teacher_forced_request(const FixtureReference& ref) {
  GenerateRequest req;
  req.prompts = ref.prompts;
  req.forced_tokens = ref.generated;
  req.max_new_tokens = int(ref.G);
  req.return_prefill_logits = true;
  return req;
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

FixtureYardstick load_fixture_yardstick() {
  const auto file = io::SafetensorsSet::open_file(fixtures_dir() / "m3-tiny" / "reference_bf16.safetensors");
  const auto* prefill = file.find("prefill_logits");
  const auto* steps = file.find("step_logits");
  if (!prefill || !steps) throw std::runtime_error("reference_bf16.safetensors: a tensor is missing");
  return {io::to_f32(*prefill), io::to_f32(*steps)};
}

YardstickResult judge_against_yardstick(std::span<const float> got, std::span<const float> reference,
                                        std::span<const float> yardstick, size_t row_size,
                                        const std::vector<LogitRow>& rows, const YardstickRule& rule) {
  YardstickResult r;
  if (got.size() != reference.size() || yardstick.size() != reference.size() ||
      rows.size() * row_size != reference.size()) {
    r.failures.push_back(fmt::format("shapes differ: got {} values, reference {}, yardstick {}, {} rows of {}",
                                     got.size(), reference.size(), yardstick.size(), rows.size(), row_size));
    return r;
  }
  std::vector<float> kept_got, kept_ref, kept_yard;  // the non-exempt rows, for the overall figures
  r.table = fmt::format("  {:<18} {:<46} {:>9} {:>9} {:>9}  {}\n", "row", "smallest oracle margin", "error", "ref_bf16",
                        "bound", "exempt");
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto row = [&](std::span<const float> v) { return v.subspan(i * row_size, row_size); };
    const double err = relative_l2(row(got), row(reference)), yard = relative_l2(row(yardstick), row(reference));
    r.error.push_back(err);
    r.yardstick_error.push_back(yard);
    const double bound = rows[i].exempt ? rule.exempt_limit : rule.per_row_slack * yard + rule.per_row_floor;
    // relative_l2 is infinite for any NaN or infinity, so `err <= bound` also demands finite logits.
    const bool pass = err <= bound;
    r.table += fmt::format("  {:<18} {:<46} {:>9.3g} {:>9.3g} {:>9.3g}  {}{}\n", rows[i].label, rows[i].margin, err,
                           yard, bound, rows[i].exempt ? "yes" : "no", pass ? "" : "  <-- FAILS");
    if (!pass)
      r.failures.push_back(fmt::format(
          "{}: relative L2 {:.4g} over its bound {:.4g} ({})", rows[i].label, err, bound,
          rows[i].exempt ? "exempt row: finite and under the exempt limit" : "slack x reference_bf16 + floor"));
    if (rows[i].exempt) continue;
    kept_got.insert(kept_got.end(), row(got).begin(), row(got).end());
    kept_ref.insert(kept_ref.end(), row(reference).begin(), row(reference).end());
    kept_yard.insert(kept_yard.end(), row(yardstick).begin(), row(yardstick).end());
  }
  r.overall = relative_l2(kept_got, kept_ref);
  r.yardstick_overall = relative_l2(kept_yard, kept_ref);
  const double overall_bound = rule.overall_slack * r.yardstick_overall;
  r.table += fmt::format("  non-exempt rows together: error {:.3g}, ref_bf16 {:.3g}, bound {:.3g}\n", r.overall,
                         r.yardstick_overall, overall_bound);
  if (!(r.overall <= overall_bound))
    r.failures.push_back(fmt::format("non-exempt rows together: relative L2 {:.4g} over {:.4g} = {} x reference_bf16",
                                     r.overall, overall_bound, rule.overall_slack));
  return r;
}

}  // namespace tpmoe::test
