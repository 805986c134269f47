"""Fixtures for the kernel tests: the Triton interpreter switch."""

from __future__ import annotations

import importlib.util

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def triton_interpret(monkeypatch):
    """Run Triton kernels on CPU through its interpreter (the kernels jit at first use,
    reading TRITON_INTERPRET then, so setting it here is enough)."""
    if not HAS_TRITON:
        pytest.fail("triton is not installed; CI installs rltt[triton] to run these tests")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(params=["chunked", "triton"])
def impl(request, monkeypatch):
    """Each non-reference implementation; Triton runs under its interpreter on CPU."""
    if request.param == "triton":
        request.getfixturevalue("triton_interpret")
    return request.param
