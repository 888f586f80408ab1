"""What ``k3ckpt verify --source`` plans on the virtual K3, without reading data: wall and peak RSS.

Writes the virtual K3 (``k3ckpt fixture k3-virtual``) and a header-only dequant output of it
(its planned tensors as headers over sparse files, ~60 MB on disk for 5.56 TB of holes), then
times ``plan_source_check``: the output's 249,924 tensors matched against the dequant plan
rebuilt from the source's 497,220 headers.

    python tools/bench_verify_plan.py [--dir DIR] [--job dequant|requant]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from k3ckpt.fixtures import make_virtual_k3
from k3ckpt.io.header import build_header
from k3ckpt.io.reader import open_checkpoint
from k3ckpt.shard.verify_convert import expected_outputs, plan_source_check


def write_header_only(dst: Path, specs, per_shard: int = 20_000) -> None:
    """``specs`` as safetensors headers over holes, ``per_shard`` tensors a file, with an index."""
    dst.mkdir(parents=True, exist_ok=True)
    groups = [specs[i:i + per_shard] for i in range(0, len(specs), per_shard)]
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        prefix, offsets = build_header([(s.name, s.dtype, s.shape, s.nbytes) for s in group])
        with open(dst / name, "wb") as f:
            f.write(prefix)
            f.truncate(len(prefix) + (offsets[-1][1] if offsets else 0))
        weight_map.update((s.name, name) for s in group)
    total = sum(s.nbytes for s in specs)
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--job", default="dequant", choices=["dequant", "requant"])
    a = ap.parse_args(argv)
    root = Path(a.dir or tempfile.mkdtemp(prefix="k3v-verify-"))
    src = root / "k3v" if (root / "k3v").is_dir() else make_virtual_k3(root / "k3v")
    options = ({"dtype": "bf16", "tensors": None} if a.job == "dequant"
               else {"format": "moet-w2", "experts": None, "projections": None, "tensor_type": []})
    out = root / f"out-{a.job}"
    with open_checkpoint(src) as ck:
        if not out.is_dir():
            specs, _ = expected_outputs(ck, a.job, options)
            write_header_only(out, list(specs))
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        with open_checkpoint(out) as o:
            plan = plan_source_check(o, ck, a.job, options)
        wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"verify plan ({a.job} output of the virtual K3): {plan.expected:,} tensors planned, "
          f"{plan.transformed:,} checked by dtype/shape, {len(plan.compare):,} to compare "
          f"({plan.compare_bytes:,} B), {len(plan.problems)} problem(s); {wall:.1f} s wall (output opened "
          f"and matched), peak RSS {rss / 1024:.0f} MiB (before it {rss0 / 1024:.0f} MiB)")
    return 0 if not plan.problems else 1


if __name__ == "__main__":
    sys.exit(main())
