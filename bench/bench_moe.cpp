// MoE layer benchmark (one GPU, bf16 weights, MiniMax-M3 shapes): routing + launch_moe with the
// shared expert fused as row 128, against (a) the unfused layout (routed experts through launch_moe,
// the shared expert as its own cuBLASLt MLP, added after) and (b) a straightforward baseline
// (per-expert cuBLASLt GEMMs: gather, gate_up, SwiGLU, down, weighted scatter-add, host loop over the
// experts the routing touched). Everything is timed as a replayed CUDA graph with a cold L2, median of
// the replays. The L2 is flushed between replays (not timed) by reading a 256 MiB buffer, which
// leaves it full of clean lines, as a decode step finds it (the previous layer's weights). A memset
// flush (--flush memset, the usual one) leaves it full of dirty lines instead, whose write-back then
// runs inside the timed replay and competes with its reads (docs/PERF.md measures how much).
//
// Floor = (distinct expert rows touched, shared included) * 3*I*H*2 bytes + activations (x in,
// out, router logits), over the read-only bandwidth measured at the start of the run (bandwidth.cu).
// "copy ratio": the time over (the expert bytes alone / the device-to-device copy rate, bytes read +
// written a second), the definition of issue 11's table of a peer's fused MoE (vLLM's Triton kernel on
// an H200), so that table's rows compare with this column; a copy moves bytes slower than a read-only
// stream, so this ratio reads lower than "ratio" and may fall under 1.
// "stream us": that bandwidth's own read kernel over the floor's bytes (a prefix of the weights),
// timed like the layer: what one kernel that only reads those bytes takes. Below ~100 MB it is well
// above the floor (a cold start and drain the 8 GiB measurement averages away), so "vs stream"
// tells how far a layer is from what its bytes allow on this GPU, "ratio" from the ideal rate.
//
// --dtype mxfp8: the same layer with MXFP8 expert weights (weight-only FP8: e4m3 in memory, widened to
// bf16 in registers, one E8M0 scale per 32 inputs); the floor counts 3*I*H*(1 + 1/32) bytes per
// distinct row. The unfused and cuBLASLt baselines are bf16-only and are not run.
//
//   bench_moe [--json PATH] [--reps N] [--ablate] [--dtype bf16|mxfp8] [--inter 3072|384] [--batch N]
//             [--flush read|memset]
// (--inter, --batch: only that width or batch of the table, e.g. under a profiler)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backends/cuda/bandwidth.cuh"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/elementwise.cuh"
#include "backends/cuda/gemm.h"
#include "backends/cuda/moe.cuh"
#include "backends/cuda/mxfp8.cuh"
#include "cold_l2_timer.h"
#include "tpmoe/tpmoe.h"

namespace {

// n random values (the presets' generator) at `out`, bf16 or fp32.
void fill_random(void* out, bool f32, int64_t n, uint64_t seed, uint64_t key, float stddev, cudaStream_t stream) {
  tpmoe::cuda::FillRandomParams p;
  p.out = out;
  p.out_f32 = f32;
  p.cols = p.out_row_stride = p.index_row_stride = n;
  p.seed = seed;
  p.key = key;
  p.stddev = stddev;
  tpmoe::cuda::launch_fill_random(p, stream);
}

using tpmoe::bench::ColdL2Timer;
using tpmoe::bench::Flush;
using tpmoe::cuda::Gemm;

constexpr int kHidden = 6144;
constexpr int kExperts = 128;
constexpr int kTopK = 4;
constexpr int kRows = kExperts + 1;  // + the fused shared expert

template <class T>
T* dalloc(size_t n) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

// One column of the table: "-" where nothing was measured (an MXFP8 run has no unfused or cuBLASLt
// layer; the stream has no column past the gate_up prefix), not "nan".
std::string cell(double v, int width, int precision, const char* suffix = "") {
  char buf[64];
  if (std::isnan(v))
    std::snprintf(buf, sizeof buf, "%*s", width + int(std::strlen(suffix)), "-");
  else
    std::snprintf(buf, sizeof buf, "%*.*f%s", width, precision, v, suffix);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int reps = 25;
  bool ablate = false;
  bool mxfp8 = false;
  Flush flush_how = Flush::kRead;
  int only_inter = 0, only_batch = 0;  // 0: every width / batch of the table
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc)
      json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--inter") && i + 1 < argc)
      only_inter = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc)
      only_batch = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--ablate"))
      ablate = true;
    else if (!std::strcmp(argv[i], "--dtype") && i + 1 < argc && !std::strcmp(argv[i + 1], "mxfp8"))
      mxfp8 = (++i, true);
    else if (!std::strcmp(argv[i], "--dtype") && i + 1 < argc && !std::strcmp(argv[i + 1], "bf16"))
      ++i;
    else if (!std::strcmp(argv[i], "--flush") && i + 1 < argc && !std::strcmp(argv[i + 1], "read"))
      ++i;
    else if (!std::strcmp(argv[i], "--flush") && i + 1 < argc && !std::strcmp(argv[i + 1], "memset"))
      flush_how = (++i, Flush::kMemset);
    else {
      std::fprintf(stderr,
                   "usage: %s [--json PATH] [--reps N] [--ablate] [--dtype bf16|mxfp8] [--inter 3072|384] [--batch N] "
                   "[--flush read|memset]\n",
                   argv[0]);
      return 2;
    }
  }
  const std::vector<int> widths = {3072, 384}, batches = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  if ((only_inter != 0 && std::find(widths.begin(), widths.end(), only_inter) == widths.end()) ||
      (only_batch != 0 && std::find(batches.begin(), batches.end(), only_batch) == batches.end())) {
    std::fprintf(stderr, "bench_moe: --inter takes 3072 or 384, --batch one of 1, 2, 4, ..., 256\n");
    return 2;
  }
  try {
    const double bw = tpmoe::measure_read_bandwidth("cuda"), copy_bw = tpmoe::measure_copy_bandwidth("cuda");
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf(
        "device: %s (%d SMs), read bandwidth %.1f GB/s (read-only stream: the floor's ceiling), D2D copy %.1f "
        "GB/s (read + write); expert weights %s; L2 flushed by %s\n",
        prop.name, prop.multiProcessorCount, bw / 1e9, copy_bw / 1e9, mxfp8 ? "MXFP8" : "bf16",
        flush_how == Flush::kRead ? "a 256 MiB read (clean lines)" : "a 256 MiB memset (dirty lines)");

    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ColdL2Timer timer(stream, flush_how, reps);
    uint32_t* sink = timer.sink();
    Gemm gemm;
    const tpmoe::cuda::MoeTuning defaults;

    const int max_T = 256;
    nlohmann::json rows = nlohmann::json::array();
    std::printf("\n%5s %5s %8s %9s %10s %8s %7s %9s %6s %10s %10s %9s %11s %8s %11s %8s\n", "I", "batch", "distinct",
                "MB", "us", "GB/s", "% bw", "floor us", "ratio", "copy ratio", "stream us", "vs stream", "unfused us",
                "gain %", "baseline us", "vs base");
    std::vector<std::string> ablation_lines;

    for (const int I : widths) {
      if (only_inter != 0 && I != only_inter) continue;
      const int H = kHidden;
      // Weights: [129, 2I, H] and [129, H, I]; row 128 is the shared expert.
      const size_t gu_row = size_t(2) * I * H, dn_row = size_t(H) * I;
      auto* gate_up = dalloc<__nv_bfloat16>(kRows * gu_row);
      auto* down = dalloc<__nv_bfloat16>(kRows * dn_row);
      fill_random(gate_up, false, int64_t(kRows * gu_row), 1, 11, 0.02f, stream);
      fill_random(down, false, int64_t(kRows * dn_row), 1, 12, 0.02f, stream);
      // MXFP8: the same values quantized (the bf16 copies above serve as staging).
      uint8_t *gate_up8 = nullptr, *down8 = nullptr, *gate_up_s = nullptr, *down_s = nullptr;
      if (mxfp8) {
        gate_up8 = dalloc<uint8_t>(kRows * gu_row);
        down8 = dalloc<uint8_t>(kRows * dn_row);
        gate_up_s = dalloc<uint8_t>(kRows * gu_row / 32);
        down_s = dalloc<uint8_t>(kRows * dn_row / 32);
        tpmoe::cuda::launch_quantize_mxfp8(gate_up, gate_up8, gate_up_s, int64_t(kRows * gu_row), stream);
        tpmoe::cuda::launch_quantize_mxfp8(down, down8, down_s, int64_t(kRows * dn_row), stream);
      }
      auto* x = dalloc<__nv_bfloat16>(size_t(max_T) * H);
      fill_random(x, false, int64_t(max_T) * H, 2, 1, 1.f, stream);
      auto* logits = dalloc<float>(size_t(max_T) * kExperts);
      fill_random(logits, true, int64_t(max_T) * kExperts, 3, 1, 1.f, stream);
      auto* bias = dalloc<float>(kExperts);
      fill_random(bias, true, kExperts, 4, 1, 0.01f, stream);
      const int slots = kTopK + 1;
      auto* ids = dalloc<int32_t>(size_t(max_T) * slots);
      auto* wts = dalloc<float>(size_t(max_T) * slots);
      auto* ids_u = dalloc<int32_t>(size_t(max_T) * kTopK);
      auto* wts_u = dalloc<float>(size_t(max_T) * kTopK);
      auto* out = dalloc<__nv_bfloat16>(size_t(max_T) * H);
      const size_t ws_bytes = std::max(tpmoe::cuda::moe_workspace_bytes(max_T, slots, H, I, kRows),
                                       tpmoe::cuda::moe_workspace_bytes(max_T, kTopK, H, I, kExperts));
      void* ws = dalloc<uint8_t>(ws_bytes);
      // Unfused shared MLP and baseline scratch.
      auto* gu_buf = dalloc<__nv_bfloat16>(size_t(max_T) * slots * 2 * I);
      auto* a_buf = dalloc<__nv_bfloat16>(size_t(max_T) * slots * I);
      auto* ys_buf = dalloc<__nv_bfloat16>(size_t(max_T) * H);
      auto* xg_buf = dalloc<__nv_bfloat16>(size_t(max_T) * slots * H);
      auto* yf_buf = dalloc<float>(size_t(max_T) * slots * H);
      auto* acc_buf = dalloc<float>(size_t(max_T) * H);
      auto* tok_list = dalloc<int32_t>(size_t(max_T) * slots);
      auto* w_list = dalloc<float>(size_t(max_T) * slots);
      CUDA_CHECK(cudaStreamSynchronize(stream));

      for (const int T : batches) {
        if (only_batch != 0 && T != only_batch) continue;
        tpmoe::cuda::RouteKernelParams rp;
        rp.logits = logits;
        rp.bias = bias;
        rp.slot_ids = ids;
        rp.slot_weights = wts;
        rp.num_tokens = T;
        rp.num_experts = kExperts;
        rp.top_k = kTopK;
        rp.num_shared = 1;
        rp.shared_weight = 1.f;
        tpmoe::cuda::RouteKernelParams rpu = rp;
        rpu.slot_ids = ids_u;
        rpu.slot_weights = wts_u;
        rpu.num_shared = 0;

        tpmoe::cuda::MoeKernelParams mp;
        mp.x = x;
        mp.slot_ids = ids;
        mp.slot_weights = wts;
        mp.gate_up = gate_up;
        mp.down = down;
        if (mxfp8) {
          mp.gate_up = gate_up8;
          mp.down = down8;
          mp.gate_up_scale = gate_up_s;
          mp.down_scale = down_s;
        }
        mp.out = out;
        mp.num_tokens = T;
        mp.slots = slots;
        mp.hidden = H;
        mp.inter = I;
        mp.num_rows = kRows;
        mp.workspace = ws;
        mp.workspace_bytes = ws_bytes;
        tpmoe::cuda::MoeKernelParams mpu = mp;
        mpu.slot_ids = ids_u;
        mpu.slot_weights = wts_u;
        mpu.slots = kTopK;
        mpu.num_rows = kExperts;
        mp.route = rp;  // the layer routes itself, as the engine runs it (Ops::route_experts)
        mpu.route = rpu;

        // Routing once, read back: distinct rows, and the baseline's per-expert token lists.
        tpmoe::cuda::launch_route(rp, stream);
        std::vector<int32_t> h_ids(size_t(T) * slots);
        std::vector<float> h_w(size_t(T) * slots);
        CUDA_CHECK(cudaMemcpyAsync(h_ids.data(), ids, h_ids.size() * 4, cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaMemcpyAsync(h_w.data(), wts, h_w.size() * 4, cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        std::map<int, std::vector<int>> by_expert;  // expert -> pair indices
        for (size_t i = 0; i < h_ids.size(); ++i) by_expert[h_ids[i]].push_back(int(i));
        const int distinct = int(by_expert.size());
        std::vector<int32_t> h_tok;
        std::vector<float> h_wl;
        std::vector<std::pair<int, std::pair<int, int>>> segs;  // expert, (offset, count)
        for (auto& [e, pairs] : by_expert) {
          segs.push_back({e, {int(h_tok.size()), int(pairs.size())}});
          for (int pi : pairs) {
            h_tok.push_back(pi / slots);
            h_wl.push_back(h_w[pi]);
          }
        }
        CUDA_CHECK(cudaMemcpy(tok_list, h_tok.data(), h_tok.size() * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(w_list, h_wl.data(), h_wl.size() * 4, cudaMemcpyHostToDevice));

        const double weight_bytes = double(distinct) * 3.0 * I * H * (mxfp8 ? 1.0 + 1.0 / 32 : 2.0);
        const double act_bytes = double(T) * H * 2 * 2 + double(T) * kExperts * 4;
        const double bytes = weight_bytes + act_bytes;
        const double floor_us = bytes / bw * 1e6;

        auto fused = [&](cudaStream_t s) { tpmoe::cuda::launch_moe(mp, s); };
        auto unfused = [&](cudaStream_t s) {
          tpmoe::cuda::launch_moe(mpu, s);
          gemm.linear(x, gate_up + size_t(kExperts) * gu_row, gu_buf, false, T, 2 * I, H, s);
          tpmoe::cuda::launch_swiglu({gu_buf, a_buf, T, I, 1.702f, 7.0f}, s);
          gemm.linear(a_buf, down + size_t(kExperts) * dn_row, ys_buf, false, T, H, I, s);
          tpmoe::cuda::launch_add_bf16(ys_buf, out, int64_t(T) * H, s);
        };
        auto baseline = [&](cudaStream_t s) {
          tpmoe::cuda::launch_route(rp, s);
          CUDA_CHECK(cudaMemsetAsync(acc_buf, 0, size_t(T) * H * 4, s));
          for (const auto& [e, seg] : segs) {
            const int off = seg.first, n = seg.second;
            tpmoe::cuda::launch_gather_rows(x, tok_list + off, n, H, xg_buf, s);
            gemm.linear(xg_buf, gate_up + size_t(e) * gu_row, gu_buf, false, n, 2 * I, H, s);
            tpmoe::cuda::launch_swiglu({gu_buf, a_buf, n, I, 1.702f, 7.0f}, s);
            gemm.linear(a_buf, down + size_t(e) * dn_row, yf_buf, true, n, H, I, s);
            tpmoe::cuda::launch_scatter_add_weighted(yf_buf, tok_list + off, w_list + off, n, H, acc_buf, s);
          }
          tpmoe::cuda::launch_f32_to_bf16(acc_buf, out, int64_t(T) * H, 1.f, s);
        };

        // A prefix of the bf16 gate_up weights (two thirds of the expert bytes): no column once the
        // routing touches more than that.
        const size_t stream_bytes = size_t(bytes) / 16 * 16;
        const double t_stream =
            stream_bytes <= kRows * gu_row * 2
                ? timer.time([&](cudaStream_t s) { tpmoe::cuda::launch_read_stream(gate_up, stream_bytes, sink, s); })
                : NAN;
        const double t_fused = timer.time(fused);
        const double t_unfused = mxfp8 ? NAN : timer.time(unfused);
        const double t_base = mxfp8 ? NAN : timer.time(baseline);
        const double gbs = bytes / (t_fused * 1e-6) / 1e9;
        const double pct = 100.0 * bytes / (t_fused * 1e-6) / bw;
        const double ratio = t_fused / floor_us;
        const double copy_ratio = t_fused / (weight_bytes / copy_bw * 1e6);
        const double gain = 100.0 * (t_unfused - t_fused) / t_unfused;
        const double vs_base = t_base / t_fused;
        std::printf("%5d %5d %8d %9.1f %10.1f %8.0f %6.1f%% %9.1f %6.3f %10.3f %s %s %s %s %s %s\n", I, T, distinct,
                    bytes / 1e6, t_fused, gbs, pct, floor_us, ratio, copy_ratio, cell(t_stream, 10, 1).c_str(),
                    cell(t_fused / t_stream, 9, 3).c_str(), cell(t_unfused, 11, 1).c_str(),
                    cell(gain, 7, 1, "%").c_str(), cell(t_base, 11, 1).c_str(), cell(vs_base, 7, 2, "x").c_str());
        std::fflush(stdout);
        rows.push_back({{"inter", I},
                        {"batch", T},
                        {"distinct", distinct},
                        {"bytes", bytes},
                        {"us", t_fused},
                        {"gb_per_s", gbs},
                        {"pct_bw", pct},
                        {"floor_us", floor_us},
                        {"ratio", ratio},
                        {"copy_floor_ratio", copy_ratio},
                        {"stream_us", t_stream},
                        {"unfused_us", t_unfused},
                        {"fused_gain_pct", gain},
                        {"baseline_us", t_base},
                        {"vs_baseline", vs_base},
                        {"dtype", mxfp8 ? "mxfp8" : "bf16"}});

        if (ablate) {
          struct Variant {
            const char* name;
            tpmoe::cuda::MoeTuning t;
          };
          std::vector<Variant> vs;
          auto v = defaults;
          v.auto_select = false;
          v.batch_gemv = false;
          vs.push_back({"pdl+prefetch-always", v});
          v = defaults;
          v.auto_select = false;  // the few-token GEMVs at 2-8 tokens of either format
          vs.push_back({"gemv", v});
          v = defaults;
          v.pdl = false;
          vs.push_back({"no-pdl", v});
          v = defaults;
          v.down_prefetch_bytes = 0;
          vs.push_back({"no-prefetch", v});
          // The grouped GEMMs at each token block (where a GEMV path would take the batch: 1-8 tokens).
          for (int bm : {32, 16, 8}) {
            v = defaults;
            v.block_m = bm;
            v.single_token_gemv = v.batch_gemv = false;
            vs.push_back({bm == 32 ? "gemm-bm32" : bm == 16 ? "gemm-bm16" : "gemm-bm8", v});
          }
          char line[512];
          int n = std::snprintf(line, sizeof line, "I=%d T=%d default %.1f", I, T, t_fused);
          for (const auto& var : vs) {
            mp.tuning = var.t;
            n += std::snprintf(line + n, sizeof line - n, " | %s %.1f", var.name, timer.time(fused));
          }
          mp.tuning = defaults;
          ablation_lines.push_back(line);
        }
      }
      for (void* p : std::vector<void*>{gate_up, down,     x,      logits,   bias,  ids,       wts,    ids_u,
                                        wts_u,   out,      ws,     gu_buf,   a_buf, ys_buf,    xg_buf, yf_buf,
                                        acc_buf, tok_list, w_list, gate_up8, down8, gate_up_s, down_s})
        CUDA_CHECK(cudaFree(p));
    }
    if (ablate) {
      std::printf("\nablation (us, fused layer):\n");
      for (const auto& l : ablation_lines) std::printf("%s\n", l.c_str());
    }
    if (!json_path.empty()) {
      nlohmann::json doc = {{"device", prop.name},
                            {"read_bandwidth_bytes_per_s", bw},
                            {"copy_bandwidth_bytes_per_s", copy_bw},
                            {"l2_flush", flush_how == Flush::kRead ? "read" : "memset"},
                            {"rows", rows}};
      std::ofstream(json_path) << doc.dump(2) << "\n";
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe: %s\n", e.what());
    return 1;
  }
  return 0;
}
