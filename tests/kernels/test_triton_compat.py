"""rltt.kernels.triton_compat: Triton < 3.7's interpreter converts a scalar kernel argument with
``int(array)``, which NumPy >= 2.4 refuses (NumPy 1.25-2.3 warn with a DeprecationWarning, made an
error here so that this environment's NumPy behaves like 2.4+); the fix gives the interpreter
Triton 3.7's conversion."""

from __future__ import annotations

import warnings

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from rltt.kernels import triton_compat  # noqa: E402


def _loop_sum(X, OUT, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):  # a runtime loop bound: the interpreter calls __index__ on n
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(OUT, tl.sum(acc, axis=0))


def _run_loop_kernel() -> float:
    x = torch.arange(10, dtype=torch.float32)
    out = torch.zeros(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # NumPy >= 2.4: int(1-D array) raises
        triton.jit(_loop_sum)[(1,)](x, out, 10, BLOCK=4)
    return float(out)


@pytest.fixture
def triton_36_interpreter(monkeypatch, triton_interpret):
    """The interpreter as Triton 3.6 patches its tensors: ``__index__ = int(handle.data)``."""
    original = interpreter._patch_lang_tensor

    def patch_36(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_36)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(triton_compat, "_needs_fix", lambda: True)  # as under NumPy >= 2.4


def test_a_runtime_loop_bound_fails_in_triton_36s_interpreter_without_the_fix(triton_36_interpreter):
    with pytest.raises(Exception, match="only 0-dimensional arrays|Conversion of an array with ndim > 0"):
        _run_loop_kernel()


def test_the_fix_runs_it_and_restores_the_tensor_afterwards(triton_36_interpreter):
    assert triton_compat.fix_interpreter() is True
    assert triton_compat.fix_interpreter() is True  # idempotent: wrapped once
    assert getattr(interpreter._patch_lang_tensor, "_rltt_index_fix", False)
    assert _run_loop_kernel() == 45.0
    assert "__index__" not in vars(tl.tensor)  # the launch's patches are undone, last first


def test_nothing_changes_under_triton_37(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    before = interpreter._patch_lang_tensor
    if getattr(before, "_rltt_index_fix", False):
        pytest.skip("fixed earlier in this process")
    assert triton_compat.fix_interpreter() is False and interpreter._patch_lang_tensor is before
