"""``k3ckpt inspect`` of the virtual full-size K3 against listing the same headers with stock safetensors.

    python tools/bench_inspect.py                  # builds the virtual K3 in a temporary folder first
    python tools/bench_inspect.py K3V              # a folder made by `k3ckpt fixture k3-virtual K3V`
    python tools/bench_inspect.py K3V --rounds 5

Both sides run in fresh processes, one after the other in each round (a warm-up
round first, not counted), so the numba cache, the page cache and the machine's
load are the same for both:

* ``inspect``: ``python -m k3ckpt inspect K3V --json`` (index, 96 headers, the report);
* ``stock``: ``safetensors.safe_open(shard).keys()`` and ``.metadata()`` for every
  shard, numpy imported (the framework it opens with).

Walls are the minimum over the rounds (the least disturbed run on a shared
machine); CPU is the child's user + system time of that run.  The target is a
wall ratio of at most 3.  The load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STOCK_CHILD = r"""
import sys
from pathlib import Path
from safetensors import safe_open

n = 0
for shard in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with safe_open(str(shard), framework="np") as f:
        n += len(f.keys())
        f.metadata()
print(n)
"""

TARGET = 3.0


def _run(cmd: list[str]) -> tuple[float, float, str]:
    """(wall s, child CPU s, stdout) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("k3v", nargs="?", help="virtual K3 folder (built in a temporary folder if omitted)")
    ap.add_argument("--rounds", type=int, default=3, help="counted rounds (default 3)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    with tempfile.TemporaryDirectory(prefix="k3v-") as tmp:
        k3v = Path(args.k3v) if args.k3v else Path(tmp) / "K3V"
        if not (k3v / "model.safetensors.index.json").is_file():
            print(f"building the virtual K3 in {k3v} ...", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "k3ckpt", "fixture", "k3-virtual", str(k3v)], check=True,
                           stdout=subprocess.DEVNULL)
        sides = {
            "inspect": [sys.executable, "-m", "k3ckpt", "inspect", str(k3v), "--json"],
            "stock": [sys.executable, "-c", STOCK_CHILD, str(k3v)],
        }
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
        load_before = _load()
        for r in range(args.rounds + 1):   # round 0 warms the caches
            for name, cmd in sides.items():
                wall, cpu, out = _run(cmd)
                if name == "inspect":
                    tensors = json.loads(out)["tensor_count"]
                else:
                    listed = int(out)
                if r:
                    runs[name].append((wall, cpu))
        load_after = _load()
    if tensors != listed:
        sys.exit(f"inspect reports {tensors:,} tensors but stock lists {listed:,}")
    best = {k: min(v) for k, v in runs.items()}
    ratio = best["inspect"][0] / best["stock"][0]
    for name, (wall, cpu) in best.items():
        walls = ", ".join(f"{w:.2f}" for w, _ in runs[name])
        print(f"{name:8s} min wall {wall:6.2f} s  (cpu {cpu:5.2f} s; walls {walls})")
    print(f"ratio    {ratio:.2f}x wall, {best['inspect'][1] / best['stock'][1]:.2f}x cpu, over {listed:,} tensors "
          f"(target <= {TARGET:g}x); load average {load_before} before, {load_after} after")


if __name__ == "__main__":
    main()
