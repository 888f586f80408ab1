#!/usr/bin/env python3
"""MXFP4 codec throughput on one thread: k3ckpt numba kernels vs numpy reference,
the gguf package, and memcpy.

    python tools/bench_codec.py                 # [3072, 3584], a Kimi K3 w1 expert
    python tools/bench_codec.py --size 2048x7168
    python tools/bench_codec.py --size 4        # ~4M weights, K = 3584
    python tools/bench_codec.py --json

Decode: pair-layout bytes -> float32 [N, K] into a preallocated array (numba,
and numba to bfloat16), the numpy reference, gguf ``dequantize`` of the same
data in GGUF order, and ``np.copyto`` of a float32 array of the output size
(memcpy). Encode: float32 -> pair layout (numba, numpy reference) and gguf
``quantize`` (ggml rule, not bit-equal to ours). Each is the best of
``--repeat`` runs (slow ones stop after ``--budget`` seconds).

Targets: decode >= 0.60 x memcpy throughput of the output size; encode >= 300 M
weights/s.
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

from k3ckpt.formats import gguf_mxfp4, mxfp4  # noqa: E402
from k3ckpt.formats.base import output_dtype  # noqa: E402

DECODE_TARGET = 0.60   # x memcpy throughput of the output size
ENCODE_TARGET = 300e6  # weights per second


def parse_size(text: str) -> tuple[int, int]:
    if "x" in text.lower():
        n, k = (int(v) for v in text.lower().split("x"))
    else:
        k = 3584
        n = max(1, round(float(text) * 1e6 / k))
    if k % 32:
        raise SystemExit(f"K = {k} is not a multiple of 32")
    return n, k


def best_of(fn, repeat: int, budget: float) -> float:
    fn()  # warm-up: numba compile or cache load, first-touch of buffers
    times = []
    start = time.perf_counter()
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget:
            break
    return min(times)


def run(n: int, k: int, repeat: int, budget: float, with_gguf: bool) -> dict:
    rng = np.random.default_rng(0)
    weights = n * k
    x = (rng.standard_t(5, (n, k)) * 0.02).astype(np.float32)
    packed, scale = mxfp4.encode_pair(x)
    blocks = gguf_mxfp4.pair_to_gguf(packed, scale)
    out = np.empty((n, k), np.float32)
    src = np.ones((n, k), np.float32)
    out_bf16 = np.empty((n, k), output_dtype("bfloat16"))

    # like-for-like check before timing: kernels equal the reference on these bytes
    rows = slice(0, min(n, 64))
    assert np.array_equal(mxfp4.decode_pair(packed[rows], scale[rows]).view(np.uint32),
                          mxfp4.decode_pair_ref(packed[rows], scale[rows]).view(np.uint32))

    out_bytes = weights * 4
    results = {"shape": [n, k], "weights": weights, "decode": {}, "encode": {}}

    def rec(section, name, seconds, nbytes):
        results[section][name] = {
            "seconds": seconds,
            "mweights_per_s": weights / seconds / 1e6,
            "gb_per_s": nbytes / seconds / 1e9,
        }

    rec("decode", "memcpy", best_of(lambda: np.copyto(out, src), repeat, budget), out_bytes)
    rec("decode", "numba", best_of(lambda: mxfp4.decode_pair(packed, scale, dst=out), repeat, budget), out_bytes)
    rec("decode", "numba_bf16",
        best_of(lambda: mxfp4.decode_pair(packed, scale, out="bfloat16", dst=out_bf16), repeat, budget),
        weights * 2)
    rec("decode", "numba_gguf", best_of(lambda: gguf_mxfp4.decode_gguf(blocks, dst=out), repeat, budget), out_bytes)
    rec("decode", "numpy_ref", best_of(lambda: mxfp4.decode_pair_ref(packed, scale, dst=out), repeat, budget),
        out_bytes)
    if with_gguf:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        with np.errstate(over="ignore"):
            rec("decode", "gguf", best_of(lambda: dequantize(blocks, GGMLQuantizationType.MXFP4), repeat, budget),
                out_bytes)
    rec("encode", "numba", best_of(lambda: mxfp4.encode_pair(x), repeat, budget), out_bytes)
    rec("encode", "numpy_ref", best_of(lambda: mxfp4.encode_pair_ref(x), repeat, budget), out_bytes)
    if with_gguf:
        rec("encode", "gguf", best_of(lambda: quantize(x, GGMLQuantizationType.MXFP4), repeat, budget), out_bytes)

    dec, enc = results["decode"], results["encode"]

    def ratio(a, b, sec):
        return sec[a]["mweights_per_s"] / sec[b]["mweights_per_s"] if b in sec else None

    results["ratios"] = {
        "decode_numba_over_memcpy": ratio("numba", "memcpy", dec),
        "decode_numba_over_numpy": ratio("numba", "numpy_ref", dec),
        "decode_numba_over_gguf": ratio("numba", "gguf", dec),
        "encode_numba_over_numpy": ratio("numba", "numpy_ref", enc),
        "encode_numba_over_gguf": ratio("numba", "gguf", enc),
    }
    results["targets"] = {
        "decode_vs_memcpy": {"target": DECODE_TARGET, "measured": results["ratios"]["decode_numba_over_memcpy"],
                             "pass": results["ratios"]["decode_numba_over_memcpy"] >= DECODE_TARGET},
        "encode_weights_per_s": {"target": ENCODE_TARGET, "measured": enc["numba"]["mweights_per_s"] * 1e6,
                                 "pass": enc["numba"]["mweights_per_s"] * 1e6 >= ENCODE_TARGET},
    }
    return results


def render(res: dict) -> str:
    n, k = res["shape"]
    lines = [f"MXFP4 codec, one thread, [{n}, {k}] = {res['weights'] / 1e6:.1f} M weights (best of runs)", ""]
    for section, what in (("decode", "output GB/s"), ("encode", "input GB/s")):
        lines.append(f"{section:<10} {'Mw/s':>10} {what:>12} {'ms':>9}")
        for name, r in res[section].items():
            lines.append(f"  {name:<12} {r['mweights_per_s']:>8.0f} {r['gb_per_s']:>12.2f} {r['seconds'] * 1e3:>9.1f}")
        lines.append("")
    lines.append("ratios")
    for name, v in res["ratios"].items():
        lines.append(f"  {name:<28} {'n/a' if v is None else f'{v:.2f}x'}")
    lines.append("")
    t = res["targets"]
    d, e = t["decode_vs_memcpy"], t["encode_weights_per_s"]
    lines.append(f"target decode >= {d['target']:.2f} x memcpy: {d['measured']:.2f}  "
                 f"{'PASS' if d['pass'] else 'FAIL'}")
    lines.append(f"target encode >= {e['target'] / 1e6:.0f} Mw/s: {e['measured'] / 1e6:.0f}  "
                 f"{'PASS' if e['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="3072x3584", help="NxK, or millions of weights (K = 3584)")
    ap.add_argument("--repeat", type=int, default=7, help="runs per measurement (best is kept)")
    ap.add_argument("--budget", type=float, default=3.0, help="seconds after which a slow one stops repeating")
    ap.add_argument("--no-gguf", action="store_true", help="skip the gguf package")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    n, k = parse_size(args.size)
    with_gguf = not args.no_gguf
    if with_gguf:
        try:
            import gguf  # noqa: F401
        except ImportError:
            with_gguf = False
    res = run(n, k, max(1, args.repeat), args.budget, with_gguf)
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0 if all(v["pass"] for v in res["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
