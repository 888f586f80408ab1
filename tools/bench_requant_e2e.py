"""End-to-end `k3ckpt requant` against the disk, on two k3 fixture sizes.

    python tools/bench_requant_e2e.py                   # k3 fixtures past 1 GiB and 4 GiB, --workers 2
    python tools/bench_requant_e2e.py --experts 8 32    # smaller, for a quick look
    python tools/bench_requant_e2e.py --keep DIR        # build (or reuse) the fixtures under DIR

For each fixture it runs, in one go:

* the disk baseline: the source read with O_DIRECT (no page cache) and a file
  of the output's size written and fsynced in the output's folder -- the time
  a conversion that did nothing but stream the bytes would take;
* ``k3ckpt requant SRC DST --format F --workers W`` as a child process, with the
  source dropped from the page cache first (it reads from the disk), its wall
  time, and the peak memory of the whole process tree (the child, the pool's
  fork server and its workers, sampled from /proc every 50 ms, PSS every 0.5 s): summed PSS,
  which counts the pages the workers share with the fork server once, beside
  the summed RSS, which counts them in every process, and the child's own peak RSS.

It prints the ratio wall / disk baseline (the issue's bar: within 1.5x) and
the peak tree PSS at the large size over the small one (within 10%).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rss import ensure_fixture, flat_verdict, folder_bytes  # noqa: E402

_BLOCK = 16 << 20


def read_direct(folder: Path) -> tuple[float, int]:
    """(seconds, bytes) to read every file of ``folder`` with O_DIRECT."""
    buf = mmap.mmap(-1, _BLOCK)   # page aligned, as O_DIRECT needs
    total = 0
    t0 = time.perf_counter()
    for p in sorted(folder.iterdir()):
        if not p.is_file():
            continue
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            while True:
                n = os.readv(fd, [buf])
                total += n
                if n < _BLOCK:
                    break
        finally:
            os.close(fd)
    return time.perf_counter() - t0, total


def evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (clean pages go under POSIX_FADV_DONTNEED), so
    the run reads its source from the disk as a real checkpoint's would be read."""
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def write_synced(folder: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file in ``folder`` and fsync it."""
    block = os.urandom(1 << 20) * 16
    path = folder / ".k3ckpt-bench-write"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    secs = time.perf_counter() - t0
    path.unlink()
    return secs


def _pss(pid: int) -> int:
    """Proportional set size (bytes): pages shared with other processes count by share."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_memory(root: int, pss: bool) -> tuple[int, int]:
    """(summed RSS, summed PSS or 0) in bytes of ``root`` and its descendants, from /proc.

    Pool workers forked from a fork server share its pages (numba, the loaded kernels), which
    the RSS sum counts once per process; the PSS sum counts them once in all.  PSS costs
    about 1 ms a process to read (the kernel walks the page tables), so it is asked for less
    often than RSS, not to take CPU from the run being measured."""
    parent: dict[int, int] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parent[int(d)] = int(fields[1])
            rss[int(d)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    keep, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in keep]
        keep.update(kids)
        frontier.extend(kids)
    return sum(rss.get(p, 0) for p in keep), sum(_pss(p) for p in keep) if pss else 0


def run_sampled(argv: list[str]) -> tuple[float, int, int, int]:
    """(seconds, peak tree RSS, peak tree PSS, peak own RSS) of a child command."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = [0, 0]
    done = threading.Event()

    def sample():
        n = 0
        while not done.is_set():
            rss, pss = _tree_memory(proc.pid, pss=n % 10 == 0)   # RSS every 50 ms, PSS every 0.5 s
            n += 1
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            done.wait(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    th.join()
    err = proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"child failed: {' '.join(argv)}\n{err}")
    return time.perf_counter() - t0, peak[0], peak[1], usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, nargs=2, default=(30, 122), metavar=("SMALL", "LARGE"))
    ap.add_argument("--keep", type=Path, help="build or reuse fixtures under this folder (default: a temp dir)")
    ap.add_argument("--format", default="moet-w2", help="requant format (default moet-w2, i.e. refit)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    root = args.keep or Path(tempfile.mkdtemp(prefix="k3ckpt-e2e-"))
    root.mkdir(parents=True, exist_ok=True)
    peaks = []
    times = []
    try:
        for experts in args.experts:
            src = ensure_fixture(root, experts)
            dst = root / f"out-e{experts}"
            shutil.rmtree(dst, ignore_errors=True)
            evict(src)
            wall, tree, tree_pss, own = run_sampled([sys.executable, "-m", "k3ckpt", "requant", str(src), str(dst),
                                           "--format", args.format, "--workers", str(args.workers), "-q"])
            out_bytes = folder_bytes(dst)
            shutil.rmtree(dst)
            read_s, src_bytes = read_direct(src)
            write_s = write_synced(root, out_bytes)
            disk = read_s + write_s
            peaks.append(tree_pss)
            times.append((src_bytes, wall / disk))
            print(f"{src.name}: source {src_bytes / 1e9:.2f} GB read in {read_s:.1f} s "
                  f"({src_bytes / read_s / 1e6:.0f} MB/s, O_DIRECT); output {out_bytes / 1e9:.2f} GB written+fsynced "
                  f"in {write_s:.1f} s ({out_bytes / write_s / 1e6:.0f} MB/s)")
            print(f"  requant --format {args.format} --workers {args.workers}: {wall:.1f} s wall = "
                  f"{wall / disk:.2f}x the disk baseline ({disk:.1f} s); "
                  f"{src_bytes / wall / 1e6:.0f} MB/s of source; peak tree PSS {tree_pss / 2**20:.0f} MiB "
                  f"(RSS summed {tree / 2**20:.0f} MiB), "
                  f"main process {own / 2**20:.0f} MiB", flush=True)
        ratio = peaks[1] / peaks[0]
        print(f"peak PSS (tree) large/small = {ratio:.3f} -> {flat_verdict(ratio)}")
        size, speed = times[1]
        print(f"large fixture {size / 1e9:.2f} GB ({size / 2**30:.2f} GiB; the bar: >= 4 GB): wall "
              f"{speed:.2f}x the disk baseline -> {'within' if speed <= 1.5 else 'NOT within'} 1.5x")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
