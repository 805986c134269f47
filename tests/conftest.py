"""Shared test set-up: tiny models built from configs, no downloads, deterministic CPU threads."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Every MetricsLogger a test builds (the training loops' included, in subprocesses too) rejects
# a metric key that rltt.telemetry.schema does not document.
os.environ.setdefault("RLTT_STRICT_METRICS", "1")
# Triton's interpreter only works if it is on before triton is first imported (its language
# helpers are jit'd at import); libraries imported by other tests may import triton, so the
# whole CPU test session runs with it on (Triton cannot run natively without a GPU anyway).
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
