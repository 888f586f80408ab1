#!/usr/bin/env python3
"""k3ckpt's llama.cpp-family encoders (gguf-q2_k, gguf-iq2_xxs, gguf-iq2_xs, gguf-iq2_s, gguf-iq1_m, gguf-iq1_s,
gguf-iq3_xxs) against ggml's own quantizers.

    python tools/bench_llamacpp_quants.py                  # [1024, 3584]: a third of a K3 w1 expert
    python tools/bench_llamacpp_quants.py --size 256x3584 --repeat 1
    python tools/bench_llamacpp_quants.py --json
    python tools/bench_llamacpp_quants.py --formats iq1_m,iq1_s
    python tools/bench_llamacpp_quants.py --holdout        # data no tuning has looked at

Data: the generator of tools/bench_requant.py: a unit Gaussian and a Student-t(5)
with per-row scale spread; and trained weights: the token embeddings WordLlama
ships in its wheel (``wordllama/weights/l2_supercat_256.safetensors``, 32000 x 256
F16, MIT; the ``bench`` extra installs it; read as a file, the package is not
imported), its first N*K/256 rows in order, K/256 to a row.  Each is MXFP4-ized
(OCP encoder) and decoded, as K3's experts are; errors are against those MXFP4
values.  Importance: none, or a synthetic one (per column
exp(N(0, 1)): the heavy-tailed spread of llama.cpp's mean squared activations).

``--holdout`` swaps in data that no encoder setting was tuned on, to check a choice made on
the default sets: the Gaussian and Student-t sets from seed + 1000, WordLlama's last rows
instead of its first (disjoint while N*K is at most half the matrix), and a wider importance
matrix ("wide": exp(N(0, 1.5)) per column with 1% of the columns 50x, as outlier channels).

Quality: the importance-weighted SNR ``10 log10(sum q x^2 / sum q (x - y)^2)``
(q = 1 without an importance matrix), ours against ggml's on the same data.
ggml is ``ggml_quantize_chunk`` from the libggml that llama-cpp-python builds,
through ctypes: without an importance matrix Q2_K runs ggml's own rule for a
missing one (what llama-quantize does), and the i-quants, which llama-quantize refuses
to write without one, get all ones (ours takes None, which means the same).

Speed: process CPU time of one thread pinned to one core, best of ``--repeat`` rounds,
each round one encode by ours then one by ggml on the Gaussian source (a slow spell of a
shared machine then hits both).  Targets: SNR >= ggml's and
>= 10x its single-thread speed.  Without llama_cpp the ggml rows are left out.
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
from bench_iq2xs import pin_one_core  # noqa: E402  (the same pinning)
from k3ckpt.formats import iq1m as fmt_iq1m  # noqa: E402
from k3ckpt.formats import iq1s as fmt_iq1s  # noqa: E402
from k3ckpt.formats import iq2s as fmt_iq2s  # noqa: E402
from k3ckpt.formats import iq2xs as fmt_iq2xs  # noqa: E402
from k3ckpt.formats import iq2xxs as fmt_iq2xxs  # noqa: E402
from k3ckpt.formats import iq3xxs as fmt_iq3xxs  # noqa: E402
from k3ckpt.formats import mxfp4  # noqa: E402
from k3ckpt.formats import q2_k as fmt_q2k  # noqa: E402
from k3ckpt.requant import iq1m, iq1s, iq2s, iq2xs, iq2xxs, iq3xxs, q2_k  # noqa: E402

TARGET_SPEEDUP = 10.0
TARGET_IQ_GAIN_DB = 0.3        # the IQ types' mean SNR gain over ggml, over every source and setting
# the ggml types llama-quantize refuses to write without an importance matrix (llama.cpp's
# src/llama-quant.cpp, tensor_requires_imatrix): IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS
IMATRIX_REQUIRED = frozenset({19, 29, 16, 17, 22, 18})
FORMATS = {
    # name: (ggml type id, block bytes, our encoder, decoder)
    "q2_k": (10, fmt_q2k.BLOCK_BYTES, q2_k.encode, fmt_q2k.decode_q2k),
    "iq2_xxs": (16, fmt_iq2xxs.BLOCK_BYTES, iq2xxs.encode, fmt_iq2xxs.decode_iq2xxs),
    "iq2_xs": (17, fmt_iq2xs.BLOCK_BYTES, iq2xs.encode, fmt_iq2xs.decode_iq2xs),
    "iq2_s": (22, fmt_iq2s.BLOCK_BYTES, iq2s.encode, fmt_iq2s.decode_iq2s),
    "iq1_m": (29, fmt_iq1m.BLOCK_BYTES, iq1m.encode, fmt_iq1m.decode_iq1m),
    "iq1_s": (19, fmt_iq1s.BLOCK_BYTES, iq1s.encode, fmt_iq1s.decode_iq1s),
    "iq3_xxs": (18, fmt_iq3xxs.BLOCK_BYTES, iq3xxs.encode, fmt_iq3xxs.decode_iq3xxs),
}


def ggml_quantizer():
    """``quantize(ggml_type, x [n, k] float32, imatrix [k] or None) -> bytes [n, ...]`` through
    libggml, or (None, why not).  Without an importance matrix the types llama-quantize refuses
    to quantize without one (``IMATRIX_REQUIRED``) get all ones; Q2_K runs ggml's own rule."""
    try:
        from llama_cpp import _ggml  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"llama_cpp not importable ({type(exc).__name__})"
    lib = _ggml.libggml
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    block = {t: bb for t, bb, *_ in FORMATS.values()}

    def quantize(gtype: int, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        lib.ggml_quantize_init(gtype)       # IQ2 grids; idempotent
        x = np.ascontiguousarray(x, np.float32)
        n, k = x.shape
        out = np.zeros((n, k // 256 * block[gtype]), np.uint8)
        if imatrix is None and gtype in IMATRIX_REQUIRED:
            imatrix = np.ones(k, np.float32)
        q = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
        size = fn(gtype, x.ctypes.data, out.ctypes.data, 0, n, k, None if q is None else q.ctypes.data)
        assert size == out.nbytes, (size, out.nbytes)
        return out

    return quantize, "ggml_quantize_chunk via ctypes (llama-cpp-python's libggml)"


def trained_weights(n: int, k: int, *, tail: bool = False) -> tuple[np.ndarray | None, str]:
    """WordLlama's trained embedding matrix as [n, k] float32 (each row K/256 of its 256-wide rows:
    its first, or with ``tail`` its last), or (None, why not)."""
    import importlib.util

    from safetensors.numpy import load_file

    spec = importlib.util.find_spec("wordllama")
    if spec is None or not spec.submodule_search_locations:
        return None, "wordllama not installed (pip install 'k3ckpt[bench]')"
    path = Path(next(iter(spec.submodule_search_locations))) / "weights" / "l2_supercat_256.safetensors"
    emb = load_file(str(path))["embedding.weight"].astype(np.float32)
    if n * k > emb.size:
        return None, f"[{n}, {k}] needs {n * k:,} weights; WordLlama has {emb.size:,}"
    flat = emb.reshape(-1)
    rows = flat[flat.size - n * k:] if tail else flat[:n * k]
    return rows.reshape(n, k), f"WordLlama {path.name} {tuple(emb.shape)}{', last rows' if tail else ''}"


def weighted_snr(x: np.ndarray, y: np.ndarray, q: np.ndarray | None) -> float:
    x64, e = x.astype(np.float64), (y.astype(np.float64) - x.astype(np.float64))
    w = np.ones(x.shape[-1]) if q is None else q.astype(np.float64)
    return 10 * math.log10(float((w * x64 * x64).sum()) / float((w * e * e).sum()))


def importances(k: int, seed: int, holdout: bool) -> dict[str, np.ndarray | None]:
    """None, and a synthetic per-column importance (``holdout``: the wider one with outliers)."""
    if not holdout:
        rng = np.random.default_rng(seed + 1)
        return {"none": None, "synthetic": np.exp(rng.normal(0.0, 1.0, k)).astype(np.float32)}
    rng = np.random.default_rng(seed + 1001)
    q = np.exp(rng.normal(0.0, 1.5, k))
    q[rng.choice(k, max(1, k // 100), replace=False)] *= 50.0
    return {"none": None, "wide": q.astype(np.float32)}


def run(n: int, k: int, repeat: int, seed: int, formats=tuple(FORMATS), *, holdout: bool = False) -> dict:
    ggml, note = ggml_quantizer()
    importance = importances(k, seed, holdout)
    data = dict(bench_requant.datasets(n, k, seed + 1000 if holdout else seed))
    trained, trained_note = trained_weights(n, k, tail=holdout)
    if trained is not None:
        data["trained"] = trained
    res: dict = {"shape": [n, k], "weights": n * k, "ggml": note, "trained": trained_note, "holdout": holdout,
                 "quality": [], "speed": []}
    sources = {name: mxfp4.decode_pair(*mxfp4.encode_pair(x)) for name, x in data.items()}
    for fname in formats:
        gtype, _, enc, dec = FORMATS[fname]
        for sname, src in sources.items():
            for iname, q in importance.items():
                row = {"format": fname, "source": sname, "imatrix": iname,
                       "ours_db": weighted_snr(src, dec(enc(src, imatrix=q)), q)}
                if ggml is not None:
                    row["ggml_db"] = weighted_snr(src, dec(ggml(gtype, src, q)), q)
                    row["gain_db"] = row["ours_db"] - row["ggml_db"]
                res["quality"].append(row)
        src = sources["gaussian"]
        for iname, q in importance.items():
            fns = [lambda: enc(src, imatrix=q)] + ([lambda: ggml(gtype, src, q)] if ggml is not None else [])
            best = bench_requant.cpu_best_interleaved(fns, repeat)
            row = {"format": fname, "imatrix": iname, "ours_mw_s": src.size / best[0] / 1e6}
            if ggml is not None:
                row["ggml_mw_s"] = src.size / best[1] / 1e6
                row["speedup"] = best[1] / best[0]
            res["speed"].append(row)
    res["targets"] = targets(res)
    return res


def targets(res: dict) -> list[dict]:
    out = []
    for r in res["quality"]:
        if "ggml_db" in r:
            out.append({"target": f"{r['format']} {r['source']} imatrix={r['imatrix']}: SNR >= ggml",
                        "want": f">= {r['ggml_db']:.3f}", "measured": r["ours_db"],
                        "pass": r["ours_db"] >= r["ggml_db"]})
    iq = [r["ours_db"] - r["ggml_db"] for r in res["quality"] if "ggml_db" in r and r["format"].startswith("iq")]
    if iq:
        gain = sum(iq) / len(iq)
        out.append({"target": f"IQ types, {len(iq)} cells: mean SNR gain >= {TARGET_IQ_GAIN_DB:g} dB",
                    "want": f">= {TARGET_IQ_GAIN_DB:g}", "measured": gain, "pass": gain >= TARGET_IQ_GAIN_DB})
    for r in res["speed"]:
        if "speedup" in r:
            out.append({"target": f"{r['format']} imatrix={r['imatrix']}: speed >= {TARGET_SPEEDUP:g}x ggml",
                        "want": f">= {TARGET_SPEEDUP:g}", "measured": r["speedup"],
                        "pass": r["speedup"] >= TARGET_SPEEDUP})
    return out


def render(res: dict, pin_note: str) -> str:
    n, k = res["shape"]
    lines = [f"llama.cpp quant family from MXFP4, [{n}, {k}] = {res['weights'] / 1e6:.2f} M weights; "
             f"{pin_note}; ggml: {res['ggml']}; trained set: {res['trained']}"
             f"{'; held-out data (--holdout)' if res.get('holdout') else ''}",
             "SNR weighted by the importance matrix (1 without); without one ggml's Q2_K runs its own rule "
             "and its i-quants get all ones (llama-quantize refuses them without one)", ""]
    lines.append(f"{'format':<8} {'source':<13} {'imatrix':<10} {'ours dB':>8} {'ggml dB':>8} {'gain dB':>8}")
    for r in res["quality"]:
        g = f"{r['ggml_db']:>8.3f} {r['gain_db']:>+8.3f}" if "ggml_db" in r else f"{'-':>8} {'-':>8}"
        lines.append(f"{r['format']:<8} {r['source']:<13} {r['imatrix']:<10} {r['ours_db']:>8.3f} {g}")
    lines += ["", f"{'format':<8} {'imatrix':<10} {'ours Mw/s':>10} {'ggml Mw/s':>10} {'ratio':>7}   (one core, CPU time)"]
    for r in res["speed"]:
        g = f"{r['ggml_mw_s']:>10.2f} {r['speedup']:>6.1f}x" if "ggml_mw_s" in r else f"{'-':>10} {'-':>7}"
        lines.append(f"{r['format']:<8} {r['imatrix']:<10} {r['ours_mw_s']:>10.2f} {g}")
    lines += ["", f"{'target':<52} {'want':>10} {'measured':>10}  result"]
    for t in res["targets"]:
        lines.append(f"{t['target']:<52} {t['want']:>10} {t['measured']:>10.3f}  {'PASS' if t['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1024x3584", help="N x K, K a multiple of 256")
    ap.add_argument("--repeat", type=int, default=4, help="timed rounds, ours and ggml alternately (best is kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of: " + ", ".join(FORMATS))
    ap.add_argument("--holdout", action="store_true",
                    help="other seeds, WordLlama's last rows, a wider importance matrix with outlier columns")
    args = ap.parse_args(argv)
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    if not formats or set(formats) - set(FORMATS):
        raise SystemExit(f"--formats: choose from {', '.join(FORMATS)}")
    n, k = bench_requant.parse_size(args.size)
    if k % 256:
        raise SystemExit(f"K = {k} is not a multiple of 256: these types are not applicable")
    pin_note = "not pinned" if args.no_pin else pin_one_core()
    res = run(n, k, args.repeat, args.seed, formats, holdout=args.holdout)
    res["pinning"] = pin_note
    print(json.dumps(res, indent=2) if args.json else render(res, pin_note))
    return 0 if all(t["pass"] for t in res["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
