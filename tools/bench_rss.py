"""Peak RSS of the streaming paths on two checkpoint sizes: memory must not grow with the checkpoint.

    python tools/bench_rss.py                      # k3 fixtures past 1 GiB (experts=30) and 4 GiB (experts=122)
    python tools/bench_rss.py --experts 8 32       # smaller, for a quick look
    python tools/bench_rss.py --keep DIR           # build (or reuse) the fixtures under DIR

Each job runs in a fresh child process; its peak RSS is read from the child's
own rusage (``os.wait4``), so the parent's memory never counts.  Jobs:

* ``inspect --scan``: the CLI command, reading every byte (histograms, NaN/Inf);
* ``decode``: every quantized weight decoded to float32 through the format
  registry, chunk by chunk, results discarded (what ``dequant`` does minus the
  writes, so the disk does not need 4x the fixture).

The verdict line compares the peak at the large size with the small one (the
issue's bar: within 10%).  ``baseline`` is a child that only imports k3ckpt
and numpy, the fixed cost every job carries.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DECODE_CHILD = r"""
import sys, math
import numpy as np
from k3ckpt.api import open_source
from k3ckpt.dequant import find_quantized
from k3ckpt.formats import get_format
from k3ckpt.io.dtypes import lookup

CHUNK = 64 << 20
n_weights = 0
with open_source(sys.argv[1]) as ckpt:
    todo, _ = find_quantized(ckpt)
    for w in todo:
        fmt = get_format(w.format)
        dtype_of = {p.role: p.dtype for p in fmt.info.parts}
        whole = {r for r in w.parts if r not in dtype_of}   # per-tensor side parts, read whole
        dtype_of |= {t.role: t.dtype for t in getattr(fmt.info, "tensor_parts", ())}
        step = max(1, CHUNK // (4 * max(math.prod(w.shape[1:]), 1)))
        for r0 in range(0, w.shape[0], step):
            r1 = min(w.shape[0], r0 + step)
            parts = {role: (ckpt.read_raw(t) if role in whole else ckpt.read_rows(t, r0, r1))
                     .view(np.dtype(lookup(dtype_of[role]).storage)) for role, t in w.parts.items()}
            n_weights += fmt.decode(parts, out=np.float32, name=w.weight).size
print(n_weights)
"""

BASELINE_CHILD = "import numpy, k3ckpt.api, k3ckpt.formats"


def run_child(argv: list[str]) -> tuple[float, int, str]:
    """(seconds, peak RSS bytes, stdout) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read().decode()
    err = proc.stderr.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"child failed ({proc.returncode}): {' '.join(argv)}\n{err}")
    return time.perf_counter() - t0, usage.ru_maxrss * 1024, out  # Linux reports KiB


def ensure_fixture(root: Path, experts: int) -> Path:
    dst = root / f"k3-e{experts}"
    if (dst / "model.safetensors.index.json").is_file():
        return dst
    if dst.exists():
        shutil.rmtree(dst)
    print(f"building k3 fixture with {experts} experts per layer in {dst} ...", flush=True)
    subprocess.run([sys.executable, "-m", "k3ckpt", "fixture", "k3", str(dst), "--num-experts", str(experts)],
                   check=True, stdout=subprocess.DEVNULL)
    return dst


def flat_verdict(ratio: float) -> str:
    """The issues' bar for peak RSS on two checkpoint sizes: within 10%."""
    return "flat (within 10%)" if abs(ratio - 1) <= 0.10 else "NOT flat"


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, nargs=2, default=(30, 122), metavar=("SMALL", "LARGE"),
                    help="experts per MoE layer of the two k3 fixtures (default 30 and 122: 1.08 and 4.31 GB, past 1 GiB and 4 GiB)")
    ap.add_argument("--keep", type=Path, help="build or reuse fixtures under this folder (default: a temp dir)")
    args = ap.parse_args()

    root = args.keep or Path(tempfile.mkdtemp(prefix="k3ckpt-rss-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        fixtures = [ensure_fixture(root, e) for e in args.experts]
        _, base_rss, _ = run_child([sys.executable, "-c", BASELINE_CHILD])
        print(f"\nbaseline (imports only): peak RSS {base_rss / 2**20:.1f} MiB")
        rows = []
        for job, argv_of in (
            ("inspect --scan", lambda p: [sys.executable, "-m", "k3ckpt", "inspect", "--scan", "-q", str(p)]),
            ("decode", lambda p: [sys.executable, "-c", DECODE_CHILD, str(p)]),
        ):
            peaks = []
            for fx in fixtures:
                secs, rss, _ = run_child(argv_of(fx))
                size = folder_bytes(fx)
                peaks.append(rss)
                rows.append((job, fx.name, size, secs, rss))
                print(f"{job:15s} {fx.name:9s} {size / 1e9:6.2f} GB  {secs:7.1f} s  "
                      f"{size / secs / 1e6:7.1f} MB/s  peak RSS {rss / 2**20:7.1f} MiB", flush=True)
            ratio = peaks[1] / peaks[0]
            print(f"{job:15s} peak RSS large/small = {ratio:.3f}  -> {flat_verdict(ratio)}\n")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
