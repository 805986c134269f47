"""Counter-based random draws and inverse-CDF token sampling."""

import math
from dataclasses import replace

import torch

from rltt.rollout import SamplingParams
from rltt.rollout.sampler import RowRandom, sample_tokens


def test_uniforms_are_a_pure_function_of_seed_row_counter_and_stream():
    a, b = RowRandom(5, num_rows=8), RowRandom(5, num_rows=8)
    rows, counters = torch.arange(8).repeat(4), torch.arange(4).repeat_interleave(8)
    u = a.uniform(rows, counters, RowRandom.TOKEN)
    assert torch.equal(u, b.uniform(rows, counters, RowRandom.TOKEN))
    # the same (row, counter) in any order or batch gives the same value
    assert torch.equal(a.uniform(rows.flip(0), counters.flip(0), RowRandom.TOKEN), u.flip(0))
    assert torch.equal(a.uniform([3], [2], RowRandom.TOKEN), u[(counters == 2) & (rows == 3)])
    assert len(set(u.tolist())) == u.numel()
    assert not torch.equal(u, a.uniform(rows, counters, RowRandom.EXIT))
    assert not torch.equal(u, RowRandom(6, num_rows=8).uniform(rows, counters, RowRandom.TOKEN))


def test_uniforms_are_uniform():
    n = 200_000
    u = RowRandom(0, num_rows=97).uniform(torch.arange(n) % 97, torch.arange(n) // 97, RowRandom.EXIT)
    assert u.dtype == torch.float64 and float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    expected = n / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50, chi2  # 19 degrees of freedom: p < 1e-4 at 43.8
    assert abs(float(u.mean()) - 0.5) < 3 / math.sqrt(12 * n) * 3


def test_inverse_cdf_sampling_follows_the_tempered_distribution_and_respects_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(60_000, -1)
    random = RowRandom(1, num_rows=60_000)
    u = random.uniform(torch.arange(60_000), torch.zeros(60_000, dtype=torch.long), RowRandom.TOKEN)
    params = SamplingParams(temperature=0.7, max_new_tokens=1)
    tokens = sample_tokens(logits, params, u)
    freq = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    expected = torch.softmax(logits[0].double() / 0.7, -1)
    assert float((freq - expected).abs().max()) < 0.01
    top2 = sample_tokens(logits, SamplingParams(temperature=1.0, top_k=2, max_new_tokens=1), u)
    assert set(top2.tolist()) == {0, 1}
    edge = sample_tokens(logits[:3], SamplingParams(temperature=1.0, top_k=2, max_new_tokens=1),
                         torch.tensor([0.0, 1 - 2.0**-53, 0.5], dtype=torch.float64))
    assert edge.tolist()[:2] == [0, 1]


def test_prompt_seeds_key_rows_by_prompt_and_sample_index():
    batched = RowRandom(0, num_rows=6, prompt_seeds=[11, 22, 33], n=2)
    for i, seed in enumerate([11, 22, 33]):
        alone = RowRandom(seed, num_rows=2)
        counters = torch.tensor([0, 5])
        for j in range(2):
            assert torch.equal(batched.uniform([2 * i + j] * 2, counters, RowRandom.TOKEN),
                               alone.uniform([j] * 2, counters, RowRandom.TOKEN))


def test_a_prompt_samples_the_same_completions_alone_or_batched_with_prompt_seeds():
    from rltt.rollout import NativeEngine

    from .helpers import prompts, tiny_model

    engine = NativeEngine(tiny_model())
    batch_prompts = prompts([4, 7, 2], seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, exit_policy="sample")
    together = engine.generate(batch_prompts, replace(params, prompt_seeds=[101, 202, 303]))
    for i, seed in enumerate([101, 202, 303]):
        alone = engine.generate([batch_prompts[i]], replace(params, seed=seed))
        for j in range(3):
            assert together.completion(3 * i + j) == alone.completion(j)
            n = len(alone.completion(j))
            assert together.exit_steps[3 * i + j, :n].tolist() == alone.exit_steps[j, :n].tolist()
    assert len({tuple(together.completion(r)) for r in range(9)}) > 3  # samples differ


def test_prompt_seeds_must_match_the_prompts():
    import pytest

    from rltt.errors import RlttError
    from rltt.rollout import NativeEngine

    from .helpers import prompts, tiny_model

    engine = NativeEngine(tiny_model())
    with pytest.raises(RlttError, match="prompt_seeds: 1 seeds for 2 prompts"):
        engine.generate(prompts([3, 4]), SamplingParams(max_new_tokens=2, prompt_seeds=[1]))
    with pytest.raises(RlttError, match="SamplingParams.prompt_seeds"):
        engine.generate(prompts([3]), SamplingParams(max_new_tokens=2, prompt_seeds=["x"]))
