// Checks that the ranks of one tensor-parallel group agree before they run a collective together
// (SPEC §4: ranks that disagree deadlock or compute garbage silently). Each rank fills a small
// fixed-size fingerprint; the launcher exchanges them (ncclAllGather in thread-per-GPU mode,
// MPI_Allgather under mpirun) and every rank runs the same check on the same table, so they all
// fail together with the same message instead of some waiting forever for the others.
// CPU-only code: tested without a GPU (tests/test_comm_checks.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "model/fusion_plan.h"

namespace tpmoe {

// Plain bytes (exchanged as such between processes and hosts).
struct RankFingerprint {
  uint32_t magic = 0;
  int32_t rank = 0;
  int32_t tp = 0;            // tensor-parallel size this rank was asked for
  int32_t world = 0;         // ranks actually launched (threads or MPI processes)
  int32_t local_rank = 0;    // GPU index on its host
  int32_t visible_gpus = 0;  // GPUs this rank's process sees
  uint64_t config_hash = 0;  // config.json as parsed (every field)
  uint64_t plan_hash = 0;    // the printed fusion plan
  char host[48] = {};
  char model[64] = {};  // a short summary of the config, for the message
};

uint64_t fnv1a64(std::string_view bytes);

RankFingerprint make_fingerprint(const ModelConfig& config, const FusionPlan& plan, int rank, int tp, int world,
                                 int local_rank, int visible_gpus);

// Throws tpmoe::Error naming what differs (TP size, model, fusion plan) and which ranks, or which
// rank has no GPU. `all[r]` is rank r's fingerprint.
void check_fingerprints(const std::vector<RankFingerprint>& all);

// Thread-per-GPU mode: one GPU per rank on this host.
void check_gpus_for_tp(int tp, int visible_gpus);

}  // namespace tpmoe
