"""The README's picture: the ring and the master against G, on the modeled clock and on this machine's own clock.

    python benchmarks/network_picture.py               # 9 repetitions, 4 MiB per rank
    python benchmarks/network_picture.py --reps 3 --out /tmp/quick

Both clocks time the same calls (course_lib.bench: variants interleaved in one launch per world size,
order shuffled anew each repetition, a repetition's time the slowest rank's), 4 MiB per rank:

* the modeled clock: 10 Gigabit Ethernet through a switch (`Network.preset("10GbE")`, 1.25 GB/s, 20 us), G = 2
  to 64 ranks on this laptop; the formulas of `Network.predict` are drawn beside the measured medians;
* this machine: the same calls over loopback, with nothing modeled: G = 2..8 processes on 2 cores.

Writes benchmarks/results/network_picture.{json,md} (every time) and docs/network_on_a_laptop.png.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import course_lib
from course_lib import bench
from course_lib.network import Network

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = Network.preset("10GbE")
NBYTES = 4 << 20
VARIANTS = ("ring", "parameter_server")
COLORS = {"ring": "C2", "parameter_server": "C1"}


def measure(reps: int, modeled_sizes, plain_sizes) -> dict:
    modeled = bench.run(sizes=[NBYTES], world_sizes=modeled_sizes, variants=VARIANTS, reps=reps, network=LINK,
                        arg_checks=True, progress=True)
    plain = bench.run(sizes=[NBYTES], world_sizes=plain_sizes, variants=VARIANTS, reps=reps, arg_checks=True,
                      progress=True)
    return {"modeled": modeled, "plain": plain}


def draw(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    grid = sorted({r.world_size for r in results["modeled"]})
    for variant in VARIANTS:
        color = COLORS[variant]
        left.plot(grid, [1e3 * LINK.predict(variant, NBYTES, g) for g in grid], "-", color=color,
                  label=f"{variant}: formula")
        for ax, key in ((left, "modeled"), (right, "plain")):
            rows = sorted(results[key].where(variant), key=lambda r: r.world_size)
            ax.errorbar([r.world_size for r in rows], [1e3 * r.median for r in rows], fmt="o", color=color,
                        yerr=[[1e3 * (r.median - r.quartiles[0]) for r in rows],
                              [1e3 * (r.quartiles[1] - r.median) for r in rows]],
                        capsize=3, label=f"{variant}: measured (median, IQR)")
    left.set_title(f"the modeled clock: {LINK.describe()}", fontsize=10)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    right.set_title("this machine's loopback, nothing modeled (2 cores)", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("ranks G")
        ax.set_ylabel("ms per all-reduce of 4 MiB per rank")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("The ring against the master (parameter server): the formulas show on the modeled clock, up to 64 "
                 "ranks on a laptop")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(results: dict, meta: dict) -> str:
    lines = ["# The ring and the master against G: a modeled link and this machine", "",
             f"`{meta['command']}`. Machine: {meta['cpus']} CPUs ({meta['cpu_model']}), torch {meta['torch']}, "
             f"{meta['date']}; load average before {meta['load_before']}, after {meta['load_after']}. 4 MiB per rank, "
             "argument checks on, every repetition runs both variants (shuffled); slowest rank per repetition.",
             "Left column: the ranks' modeled clocks; right column: this machine's clock (where it ran).", "",
             "| G | variant | modeled link: median (IQR) | formula | x formula | this machine: median (IQR) |",
             "| --- | --- | --- | --- | --- | --- |"]
    plain_sizes = {r.world_size for r in results["plain"]}
    for g in sorted({r.world_size for r in results["modeled"]} | plain_sizes):
        for variant in VARIANTS:
            m = results["modeled"].get(variant, g, NBYTES) if g in {r.world_size for r in results["modeled"]} else None
            p = results["plain"].get(variant, g, NBYTES) if g in plain_sizes else None
            left = (f"{1e3 * m.median:.3f} ms ({1e3 * m.quartiles[0]:.3f}..{1e3 * m.quartiles[1]:.3f}) | "
                    f"{1e3 * m.predicted:.3f} ms | {m.model_ratio:.6f}") if m else "- | - | -"
            right = f"{1e3 * p.median:.1f} ms ({1e3 * p.quartiles[0]:.1f}..{1e3 * p.quartiles[1]:.1f})" if p else "-"
            lines.append(f"| {g} | {variant} | {left} | {right} |")
    for key, label in (("modeled", "modeled link"), ("plain", "this machine")):
        rows = results[key]
        growth = {v: rows.get(v, max(r.world_size for r in rows), NBYTES).median
                  / rows.get(v, min(r.world_size for r in rows), NBYTES).median for v in VARIANTS}
        lines += ["", f"{label}: from G = {min(r.world_size for r in rows)} to {max(r.world_size for r in rows)} the ring's "
                      f"median grows {growth['ring']:.2f}x, the master's {growth['parameter_server']:.2f}x."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--modeled-world-sizes", default="2,4,8,16,32,64")
    parser.add_argument("--world-sizes", default="2,3,4,5,6,7,8", help="on this machine's clock")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "network_picture"))
    parser.add_argument("--picture", default=str(ROOT / "docs" / "network_on_a_laptop.png"))
    args = parser.parse_args(argv)
    meta = {**bench.machine_description(), "command": "python benchmarks/network_picture.py " + " ".join(argv or sys.argv[1:]),
            "load_before": [round(x, 2) for x in os.getloadavg()]}
    results = measure(args.reps, [int(g) for g in args.modeled_world_sizes.split(",")],
                      [int(g) for g in args.world_sizes.split(",")])
    meta["load_after"] = [round(x, 2) for x in os.getloadavg()]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "link": LINK.describe(), "nbytes": NBYTES,
                   **{key: [r.to_dict() for r in rows] for key, rows in results.items()}}, f, indent=1)
    text = markdown(results, meta)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    draw(results, pathlib.Path(args.picture))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
