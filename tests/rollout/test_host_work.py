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


def test_read_counter_counts_python_reads_of_tensor_values_per_marked_pass():
    from rltt.rollout.host_work import ReadCounter, end_passes, host_list, mark_pass

    x = torch.arange(4)
    with ReadCounter() as counter:
        x.tolist()  # before any pass: counted in the total only
        mark_pass()
        x.cpu(), x[0].item(), bool(x[1]), int(x[2])
        host_list(x)  # a host tensor's values: not a device read
        mark_pass()
        x * 2
        end_passes()
        x.tolist()  # after the passes: the total only
    assert counter.total == 6 and counter.passes == [4, 0]
    mark_pass()  # no counter active: nothing happens


def _pass_reads(schedule, policy, stop_token_ids=(), sampling=None, n=1):
    engine = NativeEngine(tiny_model())
    params = SamplingParams(max_new_tokens=5, n=n, exit_policy=policy, schedule=schedule, seed=5,
                            stop_token_ids=list(stop_token_ids), **(sampling or dict(temperature=1.0)))
    batch, work = rollout_host_work(engine, prompts([3, 7, 1]), params, warmup=False)
    assert work.syncs == 0, work.sync_sites
    return batch, work


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_a_pass_reads_the_device_at_most_once_and_not_at_all_with_known_exits(schedule):
    """Device-to-host reads per pass (a property of the code, counted on CPU by `ReadCounter`):
    without stop tokens the sampled tokens and log-probs stay on the device until the rollout ends,
    so a pass reads only its decode tokens' gates (the ``sample`` / ``threshold`` exit policies), and
    nothing when the exits are known on the host (``final``, ``fixed``)."""
    batch, work = _pass_reads(schedule, "sample")
    assert len(work.pass_reads) == batch.stats.passes  # no shared prefill here: every pass is marked
    assert max(work.pass_reads) == 1 and sum(work.pass_reads) >= batch.stats.passes // 2
    policy = "final" if schedule == "dense" else "fixed:2"
    batch, work = _pass_reads(schedule, policy)
    assert len(work.pass_reads) == batch.stats.passes and max(work.pass_reads) == 0


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_with_stop_tokens_a_pass_with_exits_reads_its_sampled_values_once(schedule):
    """A stop token must reach the host before the next pass is planned: one more read, only in the
    passes where a token is sampled (the four values — token, raw and tempered log-prob, kept floor —
    read together)."""
    batch, work = _pass_reads(schedule, "sample", stop_token_ids=[3, 8, 13], sampling=dict(temperature=0.8, top_p=0.9))
    exits = [p.exits.numel() > 0 for p in batch.schedule.passes]
    assert max(work.pass_reads) == 2
    assert all(reads <= 1 + had for reads, had in zip(work.pass_reads, exits))


def test_a_deferred_pass_uploads_its_plan_as_one_host_tensor():
    """Tensors made from Python data per pass: the pass plan's index lists travel to the device in one
    upload, the exits' in another; the rest stay on the host (the pass record's two tensors, the exit
    decision's steps, the next tokens' exit draws)."""
    batch, work = _pass_reads("deferred", "sample")
    assert len(work.pass_uploads) == batch.stats.passes
    assert max(work.pass_uploads) <= 2 and max(work.pass_made) <= 8, (work.pass_uploads, work.pass_made)


def test_the_sampled_values_held_until_the_chunk_ends_are_planned(monkeypatch):
    """Without stop tokens a chunk keeps each sampled token's four float64 values on the device until
    it ends: 32 bytes per completion token, within the memory plan's rollout state per position."""
    from rltt.planning import rollout_memory
    from rltt.rollout import decode_loop

    held = []
    fill = decode_loop._Deferred.fill
    monkeypatch.setattr(decode_loop._Deferred, "fill", lambda self, out: (
        held.append(sum(v.numel() * v.element_size() for v in self.values)), fill(self, out))[1])
    engine = NativeEngine(tiny_model())
    params = SamplingParams(max_new_tokens=6, n=2, exit_policy="sample", schedule="deferred", seed=2, temperature=1.0)
    batch = engine.generate(prompts([3, 5]), params)
    tokens = int(batch.completion_lengths.sum())
    assert held == [32 * tokens]
    shape = type("Shape", (), dict(hidden=0, loops=0))()  # the per-position bytes beside the carry and gates
    assert rollout_memory.state_bytes(shape, 1, 1, 2) - 8 - 12 == 32
