#!/usr/bin/env python3
"""Generate synthetic expert loads and routing traces (k3ckpt.placement.synthetic).

    python tools/gen_loads.py --model k3 --tokens 200000 --window 0 --out plan.npy
    python tools/gen_loads.py --model k3 --window 1 --trace-tokens 1024 --trace-out held.npy
    python tools/gen_loads.py --model k2 --keep reap_keep_576.json --out k2.csv

Window 0 is the planning window; windows 1, 2, ... are later held-out windows
with drift.  The same --seed gives the same files.  ``--keep`` takes REAP-style
keep-lists (K3 layer ids) to rank experts hot/cold.  Prints the skew figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from k3ckpt.errors import K3ckptError  # noqa: E402
from k3ckpt.shard import synthetic as syn  # noqa: E402
from k3ckpt.placement.loads import read_keep_tiers, write_loads  # noqa: E402
from k3ckpt.placement.spec import MoEGeometry  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("k3", "k2"), default="k3")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--window", type=int, default=0, help="0 = planning window, >= 1 = held-out windows")
    ap.add_argument("--tokens", type=int, default=200_000, help="tokens behind the loads")
    ap.add_argument("--out", type=Path, help="loads file (.npy, .json or .csv)")
    ap.add_argument("--trace-tokens", type=int, default=0, help="tokens of routing trace to write")
    ap.add_argument("--trace-out", type=Path, help="trace file (.npy, [tokens, layers, top_k])")
    ap.add_argument("--keep", type=Path, nargs="*", default=[], help="REAP keep-list JSON files")
    ap.add_argument("--drift", type=float, default=0.1, help="lognormal drift sigma of held-out windows")
    ap.add_argument("--persistence", type=float, default=0.6, help="trace: chance a slot keeps its expert")
    args = ap.parse_args(argv)
    try:
        geo = MoEGeometry.k3() if args.model == "k3" else MoEGeometry.k2()
        model = syn.SkewModel(drift_sigma=args.drift, persistence=args.persistence)
        tiers = read_keep_tiers(args.keep, geo) if args.keep else None
        pop = syn.make_popularity(geo.moe_layers, geo.experts, geo.top_k, args.seed, model, tiers=tiers)
        if args.out:
            loads = syn.window_loads(pop, args.tokens, args.seed, args.window, model)
            write_loads(args.out, loads)
            stats = syn.skew_stats(loads)
            print(f"{args.out}: {loads.shape[0]} x {loads.shape[1]} loads, {args.tokens} tokens")
            print("  " + ", ".join(f"{k} {v:.3g}" for k, v in stats.items()))
        if args.trace_tokens:
            if not args.trace_out:
                ap.error("--trace-tokens needs --trace-out")
            trace = syn.sample_trace(pop, args.trace_tokens, args.seed, args.window, model)
            np.save(args.trace_out, trace)
            print(f"{args.trace_out}: trace {list(trace.shape)}")
        if not args.out and not args.trace_tokens:
            ap.error("nothing to write: give --out and/or --trace-tokens with --trace-out")
    except K3ckptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
