"""numba with an on-disk cache that works on read-only and fresh checkouts.

numba caches compiled kernels next to the source file.  An installed wheel or a
read-only clone cannot take them, so before numba is first imported we point
``NUMBA_CACHE_DIR`` at a writable user cache folder unless the caller chose one.
Import ``njit`` from here, never from numba directly.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".k3ckpt-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def _choose_cache_dir() -> None:
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    candidates = []
    xdg = os.environ.get("XDG_CACHE_HOME")
    candidates.append(Path(xdg) if xdg else Path.home() / ".cache")
    candidates.append(Path(tempfile.gettempdir()))
    for base in candidates:
        target = base / "k3ckpt" / "numba"
        if _writable(target):
            os.environ["NUMBA_CACHE_DIR"] = str(target)
            return
    # Nowhere writable: numba then compiles in memory each run, which is only slower.


_choose_cache_dir()

import numba  # noqa: E402  (must follow the cache-dir choice)


def njit(*args, **kwargs):
    """``numba.njit`` with ``cache=True`` and ``nogil=True`` by default."""
    kwargs.setdefault("cache", True)
    kwargs.setdefault("nogil", True)
    return numba.njit(*args, **kwargs)


prange = numba.prange


def njit_with(fn, inline: str = "never", **globals_):
    """``njit(fn)`` with some of the global names ``fn`` uses bound to other objects: a kernel
    calling a helper that its module keeps as a plain function (so that importing the module
    does not import numba) is compiled against the helper's jitted twin.

    numba links a called kernel's code into its caller and keys the caller's cache on the
    caller's own file only, so an edit to a helper in another file would leave the caller
    running the old helper from the cache.  The name numba files the cache under therefore
    carries a digest of the bound kernels' source files (``dependency_digest``)."""
    import types

    twin = types.FunctionType(fn.__code__, {**fn.__globals__, **globals_}, fn.__name__)
    digest = dependency_digest(fn, globals_.values())
    if digest:
        twin.__qualname__ = f"{fn.__qualname__}_deps_{digest}"
    return njit(twin, inline=inline)


def dependency_digest(fn, bound) -> str:
    """A short digest of the source files of the kernels in ``bound`` defined outside ``fn``'s
    file, and of their own qualified names (which carry their dependencies' digests in turn);
    "" when there are none."""
    import hashlib
    import inspect

    own = inspect.getsourcefile(fn)
    h = hashlib.sha256()
    found = False
    for obj in bound:
        py = getattr(obj, "py_func", None)   # a numba dispatcher
        if py is None:
            continue
        path = inspect.getsourcefile(py)
        if path is None or path == own:
            continue
        found = True
        try:
            source = Path(path).read_bytes()
        except OSError:   # e.g. imported from a zip: the path is then all there is to go on
            source = path.encode()
        h.update(py.__qualname__.encode() + b"\0" + source)
    return h.hexdigest()[:12] if found else ""

