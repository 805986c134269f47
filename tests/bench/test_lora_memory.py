"""bench/lora_memory.py: a LoRA learner's measured peak (CPU, a small looped shape) is at most half
of full fine-tuning's, and each is within 8 % of its memory plan (figures in bench/RESULTS.md)."""

import pytest

from .helpers import load_bench

pytestmark = pytest.mark.slow


def test_lora_learner_peak_is_under_half_of_full_fine_tuning_and_as_planned():
    bench = load_bench("lora_memory")
    full_measured, full_planned = bench.measure(None, checkpointing=False)
    lora_measured, lora_planned = bench.measure(bench.LORA, checkpointing=False)
    assert lora_measured <= 0.5 * full_measured, (lora_measured, full_measured)
    assert abs(lora_planned - lora_measured) <= 0.08 * lora_measured, (lora_planned, lora_measured)
    assert abs(full_planned - full_measured) <= 0.08 * full_measured, (full_planned, full_measured)
