// Shared test helpers: fixture paths, scratch directories, running the tpmoe command, the one error
// metric every numeric comparison uses.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace tpmoe::test {

// ../shared/fixtures beside the checkout (TPMOE_FIXTURES overrides).
std::filesystem::path fixtures_dir();
// A fresh empty directory under the system temp dir, removed by the caller's TearDown if wanted.
std::filesystem::path make_temp_dir(const std::string& tag);

struct CommandResult {
  int exit_code;       // the command's status; kCliHung when it ran past the timeout; 128 + N when killed by signal N
  std::string output;  // stdout and stderr together
};
// Exit status run_cli reports for a command that ran past its timeout (coreutils `timeout`).
constexpr int kCliHung = 124;
// Runs the built `tpmoe` binary with `args` (a shell-quoted string) and captures its output. The
// command runs under `timeout 120`, so a hang fails the test instead of hanging CI.
CommandResult run_cli(const std::string& args);
// The same, started through a launcher (`prefix`, e.g. "mpirun -np 2").
CommandResult run_cli_with_prefix(const std::string& prefix, const std::string& args);

// The fixture's reference run (fixtures/m3-tiny/reference.safetensors, SPEC §5), batch-major.
struct FixtureReference {
  std::vector<std::vector<int32_t>> prompts, generated;  // [B][P], [B][G]
  std::vector<float> prefill_logits;                     // [B, P, V]
  std::vector<float> step_logits;                        // [G, B, V]
  int64_t B = 0, P = 0, G = 0, V = 0;
};
FixtureReference load_fixture_reference();

// The rows of a per-sequence or per-step result (GenerateResult::prefill_logits, step_logits) end to end.
std::vector<float> concat(const std::vector<std::vector<float>>& rows);

// Tolerances in relative L2, stated once per dtype; an override in a test says why.
// fp32 vs fp32: only summation order differs.
inline constexpr double kTolF32 = 1e-5;
// bf16 storage with fp32 accumulation vs the fp32 oracle: one bf16 rounding (2^-9 relative) per
// stored intermediate, a few in a row.
inline constexpr double kTolBf16 = 1e-2;

// ||a - b|| / ||b||: the one error metric for every numeric comparison (SPEC tolerances are stated in it).
double relative_l2(std::span<const float> a, std::span<const float> b);

}  // namespace tpmoe::test
