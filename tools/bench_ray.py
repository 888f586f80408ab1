"""Speed-up of ``requant --ray`` from one Ray worker process to two, for a CPU-bound encoder
(IQ2_XS) on a K3-shaped fixture (real expert shapes), side by side in one run against the local
single-process run (``--workers 1``, the baseline).

    python tools/bench_ray.py [--experts 4] [--layers 2] [--keep DIR]

Each Ray cluster is started here with ``ray.cluster_utils`` (a head and, for two workers, a second
node process, one CPU each); the kernels are compiled before timing (numba's cache).  Prints wall
seconds, weights per second and the ratios, and checks that every run wrote the same bytes.
A benchmark, not a test: the figures depend on the machine (two cores here, shared).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def _run(src, dst, **kw):
    from k3ckpt import api

    t0 = time.perf_counter()
    r = api.requant(src, dst, format="gguf-iq2_xs", **kw)
    return time.perf_counter() - t0, r


def _on_cluster(nodes: int, src, dst):
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(nodes - 1):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        return _run(src, dst, ray=c.address)
    finally:
        ray.shutdown()
        c.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=4, help="routed experts per MoE layer (real shapes)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--keep", default=None, help="work folder to keep (default: a temporary one)")
    a = ap.parse_args()
    from k3ckpt import api
    from k3ckpt.fixtures import make_fixture

    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="bench-ray-"))
    try:
        src = make_fixture("k3", root / "src", layers=a.layers, experts=a.experts, overwrite=True)
        plan = api.requant(src, root / "x", format="gguf-iq2_xs", dry_run=True).plan
        weights = plan.params
        print(f"fixture: {len(plan.weights)} expert weights, {weights / 1e6:.1f} M weights, "
              f"{plan.in_bytes / 1e9:.2f} GB of experts")
        _run(src, root / "warm", workers=1)              # compile the kernels once, untimed
        local, base = _run(src, root / "local", workers=1)
        one, r1 = _on_cluster(1, src, root / "ray1")
        two, r2 = _on_cluster(2, src, root / "ray2")
        same = all((root / d / n).read_bytes() == (root / "local" / n).read_bytes()
                   for d in ("ray1", "ray2") for n in base.shards)
        print(f"{'run':<28}{'wall s':>10}{'M weights/s':>14}")
        for label, t in (("local, --workers 1 (baseline)", local), ("ray, 1 worker", one), ("ray, 2 workers", two)):
            print(f"{label:<28}{t:>10.2f}{weights / t / 1e6:>14.2f}")
        print(f"speed-up 1 -> 2 Ray workers: {one / two:.2f}x; 2 Ray workers vs local single process: "
              f"{local / two:.2f}x; 1 Ray worker vs local: {local / one:.2f}x")
        print("nodes (2 workers):", ", ".join(f"{n['tasks']} tasks, {n['busy_seconds']:.1f} s busy"
                                               for n in r2.cluster["nodes"]))
        print(f"same bytes in every run: {same}")
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
