"""Requantize one weight, and the process-pool side of ``k3ckpt requant``.

``requant_weight`` is the whole per-weight job for an MXFP4 source: check it,
encode it in the target format, decode both and measure the error with the
shared metric (``k3ckpt.requant.metrics.error_stats``), and return the new
parts with a ``TensorResult``; for moet-w2 one kernel does all of it
(``moet_fused``, same bits).  ``requant_floats`` is the same job for any
other source, given its decoded float32 values (``sources.decode_slice``):
formats that encode from floats take them directly (``mxfp4``, ``gguf-iq2_xs``);
those that encode from MXFP4 codes (``moet-w2``, ``k3ckpt-mx2``) take the
bit-exact MXFP4 encoding of them; the error is always against the floats.
``run_task`` is what pool workers execute: each worker opens the source
checkpoint once by path (``init_worker``) and reads only the weight it is
given, so memory stays at about one expert tensor per worker and nothing
large is pickled on the way in.
"""

from __future__ import annotations

import math
import os
import select
import time

import numpy as np

from ..errors import NaNScaleError
from ..formats import ids
from .results import TensorResult

_CKPT = None   # this worker process's open source checkpoint (see init_worker)


def _code_histogram(fmt, parts) -> tuple[int, ...]:
    """Counts per 2-bit code value for formats whose ``packed`` part holds 2 bits per weight."""
    from .tensor_stats import code_histogram

    packed = next((p for p in fmt.info.parts if p.role == "packed"), None)
    if packed is None or packed.dtype != "U8" or packed.bytes_per_block * 4 != fmt.info.block:
        return ()
    return code_histogram(parts["packed"])


def _encode(fmt, method: str | None, packed, scale, name: str, imatrix=None):
    weights = {"imatrix": imatrix} if imatrix is not None and fmt.info.weighted else {}
    if fmt.info.mxfp4_codes:
        if fmt.info.methods:
            return fmt.from_mxfp4(packed, scale, method=fmt.check_method(method, name=name), name=name)
        return fmt.from_mxfp4(packed, scale, name=name, **weights)
    from ..formats import get_format

    # Formats that encode from floats: the decoded MXFP4 values are their input.
    src = get_format(ids.MXFP4_PACK).decode({"packed": packed, "scale": scale}, name=name)
    return fmt.from_float(src, name=name, **weights) if weights else fmt.encode(src, name=name)


def _weighted(ref, out, imatrix):
    """``metrics.weighted_sums`` of a weight with an importance entry, else None."""
    if imatrix is None:
        return None
    from .metrics import weighted_sums

    return weighted_sums(ref, out, imatrix)


def _error(ref: np.ndarray, out: np.ndarray):
    """The shared metric and the largest row bias relative to the source's RMS, in one pass."""
    from .metrics import error_stats_rows

    stats, top = error_stats_rows(ref, out)
    return stats, _relative(top, stats)


def _relative(top: float, stats) -> float:
    """Max row bias relative to the source's RMS (as the report shows it)."""
    return 0.0 if top == 0.0 else (top / stats.ref_rms if stats.ref_rms else math.inf)


def requant_weight(packed: np.ndarray, scale: np.ndarray, format: str, method: str | None = None, *,
                   name: str, layer: int | None = None, expert: int | None = None,
                   projection: str | None = None, imatrix=None) -> tuple[dict[str, np.ndarray], TensorResult]:
    """MXFP4 pair layout (packed U8 [N, K/2], scale U8 [N, K/32]) -> ``format`` parts and the result record.

    ``imatrix``: float32 ``[K]`` importance per column, or None.  Given, a weighted encoder
    (``FormatInfo.weighted``) weighs its error by it, and the result carries the weighted error.

    Raises ``NaNScaleError`` (naming the weight) for E8M0 0xFF scales and
    ``ShapeError`` for arrays that do not fit 32-element blocks."""
    from ..formats import get_format
    from . import tensor_stats
    from .moet import check_mxfp4

    p, s = check_mxfp4(packed, scale, name=name)
    nan = int(np.count_nonzero(s == 0xFF))
    if nan:
        raise NaNScaleError(f"{nan} block(s) have the E8M0 scale 0xFF (NaN); a NaN block has no "
                            "2-bit encoding", tensor=name)
    ident = dict(name=name, layer=layer, expert=expert, projection=projection, format=format, method=method,
                 params=2 * p.size)
    fmt = get_format(format)
    one_pass = fmt.one_pass_requant()
    if one_pass is not None:
        # One pass: the same parts and numbers as the general path below, bit for bit (moet_fused).
        m = one_pass(p, s, fmt.check_method(method, name=name), name=name)
        parts = {"packed": m.codes, "scale": m.scale}
        weighted = None if imatrix is None else _weighted(
            get_format(ids.MXFP4_PACK).decode({"packed": p, "scale": s}, name=name), fmt.decode(parts, name=name),
            imatrix)
        return parts, TensorResult(
            **ident, bytes=m.codes.nbytes + m.scale.nbytes, stats=m.stats,
            max_row_bias=_relative(m.max_row_bias, m.stats),
            source_zero_fraction=m.source_zeros / (2 * p.size) if p.size else 0.0,
            code_histogram=m.code_histogram, scale_changes=m.scale_changes if method == "refit" else None,
            weighted=weighted)
    parts = _encode(fmt, method, p, s, name, imatrix)
    src = get_format(ids.MXFP4_PACK).decode({"packed": p, "scale": s}, name=name)
    out = fmt.decode(parts, name=name)
    stats, max_row_bias = _error(src, out)
    zeros = tensor_stats.zero_codes(p)
    result = TensorResult(
        **ident, bytes=int(sum(np.asarray(a).nbytes for a in parts.values())), stats=stats,
        max_row_bias=max_row_bias, source_zero_fraction=zeros / (2 * p.size) if p.size else 0.0,
        code_histogram=_code_histogram(fmt, parts), scale_changes=None, weighted=_weighted(src, out, imatrix))
    return parts, result


def requant_floats(x: np.ndarray, format: str, method: str | None = None, *, name: str,
                   layer: int | None = None, expert: int | None = None,
                   projection: str | None = None, imatrix=None) -> tuple[dict[str, np.ndarray], TensorResult]:
    """Decoded source values ``x`` (float32 [N, K]) -> ``format`` parts and the result record
    (``imatrix`` as in ``requant_weight``).

    ``source_zero_fraction`` is the fraction of exact zeros in ``x``; ``scale_changes`` (moet-w2
    refit) counts blocks whose exponent differs from the MXFP4 encoding of ``x``."""
    from ..errors import UsageError
    from ..formats import get_format
    from ..formats.mxfp4 import encode_pair

    x = np.ascontiguousarray(x, np.float32)
    fmt = get_format(format)
    mx_scale = None
    if fmt.info.can_encode:
        if imatrix is not None and fmt.info.weighted:
            parts = fmt.from_float(x, imatrix=imatrix, name=name)
        else:
            parts = fmt.encode(x, name=name)
    elif fmt.info.mxfp4_codes:
        packed, mx_scale = encode_pair(x, name=name)   # bit-exact OCP MXFP4 first, then the 2-bit encoder
        parts = _encode(fmt, method, packed, mx_scale, name, imatrix)
    else:
        raise UsageError(f"format {format} cannot be written", tensor=name)
    out = fmt.decode(parts, name=name).reshape(x.shape)
    stats, max_row_bias = _error(x, out)
    refit = method == "refit" and mx_scale is not None   # a refit moves exponents: count them
    result = TensorResult(
        name=name, layer=layer, expert=expert, projection=projection, format=format, method=method,
        params=int(x.size), bytes=int(sum(np.asarray(a).nbytes for a in parts.values())), stats=stats,
        max_row_bias=max_row_bias, source_zero_fraction=float(np.count_nonzero(x == 0)) / x.size if x.size else 0.0,
        code_histogram=_code_histogram(fmt, parts),
        scale_changes=int(np.count_nonzero(parts["scale"] != mx_scale)) if refit else None,
        weighted=_weighted(x, out, imatrix))
    return parts, result


def read_source(ckpt, w):
    """MXFP4 source: its pair layout (packed [N, K/2], scale [N, K/32]).  Other sources: the raw
    stored parts of each source slice (``sources.read_slice``), for a pool that cannot reopen it."""
    if not w.from_mxfp4:
        from .sources import read_slice

        return tuple(read_slice(ckpt, s) for s in w.sources)
    n, k = w.shape
    if w.expert_slice is None:
        packed = ckpt.read_raw(w.packed)
        scale = ckpt.read_raw(w.scale)
    else:
        e = w.expert_slice
        packed = ckpt.read_rows(w.packed, e, e + 1)
        scale = ckpt.read_rows(w.scale, e, e + 1)
    return (np.ascontiguousarray(packed).view(np.uint8).reshape(n, k // 2),
            np.ascontiguousarray(scale).view(np.uint8).reshape(n, k // 32))


def source_values(ckpt, w, arrays=None) -> np.ndarray:
    """float32 [N, K] of a non-MXFP4 planned weight: its slices decoded (row chunks) and joined."""
    from .sources import decode_parts, decode_slice, join_rows

    if arrays is not None:
        return join_rows([decode_parts(s, raw, name=w.name) for s, raw in zip(w.sources, arrays)])
    return join_rows([decode_slice(ckpt, s, name=w.name) for s in w.sources])


def compute(ckpt, w, arrays=None, imatrix=None):
    """(index, parts, result) of planned weight ``w``, read from ``ckpt`` unless ``arrays`` are
    given; ``imatrix``: its importance per column (``importance.Importance.columns``) or None."""
    if not w.from_mxfp4:
        parts, result = requant_floats(source_values(ckpt, w, arrays), w.format, w.method, name=w.name,
                                       layer=w.layer, expert=w.expert, projection=w.projection, imatrix=imatrix)
        return w.index, parts, result
    packed, scale = arrays if arrays is not None else read_source(ckpt, w)
    parts, result = requant_weight(packed, scale, w.format, w.method, name=w.name, layer=w.layer,
                                   expert=w.expert, projection=w.projection, imatrix=imatrix)
    return w.index, parts, result


def _exit_with(pid: int) -> None:
    """End this process as soon as process ``pid`` has ended, from a daemon thread.

    A pool worker otherwise outlives a parent killed by a signal it cannot handle (SIGKILL,
    or SIGTERM's default action): it waits forever on the task queue, whose write end it
    holds itself.  What it was writing stays in a ``.partial`` file that a resumed run
    writes again."""
    import threading

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)   # Linux: readable once the process has exited
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass   # alive, under another user (not expected)
        os._exit(1)

    threading.Thread(target=watch, name="k3ckpt-parent-watch", daemon=True).start()


def init_worker(src_path: str | None, parent_pid: int | None = None) -> None:
    """Pool initializer: open the source once per worker process (None: tasks carry their
    arrays), and exit when the process that made the pool does (``_exit_with``)."""
    global _CKPT
    import atexit
    import gc

    if parent_pid is not None:
        _exit_with(parent_pid)

    # A worker's exit otherwise spends about half a second in the interpreter's final garbage
    # collection over numba's objects, at the end of the run when nothing else is left to do.
    # Freezing moves them out of its reach; the OS takes the memory back anyway.  (Outputs are
    # written with os.pwrite and closed per call, so no buffered file depends on a finalizer.)
    atexit.register(gc.freeze)
    if src_path is not None:
        from ..io.reader import open_checkpoint

        _CKPT = open_checkpoint(src_path)


def run_task(w, arrays=None, targets=None, keep_parts: bool = True, imatrix=None):
    """Pool entry point (module level, so a worker finds it by name).

    ``targets`` maps output roles to (file, offset) from ``ShardedWriter.place``: those parts
    are written there and left out of the answer, so their bytes never cross the pipe;
    ``keep_parts=False`` leaves out every part (a pass that only measures)."""
    index, parts, result = compute(_CKPT, w, arrays, imatrix)
    if targets:
        for role, (path, offset) in targets.items():
            write_at(path, offset, parts.pop(role))
    return index, parts if keep_parts else {}, result


def write_at(path: str, offset: int, array: np.ndarray) -> None:
    """``array``'s bytes at ``offset`` of the existing file ``path``."""
    from ..io.writer import pwrite_all

    fd = os.open(path, os.O_WRONLY)
    try:
        pwrite_all(fd, memoryview(np.ascontiguousarray(array)).cast("B"), offset)
    finally:
        os.close(fd)
