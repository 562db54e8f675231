#!/usr/bin/env python3
"""tpmoe against transformers on the same checkpoint, GPU, batch and lengths: decode tokens/s.

    python3 bench/hf_side_by_side.py --model DIR --batch 1,16 --prompt-len 32 --new-tokens 32 \\
        --tpmoe ./build/tpmoe --json side_by_side.json

DIR is a layout-A checkpoint (config.json + safetensors, as transformers writes it; tpmoe reads the
same files). When DIR has no config.json, a random full-width MiniMax-M3 of --create-m3-layers layers
(default 4; transformers' default M3 text config: hidden 6144, 128 experts, top-4, sparse attention)
is built by transformers on the GPU and saved to DIR first. A model of fewer than --min-layers layers
(default 4) is refused: with one layer a decode step is mostly generate()'s fixed per-step cost, not
the model, and the comparison says little about either engine.

transformers side: MiniMaxM3VLForCausalLM (AutoModelForCausalLM maps model_type minimax_m3_vl_text to
it), bf16, on cuda, greedy. Settings are tried fastest first, and the first that works is reported:
  compile: static cache + torch.compile of the decode step (transformers' auto-compile, mode
           "reduce-overhead": CUDA graphs), experts through transformers' default experts kernel
  static:  static cache, eager
  dynamic: dynamic cache, eager
A failure is printed with its reason before falling back.

Protocol, the same as `tpmoe bench`: same prompts (token 1 + (31 b + 7 i) mod 500), --warmup untimed
generates, then --repeats measured generates (default 3), each reported, and their median. A logits
processor records a CUDA event after every forward (no synchronisation), so each decode step is timed
on the GPU's clock: TTFT = start to the first event, TPOT = gaps between events from the second
decode step on (the first one is not averaged in, as in tpmoe), tokens/s = batch / mean TPOT. tpmoe
runs `tpmoe bench` --repeats times (a fresh process each, with its own warm-up) and is reported the
same way.

CUDA graphs: a compiled decode step is only worth its name if it replays CUDA graphs. After the
measured repetitions, one more generate of the "compile" setting runs with torch.cuda.CUDAGraph.replay
wrapped to count its calls and under torch.profiler, whose CUDA runtime calls are counted:
cudaGraphLaunch (graph replays) against cudaLaunchKernel (kernels launched one by one). The setting
is accepted only with at least one graph replay per decode step; the counts, and inductor's cudagraph
counters (cudagraph_skips: graphs it declined to record), are printed and written to the JSON either
way.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

START = time.time()


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def prompts(batch, prompt_len):
    return [[1 + (b * 31 + i * 7) % 500 for i in range(prompt_len)] for b in range(batch)]


def percentile(xs, q):
    xs = sorted(xs)
    pos = q / 100.0 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def create_random_m3(out_dir, layers):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "minimax_m3_vl_text",
        num_hidden_layers=layers,
        layer_types=["minimax_m3_sparse"] * layers,
        mlp_layer_types=["sparse"] * layers,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        pad_token_id=0,
    )
    log(f"building a random {layers}-layer M3 in transformers on cuda: hidden {cfg.hidden_size}, "
        f"{cfg.num_local_experts} experts top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    t0 = time.time()
    model.save_pretrained(out_dir, max_shard_size="5GB")
    log(f"saved {out_dir} in {time.time() - t0:.1f} s")
    return model


def load(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda",
                                                       output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(k):
            log(f"warning: {k}: {len(info[k])}: {sorted(info[k])[:6]}")
    model.eval()
    return model


def graph_evidence(run_once, decode_steps):
    """Runs one generate and counts CUDA graph replays two independent ways: torch.cuda.CUDAGraph.replay
    calls (wrapped for the run; inductor's cudagraph trees replay through it) and, under torch.profiler,
    the CUDA runtime's cudaGraphLaunch calls against single kernel launches (cudaLaunchKernel*,
    cuLaunchKernel*); plus inductor's cudagraph counters. 'replays_graphs' is true when either count
    shows at least one graph replay per decode step."""
    import collections

    import torch

    try:
        from torch._dynamo.utils import counters
    except ImportError:  # very old torch
        counters = None
    replays = [0]
    original_replay = torch.cuda.CUDAGraph.replay

    def counting_replay(self, *args, **kwargs):
        replays[0] += 1
        return original_replay(self, *args, **kwargs)

    names = collections.Counter()
    profiler_error = None
    torch.cuda.CUDAGraph.replay = counting_replay
    try:
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_once()
                torch.cuda.synchronize()
            names.update(e.name for e in prof.events())
        except Exception as e:  # the replay count still stands; say why the profiler's does not
            profiler_error = f"{type(e).__name__}: {str(e)[:200]}"
            replays[0] = 0
            run_once()
    finally:
        torch.cuda.CUDAGraph.replay = original_replay
    graph_launches = sum(n for name, n in names.items() if "GraphLaunch" in name)
    kernel_launches = sum(n for name, n in names.items() if "LaunchKernel" in name)
    # cudagraph_skips counts graphs inductor declined to record (TORCH_LOGS=perf_hints prints why).
    inductor = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k} if counters is not None else {}
    return {"cuda_graph_replay_calls": replays[0], "graph_launches": graph_launches,
            "kernel_launches": kernel_launches, "decode_steps": decode_steps,
            "replays_per_decode_step": replays[0] / max(1, decode_steps),
            "graph_launches_per_decode_step": graph_launches / max(1, decode_steps),
            "kernel_launches_per_decode_step": kernel_launches / max(1, decode_steps),
            "replays_graphs": max(replays[0], graph_launches) >= decode_steps,
            "inductor_cudagraph_counters": inductor, "profiler_error": profiler_error,
            "launch_names": {k: v for k, v in names.items() if "Launch" in k}}


def hf_measure(model, batch, prompt_len, new_tokens, mode, warmup, repeats):
    """One (batch, mode): warm-up generates, then `repeats` measured ones. Returns a result dict or raises."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepEvents(LogitsProcessor):
        def __init__(self):
            self.events = []

        def __call__(self, input_ids, scores):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
            return scores

    ids = torch.tensor(prompts(batch, prompt_len), dtype=torch.long, device="cuda")
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if mode in ("compile", "static"):
        kw["cache_implementation"] = "static"
    if mode != "compile":
        kw["disable_compile"] = True

    def once():
        rec = StepEvents()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        out = model.generate(ids, attention_mask=mask, logits_processor=LogitsProcessorList([rec]), **kw)
        torch.cuda.synchronize()
        assert out.shape == (batch, prompt_len + new_tokens), f"generated shape {tuple(out.shape)}"
        assert len(rec.events) == new_tokens, f"{len(rec.events)} forwards for {new_tokens} tokens"
        ttft = start.elapsed_time(rec.events[0]) / 1e3
        steps = [rec.events[i - 1].elapsed_time(rec.events[i]) / 1e3 for i in range(1, len(rec.events))]
        return ttft, steps

    if mode == "compile":
        try:
            from torch._dynamo.utils import counters
            counters.clear()  # so the cudagraph counters below belong to this setting
        except ImportError:
            pass
    t0 = time.time()
    for _ in range(warmup):
        once()
    warm_s = time.time() - t0
    reps = []
    for rep in range(repeats):
        ttft, steps = once()
        tpot = steps[1:]
        mean = sum(tpot) / len(tpot)
        reps.append({"ttft_ms": ttft * 1e3, "first_step_ms": steps[0] * 1e3, "tpot_mean_ms": mean * 1e3,
                     "tpot_p50_ms": percentile(tpot, 50) * 1e3, "tpot_p99_ms": percentile(tpot, 99) * 1e3,
                     "tokens_per_s": batch / mean})
        log(f"  transformers batch {batch} {mode}, repetition {rep + 1}/{repeats}: {reps[-1]['tokens_per_s']:.1f} "
            f"tokens/s, TPOT {reps[-1]['tpot_mean_ms']:.3f} ms")
    compiled = hasattr(model, "_compiled_call")
    result = {"engine": "transformers", "mode": mode, "batch": batch, "warmup_s": warm_s, "compiled": compiled,
              "repetitions": reps}
    # The median repetition by tokens/s stands for the setting (its other figures come with it).
    result.update(median_repetition(reps))
    if mode == "compile":
        if not compiled:
            raise RuntimeError("transformers did not compile the decode step (auto-compile criteria not met)")
        ev = graph_evidence(once, decode_steps=new_tokens - 1)
        result["cuda_graphs"] = ev
        log(f"  CUDA graph evidence over one more generate of {new_tokens - 1} decode steps: "
            f"{ev['cuda_graph_replay_calls']} CUDAGraph.replay calls; torch.profiler: {ev['graph_launches']} "
            f"cudaGraphLaunch, {ev['kernel_launches']} single kernel launches "
            f"({ev['graph_launches_per_decode_step']:.2f} / {ev['kernel_launches_per_decode_step']:.1f} per decode "
            f"step), launch calls {ev['launch_names']}"
            f"{', profiler failed: ' + ev['profiler_error'] if ev['profiler_error'] else ''}; "
            f"inductor cudagraph counters {ev['inductor_cudagraph_counters'] or 'none'}")
        if not ev["replays_graphs"]:
            raise RuntimeError(f"the compiled decode step does not replay CUDA graphs: {ev['cuda_graph_replay_calls']} "
                               f"replays and {ev['graph_launches']} graph launches for {new_tokens - 1} decode "
                               f"steps ({ev['kernel_launches']} single kernel launches; inductor: "
                               f"{ev['inductor_cudagraph_counters']})")
    return result


def median_repetition(reps):
    """The repetition with the median tokens/s (the lower middle one for an even count), so every
    figure reported comes from one real run, plus the spread."""
    ordered = sorted(reps, key=lambda r: r["tokens_per_s"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["tokens_per_s_median"] = statistics.median(r["tokens_per_s"] for r in reps)
    mid["tokens_per_s_min"] = ordered[0]["tokens_per_s"]
    mid["tokens_per_s_max"] = ordered[-1]["tokens_per_s"]
    return mid


def tpmoe_repetitions(runs, batches):
    """Per batch, the repetitions of `tpmoe bench` (one JSON each) and the median one."""
    out = []
    for batch in batches:
        reps = [next(r for r in run["rows"] if r["batch"] == batch) for run in runs
                if any(r["batch"] == batch for r in run["rows"])]
        if not reps:
            continue
        row = {"engine": "tpmoe", "batch": batch, "repetitions": reps}
        row.update(median_repetition(reps))
        out.append(row)
    return out


def run_tpmoe(tpmoe, model_dir, batches, prompt_len, new_tokens, warmup, json_path, timeout):
    cmd = [tpmoe, "bench", "--model", model_dir, "--device", "cuda", "--batch", ",".join(map(str, batches)),
           "--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens), "--warmup", str(warmup),
           "--json", json_path]
    log("running " + " ".join(cmd))
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    print(r.stdout, flush=True)
    if r.returncode != 0:
        raise RuntimeError(f"tpmoe bench exited {r.returncode}")
    with open(json_path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (layout A, config.json)")
    ap.add_argument("--create-m3-layers", type=int, default=4,
                    help="when --model has no config.json: build a random full-width M3 of N layers there first")
    ap.add_argument("--min-layers", type=int, default=4,
                    help="refuse a model with fewer layers (a 1-layer model mostly measures generate()'s overhead)")
    ap.add_argument("--repeats", type=int, default=3, help="measured repetitions per side; each and the median reported")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default="compile,static,dynamic",
                    help="transformers settings, fastest first; the first that works is reported")
    ap.add_argument("--tpmoe", default="", help="tpmoe binary: also run `tpmoe bench` on the same checkpoint")
    ap.add_argument("--tpmoe-timeout", type=float, default=300)
    ap.add_argument("--budget-s", type=float, default=0,
                    help="wall-clock budget: skip settings (compile first) that would start too late")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    if args.new_tokens < 3:
        sys.exit("--new-tokens must be at least 3")
    if args.repeats < 1:
        sys.exit("--repeats must be at least 1")
    batches = [int(b) for b in args.batch.split(",")]
    modes = args.modes.split(",")

    import torch
    import transformers

    result = {"tool": "bench/hf_side_by_side.py", "model": args.model, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "transformers": transformers.__version__, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "warmup": args.warmup, "repeats": args.repeats, "hf": [],
              "tpmoe": None, "tpmoe_runs": [], "notes": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)

    config_path = os.path.join(args.model, "config.json")
    if os.path.exists(config_path):
        with open(config_path) as f:
            cfg = json.load(f)
        layers = cfg.get("num_hidden_layers", cfg.get("text_config", {}).get("num_hidden_layers", 0))
    else:
        layers = args.create_m3_layers
    if layers < args.min_layers:
        sys.exit(f"{args.model}: {layers} layers, fewer than --min-layers {args.min_layers}: a decode step of so "
                 f"few layers mostly measures generate()'s per-step overhead (lower --min-layers to run it anyway)")
    result["layers"] = layers
    if not os.path.exists(config_path):
        model = create_random_m3(args.model, args.create_m3_layers)
    else:
        log(f"loading {args.model} ({layers} layers) with transformers")
        model = load(args.model)
    log(f"transformers model: {type(model).__name__}, experts implementation "
        f"{getattr(model.config, '_experts_implementation', '?')}, "
        f"{sum(p.numel() for p in model.parameters()) * 2 / 1e9:.2f} GB of bf16 parameters")

    # tpmoe first, while the transformers model sits idle on the GPU.
    if args.tpmoe:
        import tempfile

        tmp = tempfile.mkdtemp(prefix="tpmoe-bench-")
        for rep in range(args.repeats):
            try:
                log(f"tpmoe repetition {rep + 1}/{args.repeats}")
                result["tpmoe_runs"].append(run_tpmoe(args.tpmoe, args.model, batches, args.prompt_len,
                                                      args.new_tokens, args.warmup,
                                                      os.path.join(tmp, f"tpmoe-{rep}.json"), args.tpmoe_timeout))
            except Exception as e:  # report and carry on with transformers
                result["notes"].append(f"tpmoe repetition {rep + 1} failed: {e}")
                log(f"tpmoe repetition {rep + 1} failed: {e}")
        result["tpmoe"] = {"rows": tpmoe_repetitions(result["tpmoe_runs"], batches)}
        save()

    for batch in batches:
        for mode in modes:
            elapsed = time.time() - START
            if args.budget_s and mode == "compile" and elapsed > 0.6 * args.budget_s:
                note = f"batch {batch}: {mode} skipped, {elapsed:.0f} s of the {args.budget_s:.0f} s budget spent"
                result["notes"].append(note)
                log(note)
                continue
            log(f"transformers batch {batch}, setting {mode} ...")
            try:
                r = hf_measure(model, batch, args.prompt_len, args.new_tokens, mode, args.warmup, args.repeats)
            except Exception as e:
                note = f"batch {batch}: setting '{mode}' failed: {type(e).__name__}: {str(e)[:300]}"
                result["notes"].append(note)
                log(note)
                traceback.print_exc(limit=3)
                torch.cuda.synchronize()
                continue
            log(f"transformers batch {batch} {mode}: median {r['tokens_per_s']:.1f} tokens/s of {args.repeats}, "
                f"TPOT {r['tpot_mean_ms']:.3f} ms, TTFT {r['ttft_ms']:.1f} ms (warm-up {r['warmup_s']:.1f} s)")
            result["hf"].append(r)
            save()
            break

    # Side by side.
    print(f"\nside by side: {args.model} ({result['layers']} layers) on {result['gpu']}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"tokens/s = batch / mean TPOT (decode steps after the first); same protocol on both; median of "
          f"{args.repeats} repetitions per side (each listed); TPOT of the median repetition; 'graphs/step' = "
          f"cudaGraphLaunch calls per decode step of the compiled transformers model (torch.profiler)")
    print(f"{'batch':>6} {'tpmoe tok/s':>12} {'tpmoe TPOT':>11} {'hf setting':>10} {'hf tok/s':>10} {'hf TPOT':>9} "
          f"{'graphs/step':>11} {'tpmoe/hf':>9}  repetitions (tok/s): tpmoe | hf")
    rows = []
    fmt = lambda v, f: format(v, f) if v is not None else "-"
    for batch in batches:
        t = next((r for r in (result["tpmoe"] or {}).get("rows", []) if r["batch"] == batch), None)
        h = next((r for r in result["hf"] if r["batch"] == batch), None)
        ratio = t["tokens_per_s"] / h["tokens_per_s"] if t and h else None
        graphs = h and h.get("cuda_graphs", {}).get("graph_launches_per_decode_step")
        reps = lambda r: " ".join(f"{x['tokens_per_s']:.1f}" for x in r["repetitions"]) if r else "-"
        rows.append({"batch": batch, "tpmoe_tokens_per_s": t and t["tokens_per_s"],
                     "tpmoe_repetitions": t and [x["tokens_per_s"] for x in t["repetitions"]],
                     "hf_tokens_per_s": h and h["tokens_per_s"],
                     "hf_repetitions": h and [x["tokens_per_s"] for x in h["repetitions"]],
                     "hf_setting": h and h["mode"], "hf_graph_launches_per_decode_step": graphs, "ratio": ratio})
        print(f"{batch:>6} {fmt(t and t['tokens_per_s'], '12.1f')} {fmt(t and t['tpot_mean_ms'], '11.3f')} "
              f"{(h and h['mode']) or '-':>10} {fmt(h and h['tokens_per_s'], '10.1f')} "
              f"{fmt(h and h['tpot_mean_ms'], '9.3f')} {fmt(graphs, '11.2f')} {fmt(ratio, '9.2f')}  "
              f"{reps(t)} | {reps(h)}")
    result["side_by_side"] = rows
    for n in result["notes"]:
        print("note:", n)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
