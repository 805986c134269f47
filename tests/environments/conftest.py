"""Rollout tests use tiny models: one intra-op thread is faster (no OpenMP hand-offs per small op,
which stall badly on a busy 2-core machine) and keeps the runs deterministic."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
