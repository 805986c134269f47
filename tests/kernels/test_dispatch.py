"""Implementation choice, input validation, the convenience wrapper and lazy triton import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rltt.errors import RlttError
from rltt.kernels import ENV_VAR, per_loop_logprobs, resolve_impl
from rltt.kernels._common import default_chunk_size
from rltt.kernels.reference import reference_logprobs

from .helpers import make_inputs

CPU = torch.device("cpu")


def test_auto_is_chunked_on_cpu(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_impl(None, CPU) == "chunked"
    assert resolve_impl("auto", CPU) == "chunked"


def test_env_var_selects_impl(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert resolve_impl(None, CPU) == "reference"
    assert resolve_impl("chunked", CPU) == "chunked"  # the argument wins


def test_unknown_impl_is_one_line_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fused")
    with pytest.raises(RlttError, match=f"{ENV_VAR}='fused'") as err:
        resolve_impl(None, CPU)
    assert "\n" not in str(err.value)


def test_triton_on_cpu_without_interpreter_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, targets = make_inputs(1, 2, 8, 16)
    with pytest.raises(RlttError, match="needs CUDA tensors.*TRITON_INTERPRET=1") as err:
        per_loop_logprobs(hidden, weight, targets, impl="triton")
    assert "\n" not in str(err.value)


def test_triton_missing_errors(monkeypatch):
    monkeypatch.setattr("rltt.kernels.dispatch.triton_installed", lambda: False)
    with pytest.raises(RlttError, match="needs the triton package"):
        resolve_impl("triton", CPU)
    assert resolve_impl("auto", torch.device("cuda")) == "chunked"


def test_triton_used_under_interpreter(triton_interpret):
    from rltt.kernels import triton_logprobs

    triton_logprobs._kernels.cache_clear()
    hidden, weight, targets = make_inputs(2, 3, 16, 40)
    per_loop_logprobs(hidden, weight, targets, impl="triton")
    assert triton_logprobs._kernels.cache_info().currsize == 1


def test_package_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, rltt.kernels as k\n"
            "h = torch.randn(2, 3, 8); w = torch.randn(10, 8); y = torch.tensor([1, 2, 3])\n"
            "out = k.per_loop_logprobs(h, w, y)\n"
            "assert out.logprobs.shape == (2, 3)\n"
            "assert 'rltt.kernels.triton_logprobs' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("bad, message", [
    (dict(targets=torch.tensor([0, 99])), "outside the vocabulary"),
    (dict(targets=torch.tensor([0.0, 1.0])), "targets must be integer"),
    (dict(targets=torch.tensor([0, 1, 2])), r"targets must be integer of shape \(2,\)"),
    (dict(mask=torch.tensor([1, 0])), "mask must be bool"),
    (dict(temperature=0.0), "temperature must be a positive"),
    (dict(chunk_size=0), "chunk_size must be a positive int"),
    (dict(hidden=torch.randn(2, 8)), r"hidden must be \(T, N, d\)"),
    (dict(weight=torch.randn(20, 7)), r"weight must be \(V, d=8\)"),
])
def test_bad_inputs_are_rltt_errors(bad, message):
    args = dict(hidden=torch.randn(1, 2, 8), weight=torch.randn(20, 8), targets=torch.tensor([0, 1]))
    args.update(bad)
    extra = {k: args.pop(k) for k in ("mask", "temperature", "chunk_size") if k in args}
    with pytest.raises(RlttError, match=message):
        per_loop_logprobs(args["hidden"], args["weight"], args["targets"], **extra)


def test_int32_targets_accepted():
    hidden, weight, targets = make_inputs(2, 4, 8, 30)
    a = per_loop_logprobs(hidden, weight, targets)
    b = per_loop_logprobs(hidden, weight, targets.int())
    torch.testing.assert_close(a.logprobs, b.logprobs)


def test_reference_impl_through_dispatch():
    hidden, weight, targets = make_inputs(2, 4, 8, 30)
    a = per_loop_logprobs(hidden, weight, targets, impl="reference", temperature=0.5)
    b = reference_logprobs(hidden, weight, targets, temperature=0.5)
    assert torch.equal(a.logprobs, b.logprobs)


def test_default_chunk_size():
    assert default_chunk_size(4096, 151_936) == 4096
    assert default_chunk_size(16_384, 151_936) == 1024
    assert default_chunk_size(1, 151_936) == 8192
    assert default_chunk_size(1, 100) == 100
    assert default_chunk_size(10**9, 151_936) == 512


def test_chunked_saves_no_vocab_sized_tensor():
    """The chunked backward keeps only hidden, weight, targets and two (M,) vectors."""
    hidden, weight, targets = make_inputs(4, 32, 16, 1000)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        per_loop_logprobs(hidden, weight, targets, impl="chunked", chunk_size=128)
    rows = 4 * 32
    allowed = hidden.numel() + weight.numel() + rows + 2 * rows + 2 * 32
    assert sum(saved) <= allowed, saved
    assert max(saved) < rows * 1000
