"""Triton's interpreter (``TRITON_INTERPRET=1``) under Triton < 3.7 with NumPy >= 2.4.

The interpreter holds a scalar kernel argument (``dim``, a loop count) as a one-element 1-D
array, and Triton < 3.7 gives its tensors ``__index__ = int(handle.data)``. NumPy 2.4 turned the
conversion of an array with ndim > 0 to a scalar (deprecated since 1.25) into an error, so every
``range(..., dim, ...)`` over a scalar argument fails there with ``InterpreterError:
TypeError('only 0-dimensional arrays can be converted to Python scalars')`` — in any kernel that
loops to a runtime bound, not only rltt's (triton-lang/triton#9171). Triton 3.7 converts with
``int(handle.data.squeeze())`` (triton-lang/triton#9172). `fix_interpreter` applies that same
conversion to older interpreters, for the interpreter only: compiled kernels never run this code,
and under Triton >= 3.7 nothing is changed.
"""

from __future__ import annotations

import warnings

import numpy as np
import triton


def _needs_fix() -> bool:
    try:
        major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:  # a development build: leave it as it is
        return False
    if (major, minor) >= (3, 7):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NumPy 1.25-2.3 warn (DeprecationWarning) and convert
        try:
            int(np.ones(1, dtype=np.int32))
        except TypeError:  # NumPy >= 2.4
            return True
    return False


def fix_interpreter() -> bool:
    """Give the interpreter's tensors Triton 3.7's ``__index__`` where Triton < 3.7 meets NumPy >= 2.4
    (module docstring); idempotent. Returns whether the fix is in place."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_rltt_index_fix", False):
        return patch is not None
    if not _needs_fix():
        return False

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        # the scope restores attributes last-in first-out: this one, then Triton's own
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._rltt_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
