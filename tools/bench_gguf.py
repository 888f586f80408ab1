"""K3 MXFP4 -> GGUF with IQ2_XS experts: k3ckpt's one pass beside the disk and llama.cpp's own route.

    python tools/bench_gguf.py                          # k3 fixture of 122 experts (4.31 GB), ggml sampled
    python tools/bench_gguf.py --experts 8              # small, for a quick look
    python tools/bench_gguf.py --fixture DIR            # reuse a k3 fixture (k3ckpt fixture k3 DIR ...)
    python tools/bench_gguf.py --ggml-sample all        # ggml quantizes every expert (about an hour at 4 GB)
    python tools/bench_gguf.py --json                   # the figures as JSON instead of the table

In one run, on a K3-shaped fixture at the real expert shapes (``k3ckpt fixture k3``):

(a) the disk baseline: every source shard read with O_DIRECT, then a file of our
    output's size written and fsynced on the same filesystem;
(b) ours: ``k3ckpt gguf SRC OUT.gguf --expert-type iq2_xs --workers W`` in a fresh process,
    the source dropped from the page cache first;
(c) llama.cpp's route: (c1) its converter ``convert_hf_to_gguf.py`` (vendored in the
    llama-cpp-python sdist, named by K3CKPT_LLAMA_CPP_SRC; its vocabulary built from
    tiktoken.model, as the tests do, since its Kimi path needs remote code) writes an MXFP4
    GGUF, a lossless repack; (c2) what ``llama-quantize`` then does to the experts: each
    expert decoded by ggml's own MXFP4 decoder and quantized to IQ2_XS by
    ``ggml_quantize_chunk`` from libggml (the one llama-cpp-python built, through ctypes),
    with an all-ones importance matrix (ggml refuses IQ2_XS without one), each expert's rows
    split between W threads as llama-quantize splits them, written with the ``gguf`` package's
    GGUFWriter, every other tensor copied.

Every step runs as a child process, timed, with its process tree sampled from /proc every
0.2 s: peak memory (summed RSS, and PSS, which counts pages shared by the pool's workers
once), CPU seconds (user + system over every process; on 2 shared cores a steadier figure
than wall time), the allocated bytes of its output folder (hidden partial files
included): the peak disk, and the mean load average over the step (above 2 on 2 cores,
other work shared them).  The converter and the quantizer fsync what they write, as we and the
baseline do.

ggml's IQ2_XS runs at about 1.15 M weights/s a thread, about an hour for a 4 GB fixture,
so by default (c2) quantizes ``--ggml-sample K`` evenly spaced experts of each expert
tensor, measures its rate, and extrapolates its time to every expert: the pass still
reads the MXFP4 GGUF and writes the whole file (the other experts as zero bytes), and
the unquantized experts' weights are added at the measured rate.  The table marks the
figure as extrapolated.  ``--ggml-sample all`` quantizes them all.

SNR (dB, pooled: summed signal energy over summed error energy) of both IQ2_XS files
against the source's MXFP4 values (decoded from the checkpoint by k3ckpt) on the same
experts (the sampled ones; with ``all``, 4 evenly spaced per tensor), both files decoded
by the ``gguf`` package's ``gguf.quants.dequantize``.  The run also checks that the
converter's MXFP4 experts decode to the source values exactly and that both IQ2_XS
files hold the same tensors, types and shapes.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from bench_requant_e2e import _pss, evict, read_direct, write_synced  # noqa: E402
from bench_rss import ensure_fixture, folder_bytes  # noqa: E402

SRC_ENV = "K3CKPT_LLAMA_CPP_SRC"
TICK_S = 0.2
PSS_EVERY = 5           # PSS walks the page tables (~1 ms a process): every 5th tick
SNR_EXPERTS_ALL = 4     # experts per tensor the SNR covers when ggml quantized them all
EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
SOURCE_W = {"gate": "w1", "up": "w3", "down": "w2"}     # K3's expert projections (conversion/kimi_k3.py)

# llama.cpp's converter, unmodified but for its vocabulary: its Kimi path loads the tokenizer with
# trust_remote_code, which k3ckpt never runs, so set_vocab is one built from tiktoken.model by
# k3ckpt's reader (the tokens and merges the tests hold to the converter's); then the file is fsynced.
CONVERT_CHILD = """
import importlib, os, sys
from pathlib import Path
llama = Path(sys.argv[1])
sys.path[:0] = [str(llama), str(llama / "gguf-py")]
import gguf
import convert_hf_to_gguf
from k3ckpt.gguf.vocab import kimi_vocab

def set_vocab(self):
    v = kimi_vocab(self.dir_model, self.hparams["vocab_size"])
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(list(v.tokens))
    w.add_token_types(list(v.token_types))
    if v.merges:
        w.add_token_merges(list(v.merges))
    gguf.SpecialVocab(self.dir_model, load_merges=False).add_to_gguf(w)
    if (eos := self.hparams.get("eos_token_id")) is not None:
        w.add_eos_token_id(eos)

importlib.import_module("conversion.kimi_k3").KimiK3Model.set_vocab = set_vocab
out = sys.argv[3]
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", out, "--outtype", "bf16"]
convert_hf_to_gguf.main()
fd = os.open(out, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
"""


@dataclass(frozen=True)
class Step:
    """One measured child process: wall and CPU seconds, peak memory of its tree, peak disk of its folder."""

    label: str
    wall_s: float
    cpu_s: float        # user + system seconds summed over the tree's processes
    tree_rss: int
    tree_pss: int
    own_rss: int
    peak_disk: int
    load: float         # mean 1-minute load average over the step (2 cores: above 2, others shared them)
    extrapolated: bool = False


def allocated(dirs) -> int:
    """Bytes the filesystem holds for every file under ``dirs`` (st_blocks: sparse holes are free)."""
    total = 0
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_blocks * 512
                except OSError:
                    pass    # a partial file renamed or removed between listing and stat
    return total


def tree(root: int) -> dict[int, tuple[int, float]]:
    """``{pid: (RSS bytes, own user + system CPU seconds)}`` of ``root`` and its descendants, from /proc.

    CPU comes from here, not from rusage: the pool's workers are forked by multiprocessing's fork
    server, which is never reaped by the child we wait for, so their seconds never reach its rusage."""
    page, tick = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
    parent, stat = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()     # proc(5): state is field 3, ppid 4, ...
            parent[int(d)] = int(fields[1])
            stat[int(d)] = (int(fields[21]) * page, (int(fields[11]) + int(fields[12])) / tick)   # rss; utime+stime
        except (OSError, IndexError, ValueError):
            continue
    keep, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in keep]
        keep.update(kids)
        frontier.extend(kids)
    return {p: stat[p] for p in keep if p in stat}


def measured(label: str, argv: list[str], disk_dirs, *, stdout=subprocess.DEVNULL) -> Step:
    """Run ``argv`` as a child; sample its tree's memory and CPU and ``disk_dirs``' bytes every TICK_S.
    A process's CPU seconds are its last sample's (up to one tick short for each one that exits)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, cwd=REPO)
    peak = [0, 0, 0]
    cpu: dict[int, float] = {}
    loads: list[float] = []
    done = threading.Event()
    err: list[bytes] = []

    def sample():
        n = 0
        while not done.is_set():
            now = tree(proc.pid)
            pss = sum(_pss(p) for p in now) if n % PSS_EVERY == 0 else 0
            n += 1
            cpu.update((p, c) for p, (_, c) in now.items())
            loads.append(os.getloadavg()[0])
            rss = sum(r for r, _ in now.values())
            peak[:] = max(peak[0], rss), max(peak[1], pss), max(peak[2], allocated(disk_dirs))
            done.wait(TICK_S)

    th = threading.Thread(target=sample, daemon=True)
    drain = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)   # never a full pipe
    th.start()
    drain.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    th.join()
    drain.join()
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{label} failed: {' '.join(argv)}\n{b''.join(err).decode()[-4000:]}")
    peak[2] = max(peak[2], allocated(disk_dirs))
    return Step(label, wall, sum(cpu.values()), peak[0], peak[1], usage.ru_maxrss * 1024, peak[2],
                sum(loads) / max(1, len(loads)))


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- ggml's route, in its own process

def _libggml():
    """libggml-base of the installed llama-cpp-python, found without importing it (libllama's pages
    would count in the quantizer's memory)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        sys.exit("llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36 builds libggml)")
    lib = ctypes.CDLL(str(Path(spec.origin).parent / "lib" / "libggml-base.so"))

    class Traits(ctypes.Structure):     # ggml/include/ggml.h: struct ggml_type_traits
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                    ("from_float_ref", ctypes.c_void_p)]

    lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    return lib, Traits


def sample_experts(n: int, k: int | None) -> list[int]:
    """``k`` evenly spaced experts of ``n`` (first and last included); all of them for ``None``."""
    if k is None or k >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(1, k - 1)) for i in range(k)}) if k > 1 else [0]


def ggml_child(src: str, dst: str, sample: str, threads: int, result: str) -> None:
    """(c2): ``src``'s MXFP4 experts requantized to IQ2_XS by libggml, as llama-quantize does it
    (decode to float32 with the type's to_float, ``ggml_quantize_chunk`` over an expert's rows with
    its imatrix slice), written to ``dst`` with every other tensor copied."""
    import gguf
    import numpy as np

    lib, _ = _libggml()
    iq2, mxfp4 = gguf.GGMLQuantizationType.IQ2_XS, gguf.GGMLQuantizationType.MXFP4
    assert lib.ggml_quantize_requires_imatrix(int(iq2))     # why the imatrix of ones
    lib.ggml_quantize_init(int(iq2))                        # its grids, outside the timed part
    to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        lib.ggml_get_type_traits(int(mxfp4)).contents.to_float)
    k = None if sample == "all" else int(sample)
    t_start = time.perf_counter()
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = Path(dst).with_name(f".{Path(dst).name}.partial")
    w = gguf.GGUFWriter(tmp, arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        main = f.types[0]
        val = int(gguf.LlamaFileType.MOSTLY_IQ2_XS) if name == "general.file_type" else f.contents()
        w.add_key_value(name, val, main, sub_type=f.types[-1] if main == gguf.GGUFValueType.ARRAY else None)
    plan = []
    for t in reader.tensors:
        data = t.data
        if EXPERTS_RE.match(t.name) and t.tensor_type == mxfp4:
            n_exp, rows, kdim = int(t.shape[2]), int(t.shape[1]), int(t.shape[0])
            bshape = (n_exp, rows, kdim // gguf.GGML_QUANT_SIZES[iq2][0] * gguf.GGML_QUANT_SIZES[iq2][1])
            w.add_tensor_info(t.name, bshape, np.uint8, int(np.prod(bshape)), raw_dtype=iq2)
            plan.append((t, bshape))
        else:
            w.add_tensor_info(t.name, data.shape, data.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
            plan.append((t, None))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    quant_s, quant_cpu_s, done_w, all_w, sampled = 0.0, 0.0, 0, 0, {}
    for t, bshape in plan:
        if bshape is None:
            w.write_tensor_data(np.asarray(t.data))
            continue
        n_exp, rows, rb = bshape
        kdim = int(t.shape[0])
        src_bytes = np.asarray(t.data)                  # [E, rows, MXFP4 row bytes], memory-mapped
        out = np.zeros(bshape, np.uint8)
        ones = np.ones(kdim, np.float32)

        def part(job: tuple[int, int, int]) -> float:
            """Rows r0:r1 of expert e: decoded by ggml's MXFP4 to_float, quantized with the imatrix slice."""
            e, r0, r1 = job
            c0 = time.thread_time()
            x = np.empty((r1 - r0) * kdim, np.float32)
            s = np.ascontiguousarray(src_bytes[e, r0:r1])
            to_float(s.ctypes.data, x.ctypes.data, x.size)
            got = lib.ggml_quantize_chunk(int(iq2), x.ctypes.data, out[e, r0:r1].ctypes.data, 0, r1 - r0, kdim,
                                          ones.ctypes.data)
            assert got == (r1 - r0) * rb, (t.name, e, got)
            return time.thread_time() - c0

        # as llama_tensor_quantize_impl does: an expert's rows split between the threads
        chosen = sample_experts(n_exp, k)
        cuts = [rows * i // threads for i in range(threads + 1)]
        jobs = [(e, cuts[i], cuts[i + 1]) for e in chosen for i in range(threads)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:       # ctypes drops the GIL for the call
            quant_cpu_s += sum(pool.map(part, jobs))
        quant_s += time.perf_counter() - t0
        done_w += len(chosen) * rows * kdim
        all_w += n_exp * rows * kdim
        sampled[t.name] = chosen
        w.write_tensor_data(out)
    for fout in w.fout:
        fout.flush()
        os.fsync(fout.fileno())
    w.close()
    os.replace(tmp, dst)
    Path(result).write_text(json.dumps({"quant_s": quant_s, "quant_cpu_s": quant_cpu_s, "quantized_weights": done_w,
                                        "expert_weights": all_w, "sampled": sampled,
                                        "wall_s": time.perf_counter() - t_start}))


# ---------------------------------------------------------------- SNR of both files on the same experts

def snr_both(fixture: Path, ours: Path, converted: Path, theirs: Path, experts: dict[str, list[int]]) -> dict:
    """Pooled SNR of our and ggml's IQ2_XS experts against the source's MXFP4 values; the converter's
    MXFP4 experts checked to decode to those values exactly."""
    import gguf
    import numpy as np

    from k3ckpt.formats.mxfp4 import decode_pair
    from k3ckpt.io.reader import open_checkpoint
    from k3ckpt.requant.metrics import error_stats, pooled_snr_db

    tensors = {p: {t.name: t for t in gguf.GGUFReader(p).tensors} for p in (ours, converted, theirs)}
    layout = {p: {n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in ts.items()} for p, ts in tensors.items()}
    stats = {"ours": [], "ggml": []}
    lossless, n_experts, n_weights = True, 0, 0
    with open_checkpoint(fixture) as ckpt:
        prefix = next(n for n in ckpt.tensors if ".block_sparse_moe.experts." in n).split(".layers.")[0]
        for name, chosen in experts.items():
            layer, proj = EXPERTS_RE.match(name).groups()
            for e in chosen:
                base = f"{prefix}.layers.{layer}.block_sparse_moe.experts.{e}.{SOURCE_W[proj]}"
                ref = decode_pair(ckpt.read_raw(base + ".weight_packed"), ckpt.read_raw(base + ".weight_scale"),
                                  name=base)
                conv = tensors[converted][name]
                mx = gguf.quants.dequantize(np.asarray(conv.data[e]), conv.tensor_type).reshape(ref.shape)
                lossless &= bool(np.array_equal(mx, ref))
                for who, path in (("ours", ours), ("ggml", theirs)):
                    t = tensors[path][name]
                    assert t.tensor_type == gguf.GGMLQuantizationType.IQ2_XS, (path, name)
                    x = gguf.quants.dequantize(np.asarray(t.data[e]), t.tensor_type).reshape(ref.shape)
                    stats[who].append(error_stats(ref, x))
                n_experts += 1
                n_weights += ref.size
    return {"ours_db": pooled_snr_db(stats["ours"]), "ggml_db": pooled_snr_db(stats["ggml"]),
            "experts": n_experts, "weights": n_weights, "converter_mxfp4_lossless": lossless,
            "same_layout": layout[ours] == layout[theirs]}


# ---------------------------------------------------------------- the run

def gguf_argv(fixture: Path, out: Path, workers: int) -> list[str]:
    """``k3ckpt gguf ... --workers W``; where this checkout's CLI has no --workers yet, the same call
    through ``api.gguf`` (the CLI's default is the CPU count)."""
    helptext = subprocess.run([sys.executable, "-m", "k3ckpt", "gguf", "--help"], capture_output=True, text=True,
                              cwd=REPO).stdout
    if "--workers" in helptext:
        return [sys.executable, "-m", "k3ckpt", "gguf", str(fixture), str(out), "--expert-type", "iq2_xs",
                "--workers", str(workers), "-q"]
    log("note: this k3ckpt gguf has no --workers; calling api.gguf(workers=...) in the child instead")
    return [sys.executable, "-c", "import sys; from k3ckpt import api; api.gguf(sys.argv[1], sys.argv[2], "
            "expert_type='iq2_xs', workers=int(sys.argv[3]))", str(fixture), str(out), str(workers)]


def largest_shards(fixture: Path, n: int = 2) -> int:
    return sum(sorted((p.stat().st_size for p in fixture.glob("*.safetensors")), reverse=True)[:n])


def run(args, root: Path) -> dict:
    llama = Path(os.environ.get(SRC_ENV, ""))
    if not (llama / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"{SRC_ENV} must name llama.cpp's tree (the llama-cpp-python sdist's vendor/llama.cpp)")
    load0 = os.getloadavg()
    fixture = args.fixture or ensure_fixture(root, args.experts)
    src_bytes = folder_bytes(fixture)
    log(f"fixture {fixture.name}: {src_bytes / 1e9:.2f} GB; load average {load0[0]:.2f}")

    ours_dir, llama_dir = root / "ours", root / "llama"
    for d in (ours_dir, llama_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    ours = ours_dir / "k3-iq2_xs.gguf"
    converted, theirs = llama_dir / "k3-mxfp4.gguf", llama_dir / "k3-iq2_xs.gguf"

    os.sync()
    evict(fixture)
    log(f"(b) k3ckpt gguf --expert-type iq2_xs --workers {args.workers} ...")
    b = measured("(b) k3ckpt gguf", gguf_argv(fixture, ours, args.workers), [ours_dir])
    out_bytes = ours.stat().st_size

    log("(a) disk baseline ...")
    read_s, read_bytes = read_direct(fixture)
    write_s = write_synced(ours_dir, out_bytes)
    a = Step("(a) disk baseline", read_s + write_s, 0.0, 0, 0, 0, out_bytes, os.getloadavg()[0])

    evict(fixture)
    log("(c1) llama.cpp convert_hf_to_gguf.py -> MXFP4 GGUF ...")
    c1 = measured("(c1) convert_hf_to_gguf", [sys.executable, "-c", CONVERT_CHILD, str(llama), str(fixture),
                                               str(converted)], [llama_dir])
    os.sync()
    evict(llama_dir)
    log(f"(c2) ggml_quantize_chunk IQ2_XS, {args.threads} threads, sample {args.ggml_sample} ...")
    result = root / "ggml.json"
    c2 = measured("(c2) ggml IQ2_XS", [sys.executable, str(Path(__file__).resolve()), "--ggml-child", str(converted),
                                        str(theirs), args.ggml_sample, str(args.threads), str(result)], [llama_dir])
    g = json.loads(result.read_text())
    rate, cpu_rate = g["quantized_weights"] / g["quant_s"], g["quantized_weights"] / g["quant_cpu_s"]
    rest = g["expert_weights"] - g["quantized_weights"]
    extrapolated = rest > 0
    if extrapolated:
        c2 = replace(c2, wall_s=c2.wall_s + rest / rate, cpu_s=c2.cpu_s + rest / cpu_rate, extrapolated=True)
    c = Step("(c) llama.cpp route", c1.wall_s + c2.wall_s, c1.cpu_s + c2.cpu_s, max(c1.tree_rss, c2.tree_rss),
             max(c1.tree_pss, c2.tree_pss), max(c1.own_rss, c2.own_rss), max(c1.peak_disk, c2.peak_disk),
             (c1.load * c1.wall_s + c2.load * c2.wall_s) / (c1.wall_s + c2.wall_s), extrapolated)

    snr_experts = g["sampled"] if extrapolated else {
        n: sample_experts(len(v), SNR_EXPERTS_ALL) for n, v in g["sampled"].items()}
    log(f"SNR on {sum(map(len, snr_experts.values()))} experts ...")
    snr = snr_both(fixture, ours, converted, theirs, snr_experts)
    budget = out_bytes + largest_shards(fixture)
    return {
        "fixture": {"name": fixture.name, "bytes": src_bytes, "shards": len(list(fixture.glob("*.safetensors")))},
        "load_average": {"start": load0[0], "end": os.getloadavg()[0]},
        "workers": args.workers, "ggml_threads": args.threads, "ggml_sample": args.ggml_sample,
        "output_bytes": out_bytes, "converted_bytes": converted.stat().st_size,
        "ggml_output_bytes": theirs.stat().st_size,
        "disk": {"read_s": read_s, "read_bytes": read_bytes, "write_s": write_s},
        "ggml": {"rate_weights_per_s": rate, "cpu_rate_weights_per_s": cpu_rate,
                 "quantized_weights": g["quantized_weights"],
                 "expert_weights": g["expert_weights"], "measured_quant_s": g["quant_s"],
                 "measured_wall_s": g["wall_s"], "extrapolated": extrapolated},
        "steps": [asdict(s) for s in (a, b, c1, c2, c)],
        "snr": snr,
        "ratios": {"ours_over_disk": b.wall_s / a.wall_s, "llama_over_ours": c.wall_s / b.wall_s,
                   "llama_over_ours_cpu": c.cpu_s / b.cpu_s,
                   "disk_budget_bytes": budget, "ours_disk_over_budget": b.peak_disk / budget,
                   "snr_ours_minus_ggml_db": snr["ours_db"] - snr["ggml_db"]},
    }


def render(r: dict) -> None:
    mib, gb = 2 ** 20, 1e9
    fx, snr, d, g, q = r["fixture"], r["snr"], r["disk"], r["ggml"], r["ratios"]
    load = r["load_average"]
    print(f"fixture {fx['name']}: {fx['bytes'] / gb:.2f} GB in {fx['shards']} shards; our output "
          f"{r['output_bytes'] / gb:.2f} GB; load average {load['start']:.2f} at start, {load['end']:.2f} at end")
    print(f"{'':24s} {'wall s':>9s} {'CPU s':>9s} {'tree RSS MiB':>13s} {'tree PSS MiB':>13s} "
          f"{'peak disk GB':>13s} {'SNR dB':>7s} {'load':>5s}")
    snr_of = {"(b) k3ckpt gguf": snr["ours_db"], "(c2) ggml IQ2_XS": snr["ggml_db"],
              "(c) llama.cpp route": snr["ggml_db"]}
    for s in r["steps"]:
        star = "*" if s["extrapolated"] else " "
        wall = f"{s['wall_s']:8.1f}{star}"
        cpu = f"{s['cpu_s']:8.1f}{star}" if s["cpu_s"] else "-"
        rss, pss = (f"{s[k] / mib:.0f}" if s[k] else "-" for k in ("tree_rss", "tree_pss"))
        v = snr_of.get(s["label"])
        print(f"{s['label']:24s} {wall:>9s} {cpu:>9s} {rss:>13s} {pss:>13s} {s['peak_disk'] / gb:13.3f} "
              f"{'' if v is None else f'{v:7.2f}':>7s} {s['load']:5.2f}")
    print(f"(a) = read {d['read_bytes'] / gb:.2f} GB in {d['read_s']:.1f} s (O_DIRECT) + write and fsync "
          f"{r['output_bytes'] / gb:.2f} GB in {d['write_s']:.1f} s")
    rate = (f"{g['rate_weights_per_s'] / 1e6:.2f} M weights/s with {r['ggml_threads']} threads "
            f"({g['cpu_rate_weights_per_s'] / 1e6:.2f} M a CPU second)")
    if g["extrapolated"]:
        rest = g["expert_weights"] - g["quantized_weights"]
        print(f"* EXTRAPOLATED: ggml quantized {g['quantized_weights'] / 1e6:.0f} M of "
              f"{g['expert_weights'] / 1e6:.0f} M expert weights ({r['ggml_sample']} experts a tensor) "
              f"at a measured {rate}; the other "
              f"{rest / 1e6:.0f} M are added at that rate to the pass's measured {g['measured_wall_s']:.1f} s")
    else:
        print(f"ggml quantized every expert weight, at {rate}")
    print(f"SNR on {snr['experts']} experts ({snr['weights'] / 1e6:.0f} M weights) against the MXFP4 source; "
          f"converter's MXFP4 lossless: {'yes' if snr['converter_mxfp4_lossless'] else 'NO'}; both IQ2_XS files "
          f"hold the same tensors, types and shapes: {'yes' if snr['same_layout'] else 'NO'}")

    def line(what: str, value: str, target: str, met: bool, note: str = "") -> None:
        print(f"{what:42s} {value:>9s}   target {target:7s} {'ok' if met else 'MISSED'}{note}")

    line("ours / disk baseline, wall", f"{q['ours_over_disk']:.2f}x", "<= 1.5", q["ours_over_disk"] <= 1.5)
    line("llama.cpp route / ours, wall", f"{q['llama_over_ours']:.2f}x", ">= 5", q["llama_over_ours"] >= 5,
         f"  (CPU seconds {q['llama_over_ours_cpu']:.2f}x)" + ("  extrapolated" if g["extrapolated"] else ""))
    line("our peak disk / (output + 2 largest shards)", f"{q['ours_disk_over_budget']:.3f}", "<= 1",
         q["ours_disk_over_budget"] <= 1, f"  ({q['disk_budget_bytes'] / gb:.3f} GB)")
    line("our SNR - ggml's SNR", f"{q['snr_ours_minus_ggml_db']:+.2f} dB", ">= 0", q["snr_ours_minus_ggml_db"] >= 0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ggml-child":
        src, dst, sample, threads, result = sys.argv[2:7]
        ggml_child(src, dst, sample, int(threads), result)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=122, help="routed experts per MoE layer of the fixture built "
                    "(default 122: 4.31 GB)")
    ap.add_argument("--fixture", type=Path, help="an existing k3 fixture to use instead of building one")
    ap.add_argument("--keep", type=Path, help="work (and build the fixture) under this folder; kept afterwards")
    ap.add_argument("--workers", type=int, default=2, help="k3ckpt gguf --workers (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="ggml quantizer threads (default 2)")
    ap.add_argument("--ggml-sample", default="4", metavar="K|all",
                    help="experts per expert tensor ggml quantizes, evenly spaced; 'all': every one (default 4)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON instead of the table")
    args = ap.parse_args()
    if args.ggml_sample != "all" and not (args.ggml_sample.isdigit() and int(args.ggml_sample) >= 1):
        ap.error("--ggml-sample takes a count of at least 1 or 'all'")
    root = args.keep or Path(tempfile.mkdtemp(prefix="k3ckpt-bench-gguf-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        r = run(args, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
        else:       # the outputs go; a built fixture stays for the next run
            for d in ("ours", "llama"):
                shutil.rmtree(root / d, ignore_errors=True)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        render(r)


if __name__ == "__main__":
    main()
