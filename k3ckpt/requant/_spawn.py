"""Start methods for the worker pool that never re-run the caller's ``__main__``.

multiprocessing's forkserver and spawn children import the parent's main module before they
unpickle their task (``multiprocessing.spawn.prepare``), so that functions defined there can be
found.  For a script without ``if __name__ == "__main__":`` that re-runs the whole script in
every worker (which then tries to start a pool of its own and dies); for ``python -`` (stdin) or
``python -c`` there is no file to run and the worker dies at once.  Pool tasks are k3ckpt's own
functions (``worker.py``), so the workers need nothing from ``__main__``: these contexts start
them without it.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing import context, spawn

_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_lock = threading.Lock()   # the preparation-data hook below is module state; one launch at a time


def _without_main(launch, popen, process_obj) -> None:
    get = spawn.get_preparation_data

    def prepared(name):
        data = get(name)
        for key in _MAIN_KEYS:
            data.pop(key, None)
        return data

    with _lock:
        # The stdlib reads the data inside Popen._launch; there is no argument for it.
        spawn.get_preparation_data = prepared
        try:
            launch(popen, process_obj)
        finally:
            spawn.get_preparation_data = get


def _popen_class(base):
    class Popen(base):
        def _launch(self, process_obj):
            _without_main(base._launch, self, process_obj)
    return Popen


class _ForkServerProcess(context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        from multiprocessing.popen_forkserver import Popen

        return _popen_class(Popen)(process_obj)


class _SpawnProcess(context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj):
        if sys.platform == "win32":
            from multiprocessing.popen_spawn_win32 import Popen
        else:
            from multiprocessing.popen_spawn_posix import Popen
        return _popen_class(Popen)(process_obj)


class ForkServerContext(context.ForkServerContext):
    """``multiprocessing.get_context("forkserver")``, less the main-module import."""

    Process = _ForkServerProcess


class SpawnContext(context.SpawnContext):
    """``multiprocessing.get_context("spawn")``, less the main-module import."""

    Process = _SpawnProcess
