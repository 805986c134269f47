"""Counter-based random draws and inverse-CDF token sampling."""

import math

import torch

from rltt.rollout import SamplingParams
from rltt.rollout.sampler import RowRandom, sample_tokens


def test_uniforms_are_a_pure_function_of_seed_row_counter_and_stream():
    a, b = RowRandom(5), RowRandom(5)
    rows, counters = torch.arange(8).repeat(4), torch.arange(4).repeat_interleave(8)
    u = a.uniform(rows, counters, RowRandom.TOKEN)
    assert torch.equal(u, b.uniform(rows, counters, RowRandom.TOKEN))
    # the same (row, counter) in any order or batch gives the same value
    assert torch.equal(a.uniform(rows.flip(0), counters.flip(0), RowRandom.TOKEN), u.flip(0))
    assert torch.equal(a.uniform([3], [2], RowRandom.TOKEN), u[(counters == 2) & (rows == 3)])
    assert len(set(u.tolist())) == u.numel()
    assert not torch.equal(u, a.uniform(rows, counters, RowRandom.EXIT))
    assert not torch.equal(u, RowRandom(6).uniform(rows, counters, RowRandom.TOKEN))


def test_uniforms_are_uniform():
    n = 200_000
    u = RowRandom(0).uniform(torch.arange(n) % 97, torch.arange(n) // 97, RowRandom.EXIT)
    assert u.dtype == torch.float64 and float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    expected = n / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50, chi2  # 19 degrees of freedom: p < 1e-4 at 43.8
    assert abs(float(u.mean()) - 0.5) < 3 / math.sqrt(12 * n) * 3


def test_inverse_cdf_sampling_follows_the_tempered_distribution_and_respects_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(60_000, -1)
    random = RowRandom(1)
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
