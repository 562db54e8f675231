// The dense linears of a decode step past the GEMV's range (9-128 tokens; the default list starts at
// 17), which the engine runs on tpmoe's skinny linear up to 16 tokens and on cuBLASLt beyond
// (Gemm::linear: the heuristic's first algorithm for the shape): how far cuBLASLt's other candidates,
// tpmoe's split-k GEMM (launch_bf16_linear) and its skinny linear (launch_skinny_linear) land from
// that choice and from the floor. At these shapes a matmul reads a few MB in a few microseconds, so
// which algorithm runs - its tile, its split of K and whether it reduces the split in a kernel of its
// own - decides the time more than the bytes do (docs/PERF.md: "the matmuls of the dense weights are
// the largest distance from the floor" at 64 tokens).
//
// Each (shape, tokens) row times a chain of --chain matmuls over as many distinct copies of the
// weight, recorded as one CUDA graph and replayed after an L2 flush (a 256 MiB read: cold weights,
// clean lines, as a decode step finds them); the median replay over --reps, divided by the chain,
// is a matmul's time. The chain keeps the event and graph launch overheads out of the per-matmul
// time, and a matmul starts where its predecessor ends, as in a step.
// Floor = (weight + input + output bytes) / the read-only bandwidth measured at the start.
//
// Columns: heuristic = Gemm's choice (the first candidate); best = the fastest candidate, its
// rank in the heuristic's list and its configuration (tile id, stages, split-k, reduction scheme:
// none / inplace / compute / output type); no-reduce = the heuristic's first candidate when only
// the schemes that need no reduction kernel (none, inplace) are allowed; split-k GEMM = tpmoe's
// launch_bf16_linear; skinny = tpmoe's launch_skinny_linear with the tiling its launcher picks (row
// warps x k splits), without and with PDL between the chain's launches (the engine launches it with
// PDL: its first weight loads go out before it waits), and the fastest tiling of a sweep (with PDL).
// --all prints every candidate and every tiling.
//
// --mxfp8: the same shapes with MXFP8 weights (e4m3 + an E8M0 scale per 32 k; cuBLASLt has none on
// Hopper): the grouped GEMM (launch_grouped_linear, with PDL as the engine runs it) against the skinny
// linear, which the engine runs for MXFP8 up to 64 tokens; floor = FP8 bytes.
//
//   bench_cuda_gemm [--shapes NxK[f],...] [--tokens M,...] [--candidates C] [--chain L] [--reps R] [--all]
//                   [--mxfp8]
// (default shapes: one tp-8 rank of the m3 preset, then tp 4; a trailing f: fp32 output, as the router's)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/bandwidth.cuh"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/elementwise.cuh"
#include "backends/cuda/moe.cuh"
#include "backends/cuda/skinny_linear.cuh"
#include "bench_args.h"
#include "cold_l2_timer.h"

namespace {

namespace cuda = tpmoe::cuda;

struct Shape {
  int N = 0, K = 0;
  bool out_f32 = false;
  const char* what = "";
};

// One tp-8 rank of the m3 preset (hidden 6144, 64 q heads of 128, 4 KV heads, one index head per KV
// head, 128 experts, I 3072, dense I 12288), then the tp-4 rank's shapes that differ.
const std::vector<Shape> kDefaultShapes = {
    {1536, 6144, false, "tp8 q/k/v/index joined (sparse layer)"},
    {1280, 6144, false, "tp8 q/k/v joined (full layer)"},
    {6144, 1024, false, "tp8 o_proj"},
    {128, 6144, true, "router (fp32 out)"},
    {768, 6144, false, "tp8 shared gate_up"},
    {6144, 384, false, "tp8 shared down"},
    {3072, 6144, false, "tp8 dense gate_up"},
    {6144, 1536, false, "tp8 dense down"},
    {2560, 6144, false, "tp4 q/k/v/index joined (sparse)"},
    {6144, 2048, false, "tp4 o_proj"},
    {1536, 6144, false, "tp4 shared gate_up"},
    {6144, 768, false, "tp4 shared down"},
};

using tpmoe::bench::require;

template <class T>
T* dalloc(size_t n) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

void fill_random(void* out, bool f32, int64_t n, uint64_t key, cudaStream_t stream) {
  cuda::FillRandomParams p;
  p.out = out;
  p.out_f32 = f32;
  p.cols = p.out_row_stride = p.index_row_stride = n;
  p.seed = 7;
  p.key = key;
  p.stddev = 0.02f;
  cuda::launch_fill_random(p, stream);
}

// A cuBLASLt problem laid out as Gemm lays it out (gemm.cpp: out^T = w x^T, "TN").
struct Problem {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  Problem(int M, int N, int K, bool out_f32) {
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, K, N, K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, K, M, K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, out_f32 ? CUDA_R_32F : CUDA_R_16BF, N, M, N));
  }
  ~Problem() {
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(desc);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  // Up to `count` candidates of the heuristic, in its order; `reduction_mask` limits the split-k
  // reduction schemes it may pick (CUBLASLT_REDUCTION_SCHEME_*).
  std::vector<cublasLtMatmulHeuristicResult_t> candidates(cublasLtHandle_t handle, size_t workspace, int count,
                                                          uint32_t reduction_mask) const {
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                      sizeof workspace));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction_mask,
                                                      sizeof reduction_mask));
    std::vector<cublasLtMatmulHeuristicResult_t> out(static_cast<size_t>(count));
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, pref, count, out.data(), &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS) found = 0;
    out.resize(size_t(found));
    std::erase_if(out, [](const cublasLtMatmulHeuristicResult_t& r) { return r.state != CUBLAS_STATUS_SUCCESS; });
    return out;
  }
};

template <class T>
T algo_attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t written = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof v, &written));
  return v;
}

std::string describe(const cublasLtMatmulAlgo_t& algo) {
  const uint32_t scheme = algo_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
  const char* name = scheme == CUBLASLT_REDUCTION_SCHEME_NONE           ? "none"
                     : scheme == CUBLASLT_REDUCTION_SCHEME_INPLACE      ? "inplace"
                     : scheme == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE ? "compute"
                     : scheme == CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE  ? "output"
                                                                        : "?";
  char buf[96];
  std::snprintf(buf, sizeof buf, "algo %d tile %u stages %u splitk %d %s",
                algo_attr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID),
                algo_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                algo_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                algo_attr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), name);
  return buf;
}

std::vector<Shape> parse_shapes(const char* s) {
  std::vector<Shape> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    Shape sh;
    char f = 0;
    const int n = std::sscanf(item.c_str(), "%dx%d%c", &sh.N, &sh.K, &f);
    require(n >= 2 && sh.N > 0 && sh.K > 0 && (n == 2 || f == 'f'), "--shapes: want NxK or NxKf, got '" + item + "'");
    sh.out_f32 = n == 3;
    sh.what = "";
    v.push_back(sh);
  }
  return v;
}

// The skinny linear over a chain of weight copies (w_stride bytes apart; scales likewise when
// MXFP8): the launcher's tiling, or the fastest of a sweep of tilings. Returns us a matmul.
struct SkinnyTimes {
  double chosen_us = 0, chosen_pdl_us = 0, best_us = 0;
  cuda::SkinnyLinearTiling chosen, best;
  std::vector<std::pair<cuda::SkinnyLinearTiling, double>> sweep;
};
SkinnyTimes time_skinny(tpmoe::bench::ColdL2Timer& timer, const cuda::SkinnyLinearParams& base, size_t w_stride,
                        size_t scale_stride, int chain) {
  auto time_tiling = [&](cuda::SkinnyLinearTiling tiling, bool pdl) {
    return timer.time([&](cudaStream_t s) {
      for (int i = 0; i < chain; ++i) {
        cuda::SkinnyLinearParams p = base;
        p.w = static_cast<const char*>(base.w) + size_t(i) * w_stride;
        if (p.w_scale) p.w_scale += size_t(i) * scale_stride;
        cuda::launch_skinny_linear(p, cuda::KernelStream(s, pdl), tiling);
      }
    }) / chain;
  };
  SkinnyTimes t;
  if (!cuda::skinny_linear_fits(base)) {  // past 128 tokens: no skinny column
    t.chosen_us = t.chosen_pdl_us = t.best_us = -1;
    return t;
  }
  t.chosen = cuda::skinny_linear_choose(base);
  t.chosen_us = time_tiling(t.chosen, false);
  t.chosen_pdl_us = time_tiling(t.chosen, true);
  t.best = t.chosen;
  t.best_us = t.chosen_pdl_us;
  for (int rw : {8, 4, 2, 1})
    for (int splits : {1, 2, 3, 4, 6, 8}) {
      const double us = time_tiling({rw, splits}, true);
      t.sweep.push_back({{rw, splits}, us});
      if (us < t.best_us) t.best_us = us, t.best = {rw, splits};
    }
  return t;
}

std::string tiling_name(cuda::SkinnyLinearTiling t) {
  return std::to_string(t.row_warps) + "x" + std::to_string(t.k_splits);
}

void print_sweep(const SkinnyTimes& t) {
  std::printf("    skinny tilings (row warps x k splits, us):");
  for (const auto& [tiling, us] : t.sweep) std::printf(" %s %.2f", tiling_name(tiling).c_str(), us);
  std::printf("\n");
}

// --mxfp8: the grouped GEMM against the skinny linear, FP8 weights (timing only: 1.0 everywhere).
void run_mxfp8(const std::vector<Shape>& shapes, const std::vector<int>& tokens, int chain, bool all,
               tpmoe::bench::ColdL2Timer& timer, double read_bw, cudaStream_t stream) {
  std::printf("%6s %6s %4s %8s | %9s %6s | %9s %6s %5s | %9s %6s | %9s %6s %5s | %s\n", "N", "K", "M", "floor us",
              "grouped", "ratio", "skinny", "ratio", "tile", "skinny+pdl", "ratio", "best", "ratio", "tile", "shape");
  for (const Shape& sh : shapes) {
    require(sh.K % 32 == 0, "--mxfp8: K must be a multiple of 32");
    const int max_m = *std::max_element(tokens.begin(), tokens.end());
    const size_t w_bytes = size_t(sh.N) * size_t(sh.K), s_bytes = w_bytes / 32;
    auto* w = dalloc<uint8_t>(w_bytes * size_t(chain));
    auto* sc = dalloc<uint8_t>(s_bytes * size_t(chain));
    auto* x = dalloc<__nv_bfloat16>(size_t(max_m) * size_t(sh.K));
    void* out = dalloc<char>(size_t(max_m) * size_t(sh.N) * (sh.out_f32 ? 4 : 2));
    CUDA_CHECK(cudaMemsetAsync(w, 0x38, w_bytes * size_t(chain), stream));  // e4m3 1.0
    CUDA_CHECK(cudaMemsetAsync(sc, 127, s_bytes * size_t(chain), stream));  // 2^0
    fill_random(x, false, int64_t(max_m) * sh.K, 2, stream);
    for (int M : tokens) {
      const double bytes = double(w_bytes + s_bytes) + 2.0 * M * sh.K + (sh.out_f32 ? 4.0 : 2.0) * M * sh.N;
      const double floor_us = bytes / read_bw * 1e6;
      const double grouped_us = timer.time([&](cudaStream_t s) {
        for (int i = 0; i < chain; ++i)
          cuda::launch_grouped_linear(
              {x, w + size_t(i) * w_bytes, sc + size_t(i) * s_bytes, out, sh.out_f32, M, sh.N, sh.K},
              cuda::KernelStream(s, true));
      }) / chain;
      const SkinnyTimes t = time_skinny(timer, {x, w, sc, out, sh.out_f32, M, sh.N, sh.K}, w_bytes, s_bytes, chain);
      std::printf("%6d %6d %4d %8.2f | %9.2f %6.2f | %9.2f %6.2f %5s | %9.2f %6.2f | %9.2f %6.2f %5s | %s\n", sh.N,
                  sh.K, M, floor_us, grouped_us, grouped_us / floor_us, t.chosen_us, t.chosen_us / floor_us,
                  tiling_name(t.chosen).c_str(), t.chosen_pdl_us, t.chosen_pdl_us / floor_us, t.best_us,
                  t.best_us / floor_us, tiling_name(t.best).c_str(), sh.what);
      if (all) print_sweep(t);
      std::fflush(stdout);
    }
    cudaFree(w);
    cudaFree(sc);
    cudaFree(x);
    cudaFree(out);
  }
}

int run(int argc, char** argv) {
  std::vector<Shape> shapes = kDefaultShapes;
  std::vector<int> tokens = {17, 32, 64, 128};
  int count = 16, chain = 16, reps = 25;
  bool all = false, mxfp8 = false;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--shapes") && has_value)
      shapes = parse_shapes(argv[++i]);
    else if (!std::strcmp(argv[i], "--tokens") && has_value)
      tokens = tpmoe::bench::parse_list("--tokens", argv[++i], 1 << 20);
    else if (!std::strcmp(argv[i], "--candidates") && has_value)
      count = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--chain") && has_value)
      chain = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && has_value)
      reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--all"))
      all = true;
    else if (!std::strcmp(argv[i], "--mxfp8"))
      mxfp8 = true;
    else
      throw std::runtime_error(std::string("unknown or incomplete option '") + argv[i] +
                               "'; usage: bench_cuda_gemm [--shapes NxK[f],...] [--tokens M,...] [--candidates C] "
                               "[--chain L] [--reps R] [--all] [--mxfp8]");
  }
  require(count >= 1 && chain >= 1 && reps >= 1, "--candidates, --chain and --reps must be at least 1");
  require(!tokens.empty() && !shapes.empty(), "--tokens and --shapes need at least one entry each");
  for (int m : tokens) require(m >= 1, "--tokens: every count must be at least 1");

  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double read_bw = cuda::read_bandwidth();
  std::printf("device %s (%d SMs); read stream %.0f GB/s; cuBLASLt %zu; %d candidates, chains of %d, median of %d\n",
              prop.name, prop.multiProcessorCount, read_bw / 1e9, cublasLtGetVersion(), count, chain, reps);

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasLtHandle_t handle;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  const size_t workspace_bytes = size_t(32) << 20;  // Gemm's default
  void* workspace = dalloc<char>(workspace_bytes);
  tpmoe::bench::ColdL2Timer timer(stream, tpmoe::bench::Flush::kRead, reps);
  if (mxfp8) {
    run_mxfp8(shapes, tokens, chain, all, timer, read_bw, stream);
    cudaFree(workspace);
    cublasLtDestroy(handle);
    CUDA_CHECK(cudaStreamDestroy(stream));
    return 0;
  }

  std::printf("%6s %6s %4s %8s | %9s %6s | %9s %6s  %-44s | %9s | %9s | %9s %9s %5s | %9s %5s | %s\n", "N", "K", "M",
              "floor us", "heuristic", "ratio", "best us", "ratio", "best candidate (rank: config)", "no-reduce",
              "split-k", "skinny", "+pdl", "tile", "best", "tile", "shape");
  for (const Shape& sh : shapes) {
    const int max_m = *std::max_element(tokens.begin(), tokens.end());
    const size_t w_elems = size_t(sh.N) * size_t(sh.K);
    // `chain` copies of the weight: each matmul of a replay reads its own, from HBM.
    auto* w = dalloc<__nv_bfloat16>(w_elems * size_t(chain));
    auto* x = dalloc<__nv_bfloat16>(size_t(max_m) * size_t(sh.K));
    void* out = dalloc<char>(size_t(max_m) * size_t(sh.N) * (sh.out_f32 ? 4 : 2));
    fill_random(w, false, int64_t(w_elems * size_t(chain)), 1, stream);
    fill_random(x, false, int64_t(max_m) * sh.K, 2, stream);
    for (int M : tokens) {
      const Problem prob(M, sh.N, sh.K, sh.out_f32);
      const double bytes = 2.0 * double(w_elems) + 2.0 * M * sh.K + (sh.out_f32 ? 4.0 : 2.0) * M * sh.N;
      const double floor_us = bytes / read_bw * 1e6;
      const float alpha = 1.f, beta = 0.f;
      auto time_algo = [&](const cublasLtMatmulAlgo_t& algo) {
        return timer.time([&](cudaStream_t s) {
          for (int i = 0; i < chain; ++i)
            CUBLAS_CHECK(cublasLtMatmul(handle, prob.desc, &alpha, w + size_t(i) * w_elems, prob.a, x, prob.b, &beta,
                                        out, prob.c, out, prob.c, &algo, workspace, workspace_bytes, s));
        }) / chain;
      };
      const auto cands = prob.candidates(handle, workspace_bytes, count, CUBLASLT_REDUCTION_SCHEME_MASK);
      require(!cands.empty(), "cuBLASLt has no algorithm for this shape");
      std::vector<double> us;
      for (const auto& c : cands) us.push_back(time_algo(c.algo));
      const size_t best = size_t(std::min_element(us.begin(), us.end()) - us.begin());
      const auto no_reduce = prob.candidates(handle, workspace_bytes, 1,
                                             CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_INPLACE);
      const double no_reduce_us = no_reduce.empty() ? -1 : time_algo(no_reduce[0].algo);
      const double ours_us = timer.time([&](cudaStream_t s) {
        for (int i = 0; i < chain; ++i)
          cuda::launch_bf16_linear({x, w + size_t(i) * w_elems, out, sh.out_f32, M, sh.N, sh.K},
                                   cuda::KernelStream(s, false));
      }) / chain;
      const SkinnyTimes sk = time_skinny(timer, {x, w, nullptr, out, sh.out_f32, M, sh.N, sh.K}, w_elems * 2, 0, chain);
      const std::string best_cfg = std::to_string(best) + ": " + describe(cands[best].algo);
      std::printf(
          "%6d %6d %4d %8.2f | %9.2f %6.2f | %9.2f %6.2f  %-44s | %9.2f | %9.2f | %9.2f %9.2f %5s | %9.2f %5s | %s\n",
          sh.N, sh.K, M, floor_us, us[0], us[0] / floor_us, us[best], us[best] / floor_us, best_cfg.c_str(),
          no_reduce_us, ours_us, sk.chosen_us, sk.chosen_pdl_us, tiling_name(sk.chosen).c_str(), sk.best_us,
          tiling_name(sk.best).c_str(), sh.what);
      if (all) {
        for (size_t i = 0; i < cands.size(); ++i)
          std::printf("    %2zu %8.2f us  %s  (workspace %zu, waves %.2f)\n", i, us[i], describe(cands[i].algo).c_str(),
                      cands[i].workspaceSize, double(cands[i].wavesCount));
        if (!no_reduce.empty()) std::printf("    no-reduce first: %s\n", describe(no_reduce[0].algo).c_str());
        print_sweep(sk);
      }
      std::fflush(stdout);
    }
    cudaFree(w);
    cudaFree(x);
    cudaFree(out);
  }
  cudaFree(workspace);
  cublasLtDestroy(handle);
  CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return tpmoe::bench::guarded_main("bench_cuda_gemm", run, argc, argv); }
