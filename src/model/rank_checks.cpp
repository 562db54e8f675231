#include "model/rank_checks.h"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>

#include <unistd.h>

#include "core/error.h"

namespace tpmoe {

namespace {

constexpr uint32_t kFingerprintMagic = 0x314d5054;  // "TPM1": a peer running another tpmoe build differs

template <size_t N>
void copy_text(char (&dst)[N], const std::string& s) {
  std::memset(dst, 0, N);
  std::memcpy(dst, s.data(), std::min(N - 1, s.size()));
}

std::string text(const char* s, size_t n) { return std::string(s, strnlen(s, n)); }

std::string gpu_hint() {
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  return v ? fmt::format(" (CUDA_VISIBLE_DEVICES={})", v) : "";
}

}  // namespace

uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

RankFingerprint make_fingerprint(const ModelConfig& config, const FusionPlan& plan, int rank, int tp, int world,
                                 int local_rank, int visible_gpus) {
  RankFingerprint f;
  f.magic = kFingerprintMagic;
  f.rank = rank;
  f.tp = tp;
  f.world = world;
  f.local_rank = local_rank;
  f.visible_gpus = visible_gpus;
  f.config_hash = fnv1a64(config.to_json().dump());
  f.plan_hash = fnv1a64(plan.to_string());
  char host[sizeof f.host] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  copy_text(f.host, host);
  copy_text(f.model, fmt::format("hidden {}, {} layers, {} experts, vocab {}", config.hidden_size, config.num_layers,
                                 config.num_experts, config.vocab_size));
  return f;
}

void check_fingerprints(const std::vector<RankFingerprint>& all) {
  TPMOE_CHECK(!all.empty(), "rank check: no ranks");
  for (size_t r = 0; r < all.size(); ++r)
    TPMOE_CHECK(all[r].magic == kFingerprintMagic, "rank check: rank {} runs a different tpmoe build", r);
  // A missing GPU first: it explains everything after it.
  for (const auto& f : all)
    TPMOE_CHECK(f.local_rank < f.visible_gpus,
                "rank {} on {} needs GPU {} (its local rank) but its process sees {} GPU(s): start at most {} rank(s) "
                "per host, or make more GPUs visible",
                f.rank, text(f.host, sizeof f.host), f.local_rank, f.visible_gpus, f.visible_gpus);
  const RankFingerprint& f0 = all[0];
  for (const auto& f : all)
    TPMOE_CHECK(f.tp == f0.tp, "ranks disagree on the tensor-parallel size: rank 0 has --tp {}, rank {} has --tp {}",
                f0.tp, f.rank, f.tp);
  TPMOE_CHECK(f0.tp == int(all.size()),
              "--tp {} but {} rank(s) were launched: under mpirun start exactly --tp processes (mpirun -np {})", f0.tp,
              all.size(), f0.tp);
  for (const auto& f : all)
    TPMOE_CHECK(f.config_hash == f0.config_hash,
                "ranks disagree on the model: rank 0 loaded ({}, config hash {:016x}), rank {} loaded ({}, config hash "
                "{:016x}); every rank must load the same checkpoint",
                text(f0.model, sizeof f0.model), f0.config_hash, f.rank, text(f.model, sizeof f.model), f.config_hash);
  for (const auto& f : all)
    TPMOE_CHECK(f.plan_hash == f0.plan_hash,
                "ranks disagree on the fusion plan (rank 0: {:016x}, rank {}: {:016x}); give every rank the same "
                "--allreduce-fusion, --shared-expert-fusion and --pp-stages",
                f0.plan_hash, f.rank, f.plan_hash);
}

void check_gpus_for_tp(int tp, int visible_gpus) {
  TPMOE_CHECK(visible_gpus > 0, "--device cuda: no CUDA GPU is visible{}", gpu_hint());
  TPMOE_CHECK(tp <= visible_gpus,
              "--device cuda --tp {} needs {} GPUs (one per rank) but {} {} visible{}; lower --tp, or run one process "
              "per GPU across hosts with mpirun -np {}",
              tp, tp, visible_gpus, visible_gpus == 1 ? "is" : "are", gpu_hint(), tp);
}

}  // namespace tpmoe
