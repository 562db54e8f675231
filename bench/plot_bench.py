#!/usr/bin/env python3
"""Draw `tpmoe bench --json` output: decode tokens/s against concurrency (batch), one line per fusion
setting (shared-expert fusion / all-reduce fusion), log-scaled batch axis.

    tpmoe bench --device cuda --preset m3 --layers 4 --compare-fusions --json bench.json
    python3 bench/plot_bench.py bench.json -o docs/bench_fusions.png

With --extrapolated, the "tok/s @60L (extrapolated)" column is drawn instead (dashed), when present.
Needs matplotlib.
"""
import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="tpmoe bench --json output")
    ap.add_argument("-o", "--out", default="bench_fusions.png", help="PNG to write")
    ap.add_argument("--extrapolated", action="store_true", help="plot tokens_per_s_extrapolated")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()

    with open(args.json) as f:
        report = json.load(f)
    key = "tokens_per_s_extrapolated" if args.extrapolated else "tokens_per_s"
    series = {}
    for row in report["rows"]:
        if key not in row:
            sys.exit(f"{args.json}: rows have no '{key}'")
        series.setdefault(row["setting"], []).append((row["batch"], row[key]))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"on/on": "both fusions", "off/on": "shared-expert off", "on/off": "all-reduce off",
             "off/off": "no fusion"}
    # Top: tokens/s. Bottom (with more than one setting): each setting relative to off/off (or the
    # last setting), where gains of a few percent are visible.
    base = "off/off" if "off/off" in series else list(series)[-1]
    with_rel = len(series) > 1
    fig, axes = plt.subplots(2 if with_rel else 1, 1, figsize=(6.4, 6.0 if with_rel else 4.2), dpi=100,
                             sharex=True, gridspec_kw={"height_ratios": [2, 1]} if with_rel else None)
    ax = axes[0] if with_rel else axes
    base_tps = dict(series[base])
    for setting, points in series.items():
        points.sort()
        xs, ys = zip(*points)
        style = dict(marker="o", linestyle="--" if args.extrapolated else "-")
        ax.plot(xs, ys, label=f"{setting} ({names.get(setting, setting)})", **style)
        if with_rel:
            axes[1].plot(xs, [100.0 * (y / base_tps[x] - 1) for x, y in zip(xs, ys)], **style)
    batches = sorted({b for pts in series.values() for b, _ in pts})
    bottom = axes[1] if with_rel else ax
    for a in (axes if with_rel else [ax]):
        a.set_xscale("log", base=2)
        a.grid(True, which="both", alpha=0.3)
    bottom.set_xticks(batches)
    bottom.set_xticklabels([str(b) for b in batches])
    bottom.set_xlabel("concurrency (batch)")
    if with_rel:
        axes[1].set_ylabel(f"% vs {base}")
        axes[1].axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("decode tokens/s" + (" (extrapolated)" if args.extrapolated else ""))
    layers = report.get("extrapolated_layers")
    title = args.title or (f"tpmoe decode, {report['model']}, {report['device']}, tp {report['tp']}"
                           + (f" (extrapolated to {layers} layers)" if args.extrapolated and layers else ""))
    ax.set_title(title, fontsize=9)
    ax.legend(title="shared-expert / all-reduce fusion", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
