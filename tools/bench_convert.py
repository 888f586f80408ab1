"""FP8 -> MXFP4 with `k3ckpt requant`: peak RSS and peak disk, next to the BF16-copy route (issue 6 sec. 4).

    python tools/bench_convert.py                    # ~0.5 GB and ~2 GB K2-shaped FP8 fixtures, workers 1 and 2
    python tools/bench_convert.py --gb 0.25 1        # smaller, for a quick look
    python tools/bench_convert.py --keep DIR         # build (or reuse) the fixtures under DIR

The fixtures are Kimi K2 / DeepSeek-V3 block-FP8 checkpoints at the real
expert shapes (hidden 7168, moe_intermediate 2048; 44 MB per routed expert),
few layers and experts, several shards (``--shard-mb``), built through the
fixture API (``FixtureSpec`` with ``K2Dims``).  For each fixture and worker
count it runs ``k3ckpt requant SRC DST --format mxfp4 --workers W`` as a child
and records

* wall time and MB/s of source;
* peak RSS of the process tree (the child plus its pool workers, summed,
  sampled from /proc by ``bench_requant_e2e._tree_memory`` every 40 ms) and the
  main process's exact peak (``os.wait4``'s ru_maxrss: on Linux the pool's workers are
  forked from multiprocessing's fork server, so they are not among its waited children);
* peak disk used by DST during the run: allocated bytes (``st_blocks * 512``)
  of every file under DST, hidden ``.partial`` temporaries included, sampled
  every 20 ms; and DST's final size.

The BF16-copy route (dequantize to a BF16 checkpoint, then quantize that) is
not run; its figures are computed from the source's headers: the BF16 copy
holds every FP8 weight as BF16 (2 bytes per value), drops ``weight_scale_inv``
and keeps every other tensor as stored.  Its disk need is source + BF16 copy
+ output at once; a tool that loads the model whole holds at least the BF16
copy in RAM.  Sources are read through the page cache (the fixtures were just
written or read), so wall times are for a warm cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))  # k3ckpt from this checkout, in this process and (cwd) in the children
from bench_requant_e2e import _tree_memory  # noqa: E402
from bench_rss import flat_verdict, folder_bytes  # noqa: E402

from k3ckpt.api import open_source  # noqa: E402
from k3ckpt.fixtures import FixtureSpec, K2Dims, build_fixture  # noqa: E402
from k3ckpt.io.reader import load_config  # noqa: E402

K2_HIDDEN = 7168
K2_MOE_INTERMEDIATE = 2048
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
DISK_TICK_S = 0.020
RSS_EVERY = 2   # tree RSS every 2nd tick: one /proc walk costs ~5 ms of a shared core


def k2_spec(layers: int, experts: int, shard_bytes: int) -> FixtureSpec:
    return FixtureSpec(name="kimi-k2-bench", profile="deepseek_v3",
                       dims=K2Dims(layers=layers, experts=experts, top_k=min(2, experts),
                                   hidden=K2_HIDDEN, moe_intermediate=K2_MOE_INTERMEDIATE),
                       shard_bytes=shard_bytes, description="K2 block-FP8 at real expert shapes (bench_convert)")


def experts_for(target_bytes: float, layers: int, shard_bytes: int) -> int:
    """Routed experts per MoE layer that bring the fixture closest to ``target_bytes`` (size is affine in it)."""
    one, two = (k2_spec(layers, e, shard_bytes).total_bytes for e in (1, 2))
    return max(1, 1 + round((target_bytes - one) / (two - one)))


def ensure_fixture(root: Path, spec: FixtureSpec) -> Path:
    dst = root / f"k2-fp8-l{spec.layers}-e{spec.experts}"
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        cfg = load_config(dst / "config.json")
        with open_source(dst) as ckpt:
            same = (ckpt.total_size == spec.total_bytes and cfg.get("hidden_size") == K2_HIDDEN
                    and cfg.get("moe_intermediate_size") == K2_MOE_INTERMEDIATE and len(ckpt.shards) > 1)
        if same:
            return dst
    print(f"building {dst.name} ({spec.total_bytes / 1e9:.2f} GB) ...", flush=True)
    t0 = time.perf_counter()
    build_fixture(spec, dst, overwrite=True)
    print(f"  built in {time.perf_counter() - t0:.1f} s", flush=True)
    return dst


def allocated_bytes(folder: Path) -> int:
    """Bytes allocated on disk (st_blocks * 512) by every file under ``folder``, hidden ones included."""
    total = 0
    stack = [folder]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(Path(e.path))
                    else:
                        total += e.stat(follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:   # a .partial renamed between listing and stat
                    continue
    return total


@dataclass(frozen=True)
class Run:
    wall_s: float
    tree_rss: int     # peak summed RSS of the child and its descendants (sampled; at least own_rss)
    own_rss: int      # wait4's ru_maxrss: the main process's peak (and any spawned worker's), exact
    peak_disk: int    # peak allocated bytes under DST (sampled every 20 ms)
    final_disk: int   # allocated bytes under DST at the end
    out_bytes: int    # file sizes under DST at the end
    samples: int


def run_measured(argv: list[str], dst: Path) -> Run:
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        peak = {"rss": 0, "disk": 0, "n": 0}
        done = threading.Event()

        def sample() -> None:
            tick = 0
            while not done.is_set():
                peak["disk"] = max(peak["disk"], allocated_bytes(dst))
                if tick % RSS_EVERY == 0:
                    peak["rss"] = max(peak["rss"], _tree_memory(proc.pid, pss=False)[0])
                tick += 1
                peak["n"] = tick
                done.wait(DISK_TICK_S)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        done.set()
        th.join()
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            sys.exit(f"child failed: {' '.join(argv)}\n{err.read().decode(errors='replace')}")
    final = allocated_bytes(dst)
    own = usage.ru_maxrss * 1024
    # the sampled tree can miss a short peak that wait4's exact per-process figure saw; the tree holds at least it
    return Run(wall, max(peak["rss"], own), own, max(peak["disk"], final), final,
               sum(p.stat().st_size for p in dst.rglob("*") if p.is_file()), peak["n"])


@dataclass(frozen=True)
class Bf16Route:
    fp8_tensors: int
    fp8_values: int
    scale_inv_bytes: int
    other_bytes: int
    source_tensor_bytes: int

    @property
    def copy_bytes(self) -> int:
        """Tensor bytes of the full BF16 copy: FP8 values at 2 bytes, scale_inv dropped, the rest as stored."""
        return 2 * self.fp8_values + self.other_bytes


def bf16_route(src: Path) -> Bf16Route:
    n = values = scale = other = 0
    with open_source(src) as ckpt:
        for e in ckpt.tensors.values():
            if e.dtype in FP8_DTYPES:
                n += 1
                values += e.nbytes        # one byte per FP8 value
            elif e.name.endswith(".weight_scale_inv"):
                scale += e.nbytes
            else:
                other += e.nbytes
        total = ckpt.total_size
    return Bf16Route(n, values, scale, other, total)


def gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


def mib(x: float) -> str:
    return f"{x / 2**20:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, nargs=2, default=(0.5, 2.0), metavar=("SMALL", "LARGE"),
                    help="approximate fixture sizes in GB (default 0.5 2); sets the routed experts per layer")
    ap.add_argument("--layers", type=int, default=3, help="decoder layers; the first is dense (default 3)")
    ap.add_argument("--shard-mb", type=int, default=256, help="shard size cap of the fixtures in MiB (default 256)")
    ap.add_argument("--workers", type=int, nargs="+", default=(1, 2), help="worker counts to run (default 1 2)")
    ap.add_argument("--keep", type=Path, help="build or reuse fixtures under this folder (default: a temp dir)")
    args = ap.parse_args()

    shard_bytes = args.shard_mb << 20
    root = (args.keep or Path(tempfile.mkdtemp(prefix="k3ckpt-convert-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    rows, peaks = [], {}
    try:
        specs = [k2_spec(args.layers, experts_for(g * 1e9, args.layers, shard_bytes), shard_bytes) for g in args.gb]
        fixtures = [ensure_fixture(root, s) for s in specs]
        for spec, src in zip(specs, fixtures):
            route = bf16_route(src)
            src_bytes = folder_bytes(src)
            for w in args.workers:
                dst = root / f"out-{src.name}-w{w}"
                shutil.rmtree(dst, ignore_errors=True)
                r = run_measured([sys.executable, "-m", "k3ckpt", "requant", str(src), str(dst),
                                  "--format", "mxfp4", "--workers", str(w), "-q"], dst)
                shutil.rmtree(dst)
                peaks.setdefault(w, []).append(r.tree_rss)
                rows.append((spec, src, route, src_bytes, w, r))
                print(f"  {src.name} workers {w}: {r.wall_s:.1f} s, peak disk {gb(r.peak_disk)} GB, "
                      f"peak RSS tree {mib(r.tree_rss)} MiB ({r.samples} disk samples)", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    load1 = os.getloadavg()

    print(f"\nk3ckpt requant SRC DST --format mxfp4: K2-shaped block-FP8 fixtures (hidden {K2_HIDDEN}, "
          f"moe_intermediate {K2_MOE_INTERMEDIATE}, {args.layers} layers, shards <= {args.shard_mb} MiB); "
          f"{os.cpu_count()} CPUs, load average {load0[0]:.2f} before, {load1[0]:.2f} after; "
          f"{time.perf_counter() - t_start:.0f} s in all\n")
    print("| fixture | W | source GB | output GB | wall s | MB/s of source | DST peak disk GB (temp over output) "
          "| disk: ours (source + DST peak) vs BF16 route (source + BF16 copy + output) GB "
          "| peak RSS MiB: ours, tree (main process) vs BF16 route (model in RAM) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec, src, route, src_bytes, w, r in rows:
        bf16_disk = src_bytes + route.copy_bytes + r.out_bytes
        print(f"| {spec.experts} experts x {spec.layers - 1} MoE layers, {len(list(src.glob('*.safetensors')))} shards "
              f"| {w} | {gb(src_bytes)} | {gb(r.out_bytes)} | {r.wall_s:.1f} | {src_bytes / r.wall_s / 1e6:.0f} "
              f"| {gb(r.peak_disk)} (+{(r.peak_disk - r.out_bytes) / 1e6:.1f} MB) "
              f"| {gb(src_bytes + r.peak_disk)} vs {gb(bf16_disk)} ({bf16_disk / (src_bytes + r.peak_disk):.2f}x) "
              f"| {mib(r.tree_rss)} ({mib(r.own_rss)}) vs >= {mib(route.copy_bytes)} "
              f"({route.copy_bytes / r.tree_rss:.1f}x) |")
    print()
    for spec, src, route, src_bytes, w, r in rows[:: len(args.workers)]:
        print(f"BF16 route for {src.name}: {route.fp8_tensors} FP8 tensors, {route.fp8_values / 1e9:.3f} G values "
              f"x 2 B = {gb(2 * route.fp8_values)} GB, + {gb(route.other_bytes)} GB other tensors as stored, "
              f"- {route.scale_inv_bytes / 1e6:.2f} MB weight_scale_inv dropped = BF16 copy {gb(route.copy_bytes)} GB "
              f"({route.copy_bytes / route.source_tensor_bytes:.2f}x the source's {gb(route.source_tensor_bytes)} GB "
              f"of tensors)")
    for w, (small, large, *_) in peaks.items():
        ratio = large / small
        print(f"workers {w}: peak RSS (tree) large/small = {mib(large)}/{mib(small)} MiB = {ratio:.3f} -> "
              f"{flat_verdict(ratio)}")


if __name__ == "__main__":
    main()
