"""Dense and deferred compute the same function as the model's forward; deferred saves passes."""

import pytest
import torch

from rltt.rollout import NativeEngine, SamplingParams

from .helpers import dense_logprobs, prompts, tiny_model

THRESHOLD = "threshold:0.5"


def greedy(schedule, policy=THRESHOLD, **kw):
    return SamplingParams(temperature=0, max_new_tokens=kw.pop("max_new_tokens", 10), exit_policy=policy,
                          schedule=schedule, **kw)


@pytest.mark.parametrize("overrides", [
    {},
    {"injection": "scalar", "carry_normed_state": False},
    {"norm_placement": "ouro", "num_key_value_heads": 4},
    {"lora_rank": 2, "norm_placement": "post", "qk_norm": True},
])
def test_dense_and_deferred_agree_with_each_other_and_the_full_forward(overrides):
    model = tiny_model(**overrides)
    if overrides.get("lora_rank"):
        with torch.no_grad():  # non-zero step-wise LoRA so per-item steps matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    engine = NativeEngine(model)
    batch_prompts = prompts([5, 2, 9, 1])
    dense = engine.generate(batch_prompts, greedy("dense"))
    deferred = engine.generate(batch_prompts, greedy("deferred"))

    assert torch.equal(dense.completion_ids, deferred.completion_ids)
    assert torch.equal(dense.exit_steps, deferred.exit_steps)
    assert len(set(deferred.exit_steps[deferred.completion_mask].tolist())) > 1  # mixed exits
    torch.testing.assert_close(dense.logprobs, deferred.logprobs, atol=2e-5, rtol=0)

    # full forward on prompt + completion with the same exit policy, row by row (no padding)
    for row in range(deferred.num_rows):
        seq = torch.tensor([deferred.sequence(row)])
        start = len(batch_prompts[row]) - 1
        n = int(deferred.completion_lengths[row])
        with torch.no_grad():
            out = model(seq, exit_policy=THRESHOLD, use_cache=False)
        positions = slice(start, start + n)
        assert out.exit_steps[0, positions].tolist() == deferred.exit_steps[row, :n].tolist()
        logp = torch.log_softmax(out.logits[0, positions].float(), -1)
        reference = logp.gather(1, deferred.completion_ids[row, :n, None])[:, 0]
        torch.testing.assert_close(deferred.logprobs[row, :n], reference, atol=2e-5, rtol=0)
        assert deferred.completion_ids[row, :n].tolist() == logp.argmax(-1).tolist()  # greedy

    # the learner's batched dense recompute (per-loop kernel) agrees too
    learner = dense_logprobs(model, deferred)
    torch.testing.assert_close(learner.exit.detach(), deferred.logprobs, atol=2e-5, rtol=0)


def test_final_exit_equals_transformers_generate():
    model = tiny_model(injection="scalar")
    engine = NativeEngine(model)
    ids = torch.tensor(prompts([6, 6, 6], seed=3))
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for schedule in ("dense", "deferred"):
        batch = engine.generate(ids.tolist(), greedy(schedule, "final", max_new_tokens=12))
        assert torch.equal(batch.completion_ids, reference[:, 6:])
        assert (batch.exit_steps == model.config.num_loops).all()


def test_ragged_batch_rows_match_single_row_runs():
    model = tiny_model()
    engine = NativeEngine(model)
    batch_prompts = prompts([3, 8, 1, 5], seed=7)
    together = engine.generate(batch_prompts, greedy("deferred"))
    for row, prompt in enumerate(batch_prompts):
        alone = engine.generate([prompt], greedy("deferred"))
        assert alone.completion(0) == together.completion(row)
        assert alone.exit_steps[0].tolist() == together.exit_steps[row, : alone.completion_ids.shape[1]].tolist()


def test_deferred_saves_exactly_the_passes_the_exits_predict():
    T = 4
    model = tiny_model(num_loops=T)
    engine = NativeEngine(model)
    batch_prompts = prompts([4, 7, 2], seed=1)
    dense = engine.generate(batch_prompts, greedy("dense", max_new_tokens=12))
    deferred = engine.generate(batch_prompts, greedy("deferred", max_new_tokens=12))
    for batch in (dense, deferred):
        exits = [batch.exit_steps[r, : int(batch.completion_lengths[r])].tolist() for r in range(batch.num_rows)]
        if batch is deferred:
            predicted = [sum(e) for e in exits]  # t*_j passes per token
        else:
            predicted = [T * (len(e) - 1) + e[-1] for e in exits]  # T per token; the last stops at t*
        assert batch.stats.row_passes.tolist() == predicted
        # depth-mixed batching: no row waits for another, the batch takes the slowest row's passes
        assert batch.stats.passes == max(predicted) == len(batch.schedule.passes)
        assert batch.stats.tokens == int(batch.completion_lengths.sum())
        assert batch.stats.entries_computed == sum(p.entries() for p in batch.schedule.passes)
    assert deferred.stats.passes_per_token < dense.stats.passes_per_token
    assert deferred.stats.entries_computed < dense.stats.entries_computed
    assert deferred.stats.entries_pending > 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_deferred_never_computes_unneeded_steps(k):
    T = 3
    model = tiny_model(num_loops=T)
    batch_prompts = prompts([5, 3], seed=2)
    batch = NativeEngine(model).generate(batch_prompts, greedy("deferred", f"fixed:{k}", max_new_tokens=6))
    processed = sum(len(p) + int(n) - 1 for p, n in zip(batch_prompts, batch.completion_lengths))
    assert batch.stats.entries_computed == k * processed
    assert batch.stats.entries_pending == (T - k) * processed
    assert torch.isnan(batch.gate_probs[k:]).all() and not torch.isnan(batch.gate_probs[:k]).any()


def test_pending_entries_are_computed_when_a_later_token_needs_them():
    """Every pass's step-s work covers all positions from the row's step-s frontier to its decode token."""
    model = tiny_model(num_loops=4)
    batch = NativeEngine(model).generate(prompts([3, 6], seed=5), greedy("deferred", max_new_tokens=10))
    frontier = {}
    saw_pending = False
    for record in batch.schedule.passes:
        for row, start, end, step in record.work.tolist():
            assert start == frontier.get((row, step), 0)
            saw_pending |= end - start > 0 and start > 0
            frontier[(row, step)] = end + 1
    assert saw_pending


def test_same_seed_same_draws_under_both_schedules():
    """Counter-based draws: sampled tokens and sampled exits do not depend on the schedule."""
    engine = NativeEngine(tiny_model(gate_bias=0.0))
    batch_prompts = prompts([4, 1, 6])
    runs = [engine.generate(batch_prompts, SamplingParams(temperature=1.0, top_k=20, max_new_tokens=10, n=2,
                                                          seed=8, exit_policy="sample", schedule=schedule))
            for schedule in ("dense", "deferred")]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].exit_steps, runs[1].exit_steps)
    assert len(set(runs[1].exit_steps[runs[1].completion_mask].tolist())) > 2
    assert not torch.equal(runs[1].completion_ids[0], runs[1].completion_ids[1])  # group members differ


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_rows_of_one_prompt_share_its_prefill(schedule):
    T = 3
    model = tiny_model(num_loops=T)
    engine = NativeEngine(model)
    batch_prompts = prompts([6, 1, 4], seed=3)
    shared = engine.generate(batch_prompts, greedy(schedule, n=3))
    alone = engine.generate(batch_prompts, greedy(schedule))
    # the prompt's positions before the last are computed once per prompt (not per row) ...
    first = shared.schedule.passes[:T]
    assert [p.work[:, 3].tolist() for p in first] == [[s, s] for s in range(1, T + 1)]  # prompts 0 and 2
    assert first[-1].fork.tolist() == [[0, 1, 5], [0, 2, 5], [6, 7, 3], [6, 8, 3]]
    prefill_entries = T * (5 + 3)
    assert sum(p.entries() for p in first) == prefill_entries
    assert shared.stats.entries_computed < 3 * alone.stats.entries_computed
    # ... and every row decodes as it would alone
    for r in range(shared.num_rows):
        i = int(shared.prompt_index[r])
        assert shared.completion(r) == alone.completion(i)
        assert shared.exit_steps[r].tolist()[: len(alone.completion(i))] == alone.exit_steps[i].tolist()[
            : len(alone.completion(i))]
        torch.testing.assert_close(shared.logprobs[r, : len(alone.completion(i))],
                                   alone.logprobs[i, : len(alone.completion(i))], atol=2e-5, rtol=0)
    # rows waited T passes for the shared prefill
    assert shared.stats.row_passes.tolist() == [T + p for p in alone.stats.row_passes.repeat_interleave(3).tolist()]


def test_forward_packed_forward_and_rollout_passes_run_the_one_loop_step(monkeypatch):
    model = tiny_model(injection="scalar")
    calls = []
    step = type(model.model).step

    def counted(self, *args, **kwargs):
        calls.append(args[2])  # the step: an int, or one per item in a depth-mixed pass
        return step(self, *args, **kwargs)

    monkeypatch.setattr(type(model.model), "step", counted)
    T = model.config.num_loops
    ids = torch.tensor(prompts([6, 6], seed=1))
    score = torch.zeros_like(ids, dtype=torch.bool)
    score[:, 3:] = True
    with torch.no_grad():
        model(ids, use_cache=False)
        assert calls == list(range(1, T + 1))
        calls.clear()
        model(ids, attention_mask=torch.ones_like(ids), score_mask=score, pack=True)
        assert calls == list(range(1, T + 1))
        calls.clear()
    batch = NativeEngine(model).generate(prompts([5, 3]), greedy("deferred", max_new_tokens=6))
    assert len(calls) == len(batch.schedule.passes) > 0  # every pass is one call of the step
