"""Hub figures on the loopback emulator: download-and-convert peak disk vs --max-disk, and remote inspect.

    python tools/bench_hub.py convert                 # k3 fixture (experts=4, ~170 MB, 6 shards), tight budget
    python tools/bench_hub.py convert --experts 8 --budget 400MB --workers 2
    python tools/bench_hub.py inspect                 # the full-size virtual K3 (96 sparse shards, 1.56 TB)
    python tools/bench_hub.py ... --keep DIR          # build (or reuse) the fixtures under DIR

``convert`` serves a multi-shard k3 fixture from the emulator and runs
``requant_from_hub`` (moet-w2) with ``--max-disk``; a sampler thread reads the
allocated bytes of the output folder (staging included) every 10 ms, so the
printed peak is what the disk really held, not k3ckpt's own accounting.  The
default budget is the tightest the preflight accepts (output estimate + the
largest source shard), which makes staging release each shard before the
next one arrives.  ``inspect`` opens the virtual K3 remotely and prints the
bytes fetched and the wall time (header range reads only).

Everything runs on 127.0.0.1; no other host is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

for k, v in {"HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
    os.environ[k] = v
for k in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
    os.environ.pop(k, None)


class Sampler:
    """Peak allocated bytes under ``path`` (sampled)."""

    def __init__(self, path: Path, every: float = 0.01):
        from k3ckpt.hub.staged import allocated_bytes

        self._bytes = allocated_bytes
        self.path, self.every, self.peak = path, every, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._bytes(self.path))
            time.sleep(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._bytes(self.path))


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def convert(args, work: Path) -> None:
    from hubemu.server import HubEmulator

    from k3ckpt.fixtures import make_fixture
    from k3ckpt.hub import HubClient
    from k3ckpt.hub.convert import requant_from_hub
    from k3ckpt.placement.devices import parse_bytes

    src = work / f"k3-e{args.experts}"
    if not (src / "model.safetensors.index.json").is_file():
        make_fixture("k3", src, experts=args.experts)
    shards = sorted(src.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    largest = max(p.stat().st_size for p in shards)
    with HubEmulator() as emu:
        emu.add_repo("moonshotai/Kimi-K3-bench", src)
        client = HubClient(emu.endpoint, token=False)
        dst = work / "out"
        shutil.rmtree(dst, ignore_errors=True)
        budget = None if args.budget in (None, "tight") else parse_bytes(args.budget, "--budget")
        if budget is None:  # the tightest the preflight accepts: output estimate + largest shard
            from k3ckpt.hub.staged import open_staged
            from k3ckpt.requant.plan import plan_requant

            with open_staged("hf://moonshotai/Kimi-K3-bench", dst, client=client) as ck:
                budget = ck.staging.preflight(plan_requant(ck).total_bytes).need
        emu.reset_log()
        t = time.perf_counter()
        with Sampler(dst) as s:
            run = requant_from_hub("hf://moonshotai/Kimi-K3-bench", dst, client=client, max_disk=budget,
                                   workers=args.workers, progress=False)
        wall = time.perf_counter() - t
        served = emu.bytes_served
    out_bytes = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    st = run.stage
    print(f"source: {len(shards)} shards, {_mb(total)} (largest {_mb(largest)}); output {_mb(out_bytes)}")
    print(f"--max-disk {budget:,} B ({_mb(budget)}); preflight need {run.preflight.need:,} B")
    print(f"peak disk (sampled every 10 ms): {s.peak:,} B ({_mb(s.peak)}) = {s.peak / budget:.1%} of the budget; "
          f"k3ckpt's bound {st.peak_disk:,} B")
    print(f"fetched {st.bytes_downloaded:,} B of shards ({st.downloads} downloads, {st.refetches} repeated); "
          f"served incl. headers and API {served:,} B; wall {wall:.1f} s (workers {args.workers})")
    if s.peak > budget:
        print("OVER BUDGET")
        sys.exit(1)


def inspect(args, work: Path) -> None:
    from hubemu.server import HubEmulator

    from k3ckpt.fixtures import make_virtual_k3
    from k3ckpt.hub import open_hub_checkpoint
    from k3ckpt.inspection import inspect_checkpoint

    src = work / "k3-virtual"
    if not (src / "model.safetensors.index.json").is_file():
        make_virtual_k3(src)
    repo_bytes = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    with HubEmulator() as emu:
        emu.add_repo("moonshotai/Kimi-K3", src)
        t = time.perf_counter()
        ck = open_hub_checkpoint("hf://moonshotai/Kimi-K3", endpoint=emu.endpoint, token=False)
        t_open = time.perf_counter() - t
        inspect_checkpoint(ck, source="hf://moonshotai/Kimi-K3")
        t_all = time.perf_counter() - t
        ck.close()
        fetched = ck.hub.bytes_fetched
        print(f"virtual K3: {len(ck.shards)} shards, {repo_bytes:,} B; fetched {fetched:,} B "
              f"({fetched / repo_bytes:.4%}) in {ck.hub.stats.range_requests} range requests; "
              f"open {t_open:.1f} s, open + inspect {t_all:.1f} s; served incl. API {emu.bytes_served:,} B")
        # The command itself, as a user runs it: a fresh process and an empty HF_HOME.
        home = Path(tempfile.mkdtemp(prefix="bench-hub-cli-home-"))
        env = {**os.environ, "HF_ENDPOINT": emu.endpoint, "HF_HOME": str(home), "PYTHONPATH": str(ROOT)}
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "k3ckpt", "inspect", "hf://moonshotai/Kimi-K3", "--json"],
                             env=env, capture_output=True, text=True, check=True).stdout
        t_cli = time.perf_counter() - t
        shutil.rmtree(home, ignore_errors=True)
        report = json.loads(out)
        print(f"`k3ckpt inspect hf://moonshotai/Kimi-K3 --json` (fresh process, empty HF_HOME): {t_cli:.1f} s wall; "
              f"fetched {report['extra']['hub']['bytes_fetched']:,} B; routed expert bytes "
              f"{report['routed_expert_bytes']:,}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["convert", "inspect"])
    ap.add_argument("--experts", type=int, default=4, help="convert: experts per layer of the k3 fixture")
    ap.add_argument("--budget", default="tight", help="convert: --max-disk (default: the tightest accepted)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--keep", default=None, metavar="DIR", help="build (or reuse) fixtures here")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-hub-home-"))
    os.environ["HF_HOME"] = str(home)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-hub-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        (convert if args.what == "convert" else inspect)(args, work)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
