"""bench/attention_shapes.py: the counter sees every attention call of a rollout, counts a shape once,
meets none new in an identical repeat, and puts `scaled_dot_product_attention` back."""

import torch
import torch.nn.functional as F

from rltt.rollout import NativeEngine, SamplingParams
from tests.bench.helpers import load_bench


def test_shape_counter_counts_new_shapes_once_and_restores_sdpa():
    bench = load_bench("attention_shapes")
    original = F.scaled_dot_product_attention
    m = bench.model(32)
    prompts = torch.randint(1, 99, (4, 6), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=5, schedule="deferred", seed=1, ignore_eos=True,
                            exit_policy="sample")
    with bench.ShapeCounter() as counter:
        engine = NativeEngine(m)
        engine.generate(prompts, params)
        first_calls, first_new = counter.calls, counter.new
        counter.reset(forget=False)
        engine.generate(prompts, params)
        assert counter.calls == first_calls > 0  # the same passes again
        assert counter.new == 0 < first_new <= first_calls  # an identical repeat meets no new shape
        counter.reset(forget=True)
        engine.generate(prompts, params)
        assert counter.new == first_new  # forgotten: counted again
    assert F.scaled_dot_product_attention is original
