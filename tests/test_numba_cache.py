"""njit_with names a kernel's cache after the files of the kernels it calls (k3ckpt._numba)."""

from __future__ import annotations

import importlib.util
import sys

from k3ckpt._numba import dependency_digest, njit, njit_with


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _caller(x):
    return helper(x) + 1   # noqa: F821  (bound by njit_with)


def test_a_kernel_bound_to_another_files_kernel_is_named_after_that_file(tmp_path):
    path = tmp_path / "k3ckpt_test_helper_mod.py"
    path.write_text("def helper(x):\n    return 2 * x\n")
    mod = _load(path, "k3ckpt_test_helper_mod")
    helper = njit(mod.helper)
    first = dependency_digest(_caller, [helper])
    kernel = njit_with(_caller, helper=helper)
    assert first and kernel.py_func.__qualname__ == f"_caller_deps_{first}"
    assert kernel(3) == 7
    path.write_text("def helper(x):\n    return 3 * x\n")   # an edit to the helper's file
    assert dependency_digest(_caller, [helper]) != first
    # plain values, and kernels of the caller's own file, leave the name alone
    same_file = njit(_caller)
    assert dependency_digest(_caller, [same_file, 3, "x"]) == ""
    assert njit_with(_caller, helper=same_file).py_func.__qualname__ == "_caller"


def test_the_fused_moet_kernel_carries_the_metric_files_digest():
    from k3ckpt.requant import metrics, moet_fused

    kernel = moet_fused._kernel()
    digest = dependency_digest(moet_fused._fused_loop, [metrics._kernels()[0]])
    assert digest and kernel.py_func.__qualname__ == f"_fused_loop_deps_{digest}"
