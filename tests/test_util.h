// Shared test helpers: fixture paths, scratch directories, running the tpmoe command, the one error
// metric every numeric comparison uses.
#pragma once

#include <filesystem>
#include <span>
#include <string>

namespace tpmoe::test {

// ../shared/fixtures beside the checkout (TPMOE_FIXTURES overrides).
std::filesystem::path fixtures_dir();
// A fresh empty directory under the system temp dir, removed by the caller's TearDown if wanted.
std::filesystem::path make_temp_dir(const std::string& tag);

struct CommandResult {
  int exit_code;
  std::string output;  // stdout and stderr together
};
// Runs the built `tpmoe` binary with `args` (a shell-quoted string) and captures its output.
CommandResult run_cli(const std::string& args);

// Tolerances in relative L2, stated once per dtype; an override in a test says why.
// fp32 vs fp32: only summation order differs.
inline constexpr double kTolF32 = 1e-5;
// bf16 storage with fp32 accumulation vs the fp32 oracle: one bf16 rounding (2^-9 relative) per
// stored intermediate, a few in a row.
inline constexpr double kTolBf16 = 1e-2;

// ||a - b|| / ||b||: the one error metric for every numeric comparison (SPEC tolerances are stated in it).
double relative_l2(std::span<const float> a, std::span<const float> b);

}  // namespace tpmoe::test
