"""The host-work counter (rltt.rollout.host_work): operators per (layer · pass), syncs per pass."""

import pytest
import torch

from rltt.rollout import NativeEngine, SamplingParams
from rltt.rollout.host_work import profile_host_work, rollout_host_work

from .helpers import prompts, tiny_model


def test_counts_syncs_and_top_level_operators():
    x = torch.arange(6.0)

    def work():
        y = x * 2  # one top-level operator (its internals are not counted again)
        return y.sum().item(), y[y > 3]  # an .item() and a boolean-mask index: two syncs

    _, counted = profile_host_work(work, layers=1, passes=lambda _: 1)
    assert counted.syncs == 2
    assert counted.top_ops["aten::mul"] == 1 and counted.top_ops["aten::sum"] == 1
    assert counted.operators == sum(counted.top_ops.values())


def test_rollout_host_work_matches_the_unprofiled_call():
    engine = NativeEngine(tiny_model())
    params = SamplingParams(temperature=0, max_new_tokens=5, exit_policy="sample", schedule="deferred", seed=3)
    batch, work = rollout_host_work(engine, prompts([4, 6]), params)
    assert torch.equal(batch.completion_ids, engine.generate(prompts([4, 6]), params).completion_ids)
    summary = work.summary()
    assert work.passes == batch.stats.passes and work.layers == 2
    assert summary["operators_per_layer_pass"] > summary["launches_per_layer_pass"] > 0


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)])
def test_native_passes_call_no_item_nonzero_or_masked_select(schedule, sampling):
    """No operator of a rollout reads a device value on the host (``.item()``, ``bool(t)``,
    ``nonzero``, boolean-mask indexing): a property of the code, not a timing. (The exits' and
    tokens' ``.tolist()`` dispatch no operator on CPU and are not counted.)"""
    engine = NativeEngine(tiny_model())
    params = SamplingParams(max_new_tokens=6, n=2, exit_policy="sample", schedule=schedule, seed=4, **sampling)
    _, work = rollout_host_work(engine, prompts([3, 7, 1]), params)
    assert work.passes > 0 and work.syncs == 0, work.sync_sites
