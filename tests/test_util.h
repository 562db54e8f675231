// Shared test helpers: fixture paths, scratch directories, running the tpmoe command, the one error
// metric every numeric comparison uses.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "tpmoe/tpmoe.h"

namespace tpmoe::test {

// ../shared/fixtures beside the checkout (TPMOE_FIXTURES overrides).
std::filesystem::path fixtures_dir();
// A fresh empty directory under the system temp dir, removed by the caller's TearDown if wanted.
std::filesystem::path make_temp_dir(const std::string& tag);
// A file's bytes; throws std::runtime_error naming it when it cannot be read.
std::string read_text_file(const std::filesystem::path& path);
// tests/chat_template/templates/<name>: the model chat templates the tests render.
std::filesystem::path chat_template_path(const std::string& name);

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

// A fixture's reference run (its reference.safetensors, SPEC §5), batch-major.
struct FixtureReference {
  std::vector<std::vector<int32_t>> prompts, generated;  // [B][P], [B][G]
  std::vector<float> prefill_logits;                     // [B, P, V]
  std::vector<float> step_logits;                        // [G, B, V]
  int64_t B = 0, P = 0, G = 0, V = 0;
};
FixtureReference load_fixture_reference(const std::filesystem::path& path);
// m3-tiny's: fixtures/m3-tiny/reference.safetensors.
FixtureReference load_fixture_reference();
// The reference run as a request: its prompts, its generated tokens forced, every prefill logit kept.
GenerateRequest teacher_forced_request(const FixtureReference& ref);

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

// The reference implementation's own bf16 run on the fixture (reference_bf16.safetensors, SPEC §5):
// the same keys and layout as reference.safetensors ([B, P, V] prefill, [G, B, V] steps).
struct FixtureYardstick {
  std::vector<float> prefill_logits, step_logits;
};
FixtureYardstick load_fixture_yardstick();

// How a bf16 path is judged against the fp32 reference: row by row (a row is one prompt position or
// one decode step, V logits), next to what the reference implementation itself shows in bf16 on the
// same row. That run rounds everything (residual stream included) to bf16, so an engine that keeps
// fp32 where it does should land at or under it; the slack absorbs that the two round different
// intermediates, so their errors on one row are two draws of the same size, not the same number.
struct YardstickRule {
  // A row passes when error <= per_row_slack * yardstick error + per_row_floor. Factor 2: two
  // independent roundings of the same magnitude land within 2x of each other on almost every row
  // (both are sums of many rounding terms). Floor 5e-3, a little over bf16's unit roundoff
  // 2^-8 = 3.9e-3: a row where the yardstick happens to be nearly exact still leaves a bf16 path
  // the error of rounding its final hidden state once.
  double per_row_slack = 2.0;
  double per_row_floor = 5e-3;
  // Over every non-exempt row together: error <= overall_slack * yardstick error over the same
  // rows. Tighter than per row, since per-row scatter averages out over tens of rows.
  double overall_slack = 1.5;
  // An exempt row (the oracle itself made a discrete choice there by less than bf16 resolves) must
  // still be finite and under this relative L2: a flipped expert or key block moves that row's
  // logits by about 0.2 on the fixture (both the GPU and reference_bf16 were seen there), while a
  // broken row (wrong expert weights, garbage partial sums) is at ~1 or beyond.
  double exempt_limit = 0.5;
};

struct LogitRow {
  std::string label;   // "prefill 16", "step 9 (pos 48)"
  std::string margin;  // the oracle's smallest decision margin on the row, as text
  bool exempt = false;
};

struct YardstickResult {
  std::vector<double> error, yardstick_error;  // per row, relative L2 against the reference
  double overall = 0, yardstick_overall = 0;   // over the non-exempt rows together
  std::vector<std::string> failures;           // one line per broken rule; empty when all hold
  std::string table;                           // one line per row, for the test log
  bool ok() const { return failures.empty(); }
};

// Judges `got` (rows of `row_size` values, the same layout as `reference` and `yardstick`) by
// `rule`, one entry of `rows` per row.
YardstickResult judge_against_yardstick(std::span<const float> got, std::span<const float> reference,
                                        std::span<const float> yardstick, size_t row_size,
                                        const std::vector<LogitRow>& rows, const YardstickRule& rule = {});

}  // namespace tpmoe::test
