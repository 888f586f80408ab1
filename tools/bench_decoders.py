#!/usr/bin/env python3
"""Throughput of the source-format decoders on one thread, next to memcpy of the output.

    python tools/bench_decoders.py                  # [2048, 7168], a Kimi K2 expert's w1
    python tools/bench_decoders.py --size 7168x2048 --repeat 7
    python tools/bench_decoders.py --json

For each decoder (block FP8, INT4 pack-quantized, NVFP4; MXFP4 pair layout for
comparison) the numba kernel decodes random valid bytes of the given shape to
float32 into a preallocated array; ``memcpy`` is ``np.copyto`` of a float32
array of the output size. Also the registry path ``decode(..., out=bfloat16)``
(the formats' own bfloat16 kernels, plus the registry's checks and a fresh
output array). Each figure is the best of ``--repeat`` runs after one warm-up
(which compiles the kernels). Figures vary with machine load; run it alone.
"""

from __future__ import annotations

import os

# One thread everywhere, before numpy/numba load their thread pools.
for _var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3ckpt.formats import fp8_block, int4_pack, mxfp4, nvfp4  # noqa: E402
from k3ckpt.formats.base import get_format  # noqa: E402


def _best(fn, repeat: int) -> float:
    fn()  # warm-up: compile, fault in pages
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="2048x7168", help="N x K of the weight (K a multiple of 128)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    n, k = (int(v) for v in args.size.lower().split("x"))
    if k % 128 or n <= 0:
        ap.error("--size needs N > 0 and K a multiple of 128")
    rng = np.random.default_rng(0)
    out = np.empty((n, k), np.float32)
    src = rng.standard_normal((n, k)).astype(np.float32)

    # valid random parts per format (sample_parts gives finite positive scales)
    fmts = {
        "fp8-block": get_format("fp8-block"),
        "int4-pack-quantized": get_format("int4-pack-quantized"),
        "nvfp4": get_format("nvfp4"),
        "mxfp4-pack-quantized": get_format("mxfp4-pack-quantized"),
    }
    parts = {fid: f.sample_parts((n, k), rng) for fid, f in fmts.items()}
    kernels = {
        "fp8-block": lambda p: fp8_block.decode_fp8_block(p["weight"], p["scale_inv"], dst=out),
        "int4-pack-quantized": lambda p: int4_pack.decode_int4(p["packed"], p["scale"], dst=out),
        "nvfp4": lambda p: nvfp4.decode_nvfp4(p["packed"], p["scale"], p["global_scale"], dst=out),
        "mxfp4-pack-quantized": lambda p: mxfp4.decode_pair(p["packed"], p["scale"], dst=out),
    }
    weights = n * k
    t_copy = _best(lambda: np.copyto(out, src), args.repeat)
    copy_gbs = out.nbytes / t_copy / 1e9
    rows = []
    for fid, f in fmts.items():
        p = parts[fid]
        t = _best(lambda: kernels[fid](p), args.repeat)
        t_bf16 = _best(lambda: f.decode(p, out="bfloat16"), args.repeat)
        rows.append({
            "format": fid,
            "stored_bytes": sum(a.nbytes for a in p.values()),
            "mweights_per_s": weights / t / 1e6,
            "out_gb_per_s": out.nbytes / t / 1e9,
            "x_memcpy": t_copy / t,
            "bf16_registry_mweights_per_s": weights / t_bf16 / 1e6,
        })
    result = {"shape": [n, k], "threads": 1, "memcpy_out_gb_per_s": copy_gbs,
              "memcpy_mweights_per_s": weights / t_copy / 1e6, "decoders": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"shape [{n}, {k}] = {weights / 1e6:.1f} M weights, one thread; "
          f"memcpy of the float32 output: {copy_gbs:.2f} GB/s ({weights / t_copy / 1e6:.0f} M weights/s)")
    print(f"{'decoder':24} {'M weights/s':>12} {'out GB/s':>9} {'x memcpy':>9} {'bf16 via registry':>18}")
    for r in rows:
        print(f"{r['format']:24} {r['mweights_per_s']:12.0f} {r['out_gb_per_s']:9.2f} {r['x_memcpy']:9.2f} "
              f"{r['bf16_registry_mweights_per_s']:14.0f} M/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
