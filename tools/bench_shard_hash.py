"""Writing sharded output with its sha256s: hashed while written vs hashed after each shard.

    python tools/bench_shard_hash.py                 # 8 shards x 256 MB in a temp folder
    python tools/bench_shard_hash.py --shards 16 --mb 512 --dir DIR

Three ways through the same ``ShardedWriter`` writes, in one run:

* ``no hash``: the writes alone (the floor);
* ``hash after``: ``on_shard_final`` hashes each finished shard in the writing
  thread (``sha256_file``), as requant and shard did before;
* ``hash_shards``: each shard hashed while it is written and finished on its
  own thread after the rename (``io/_prefix_hash.py``).

It prints each wall time and the ratio to ``hash after``.  With output
arriving faster than one thread hashes (sha256 runs at a few hundred MB/s
without SHA extensions), ``hash_shards`` hashes several shards at once, so
the gain grows with the cores available.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3ckpt.io import ShardedWriter, TensorSpec  # noqa: E402
from k3ckpt.io.manifest import sha256_file  # noqa: E402

_TENSOR_MB = 64


def run(folder: Path, specs, block: bytes, mode: str, shard_bytes: int) -> tuple[float, dict[str, str]]:
    shutil.rmtree(folder, ignore_errors=True)
    digests: dict[str, str] = {}

    def after(path: Path) -> None:
        digests[path.name] = sha256_file(path)

    kw = {"hash_shards": True, "on_shard_final": lambda p: digests.setdefault(p.name, w.sha256[p.name])} \
        if mode == "hash_shards" else {"on_shard_final": after} if mode == "hash after" else {}
    t0 = time.perf_counter()
    with ShardedWriter(folder, specs, max_shard_bytes=shard_bytes, **kw) as w:
        for s in specs:
            w.write(s.name, block)
    return time.perf_counter() - t0, digests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--mb", type=int, default=256, help="shard size in MB (a multiple of 64)")
    ap.add_argument("--dir", type=Path, help="where to write (default: a temp folder)")
    args = ap.parse_args()
    per_shard = max(1, args.mb // _TENSOR_MB)
    n = args.shards * per_shard
    specs = [TensorSpec(f"t{i:05d}", "U8", (_TENSOR_MB << 20,)) for i in range(n)]
    block = os.urandom(_TENSOR_MB << 20)
    base = Path(tempfile.mkdtemp(prefix="k3ckpt-bench-hash-", dir=args.dir))
    try:
        total = n * len(block)
        print(f"{args.shards} shards x {per_shard * _TENSOR_MB} MB = {total / 1e9:.2f} GB, {os.cpu_count()} CPUs")
        times = {}
        digests = {}
        for mode in ("no hash", "hash after", "hash_shards"):
            times[mode], digests[mode] = run(base / "out", specs, block, mode, per_shard * len(block))
        assert digests["hash after"] == digests["hash_shards"], "the two ways give different digests"
        for mode, t in times.items():
            print(f"  {mode:12s} {t:6.2f} s  {total / t / 1e6:7.0f} MB/s  "
                  f"{times['hash after'] / t:5.2f}x of hash after")
    finally:
        shutil.rmtree(base, ignore_errors=True)

if __name__ == "__main__":
    main()
