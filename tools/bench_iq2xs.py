#!/usr/bin/env python3
"""gguf-iq2_xs (llama.cpp IQ2_XS, 2.3125 bpw) from MXFP4: quality and one-core speed.

    python tools/bench_iq2xs.py                    # [3072, 3584], a Kimi K3 w1 expert
    python tools/bench_iq2xs.py --size 512x3584 --repeat 1
    python tools/bench_iq2xs.py --json

Data: the generator of tools/bench_requant.py (imported from it): an
MXFP4-encoded unit Gaussian and an MXFP4-encoded Student-t(5) with per-row
scale spread, each through the OCP encoder and the ggml rule.  Errors are
against the decoded MXFP4 values (``requant.metrics.error_stats``).

Rows: our IQ2_XS encoder; beside it the 2.25-bpw schemes of bench_requant
(keep-scales, refit, mx2: cheap to run); llama.cpp's own IQ2_XS quantizer
(``ggml_quantize_chunk`` through ctypes, importance matrix all ones: it
requires one) when ``llama_cpp`` (llama-cpp-python) is importable, else the
figure REQUANT.md records for it.  Speed: process CPU time of one thread
pinned to one core (``os.sched_setaffinity``, like ``taskset -c``), best of
``--repeat``; the numpy reference on a slice.
"""

from __future__ import annotations

import os

for _var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_requant  # noqa: E402  (same data generator and timing helper)
from k3ckpt.formats import mxfp4  # noqa: E402
from k3ckpt.formats.iq2xs import BLOCK_BYTES, QK, decode_iq2xs  # noqa: E402
from k3ckpt.requant import iq2xs  # noqa: E402
from k3ckpt.requant.metrics import error_stats  # noqa: E402

BPW = 8 * BLOCK_BYTES / QK                      # 2.3125
SHANNON_DB = 10 * math.log10(2 ** (2 * BPW))    # D(R) = 2^-2R: 13.92 dB (iid Gaussian)
LLAMA_REF = {"gaussian": 10.47, "speed_mw_s": 1.29}   # REQUANT.md: IQ2_XS, imatrix = ones, 1 thread
TARGET_DB = 10.5
TARGET_MW_S = 5.0
BIAS_TARGET = 1e-3
GGML_TYPE_IQ2_XS = 17


def pin_one_core() -> str:
    """Pin this process to one CPU (the first it may use); return a note for the table."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity)"
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return f"pinned to CPU {cpu}"


# ------------------------------------------------------------- llama.cpp (optional)
def llama_quantizer():
    """``quantize(x [n, k] float32) -> IQ2_XS bytes [n, k/256*74]`` through ggml, or (None, reason)."""
    try:
        from llama_cpp import _ggml  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"llama_cpp not importable ({type(exc).__name__})"
    lib = _ggml.libggml
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]
    if hasattr(lib, "ggml_quantize_init"):
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        lib.ggml_quantize_init(GGML_TYPE_IQ2_XS)

    def quantize(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        n, k = x.shape
        out = np.zeros((n, k // QK * BLOCK_BYTES), np.uint8)
        ones = np.ones(k, np.float32)   # IQ2_XS aborts without an importance matrix
        size = fn(GGML_TYPE_IQ2_XS, x.ctypes.data, out.ctypes.data, 0, n, k, ones.ctypes.data)
        assert size == out.nbytes, (size, out.nbytes)
        return out

    return quantize, "ggml_quantize_chunk, imatrix = ones"


# ------------------------------------------------------------------------ run
def run(n: int, k: int, repeat: int, seed: int, ref_rows: int) -> dict:
    llama, llama_note = llama_quantizer()
    res: dict = {"shape": [n, k], "weights": n * k, "bits_per_weight": BPW, "llama_cpp": llama_note,
                 "quality": {}, "speed": {}}
    for dname, x in bench_requant.datasets(n, k, seed).items():
        for rule, (packed, scale) in bench_requant.mxfp4_sources(x).items():
            src = mxfp4.decode_pair(packed, scale)
            row = {"iq2xs": error_stats(src, decode_iq2xs(iq2xs.encode(src))).to_dict()}
            for m, y in bench_requant.encode_all(packed, scale).items():
                row[m] = error_stats(src, y).to_dict()
            if llama is not None:
                row["llama.cpp iq2_xs"] = error_stats(src, decode_iq2xs(llama(src))).to_dict()
            res["quality"][f"{dname}/{rule}"] = row
    packed, scale = mxfp4.encode_pair(bench_requant.datasets(n, k, seed)["gaussian"])
    src = mxfp4.decode_pair(packed, scale)
    w = src.size
    sub = src[:ref_rows]
    enc = iq2xs.encode(src)
    timings = {
        "iq2xs encode": (w, bench_requant.cpu_best(lambda: iq2xs.encode(src), repeat)),
        "iq2xs encode, numpy reference": (sub.size, bench_requant.cpu_best(lambda: iq2xs.encode_reference(sub), 1)),
        "iq2xs decode (numba)": (w, bench_requant.cpu_best(lambda: decode_iq2xs(enc), repeat)),
    }
    if llama is not None:
        timings["llama.cpp iq2_xs quantize"] = (w, bench_requant.cpu_best(lambda: llama(src), 1))
    for name, (count, sec) in timings.items():
        res["speed"][name] = count / sec / 1e6
    res["targets"] = targets(res, llama is not None)
    return res


def targets(res: dict, have_llama: bool) -> list[dict]:
    q, out = res["quality"], []

    def add(name, want, measured, ok):
        out.append({"target": name, "want": want, "measured": measured, "pass": bool(ok)})

    g = q["gaussian/ocp"]["iq2xs"]["snr_db"]
    add(f"gaussian/ocp: iq2xs SNR >= {TARGET_DB} dB", f">= {TARGET_DB}", g, g >= TARGET_DB)
    ref_db = q["gaussian/ocp"]["llama.cpp iq2_xs"]["snr_db"] if have_llama else LLAMA_REF["gaussian"]
    add("gaussian/ocp: iq2xs beats llama.cpp IQ2_XS" + ("" if have_llama else " (REQUANT.md figure)"),
        f"> {ref_db:.3f}", g, g > ref_db)
    for key, row in q.items():
        if key.endswith("/ocp"):
            b = row["iq2xs"]["bias_rel_rms"]
            add(f"{key}: iq2xs |mean bias| / RMS", f"< {BIAS_TARGET}", b, abs(b) < BIAS_TARGET)
    sp = res["speed"]["iq2xs encode"]
    add(f"speed iq2xs encode (one core, CPU time) >= {TARGET_MW_S} Mw/s", f">= {TARGET_MW_S}", sp, sp >= TARGET_MW_S)
    ref_sp = res["speed"].get("llama.cpp iq2_xs quantize", LLAMA_REF["speed_mw_s"])
    add("speed: faster than llama.cpp IQ2_XS" + ("" if have_llama else " (REQUANT.md figure)"),
        f"> {ref_sp:.2f}", sp, sp > ref_sp)
    return out


def render(res: dict, pin_note: str) -> str:
    n, k = res["shape"]
    lines = [f"gguf-iq2_xs ({res['bits_per_weight']} bpw) from MXFP4, [{n}, {k}] = {res['weights'] / 1e6:.1f} M "
             f"weights; {pin_note}; llama.cpp: {res['llama_cpp']}", ""]
    lines.append(f"{'source / scheme':<40} {'bpw':>6} {'SNR dB':>8} {'rel MSE':>9} {'bias/RMS':>10} {'max abs':>8}")
    bpw = {"iq2xs": BPW, "llama.cpp iq2_xs": BPW, "keep-scales": 2.25, "refit": 2.25, "mx2": 2.25}
    for key, row in res["quality"].items():
        for m, st in row.items():
            lines.append(f"{key + ' ' + m:<40} {bpw[m]:>6.4g} {st['snr_db']:>8.3f} {st['rel_mse']:>9.4f} "
                         f"{st['bias_rel_rms']:>10.2e} {st['max_abs']:>8.3g}")
    if "llama.cpp iq2_xs" not in next(iter(res["quality"].values())):
        lines.append(f"{'llama.cpp IQ2_XS (REQUANT.md, Gaussian)':<40} {BPW:>6.4g} {LLAMA_REF['gaussian']:>8.3f}")
    lines.append(f"{'bound: Shannon D(R) at 2.3125 bpw':<40} {BPW:>6.4g} {SHANNON_DB:>8.3f}  (iid Gaussian)")
    lines += ["", f"{'speed (one core, CPU time)':<40} {'Mw/s':>9}"]
    for name, v in res["speed"].items():
        lines.append(f"{name:<40} {v:>9.3f}")
    if "llama.cpp iq2_xs quantize" not in res["speed"]:
        lines.append(f"{'llama.cpp IQ2_XS quantize (REQUANT.md)':<40} {LLAMA_REF['speed_mw_s']:>9.3f}")
    lines += ["", f"{'target':<58} {'want':>10} {'measured':>12}  result"]
    for t in res["targets"]:
        lines.append(f"{t['target']:<58} {t['want']:>10} {t['measured']:>12.4g}  {'PASS' if t['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="3072x3584", help="N x K, K a multiple of 256 (default: one K3 w1 expert)")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per kernel (best is kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ref-rows", type=int, default=2, help="rows for the numpy reference timing")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    n, k = bench_requant.parse_size(args.size)
    if k % QK:
        raise SystemExit(f"K = {k} is not a multiple of {QK}: IQ2_XS is not applicable")
    pin_note = "not pinned" if args.no_pin else pin_one_core()
    res = run(n, k, args.repeat, args.seed, args.ref_rows)
    res["pinning"] = pin_note
    print(json.dumps(res, indent=2) if args.json else render(res, pin_note))
    return 0 if all(t["pass"] for t in res["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
