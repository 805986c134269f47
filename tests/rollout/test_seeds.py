"""`rltt.rollout.seeds`, the one home of every seed and draw: the int and tensor SplitMix64 are one
function, the engines' row keys and uniforms are the seeds module's, and the values a run derives
are pinned (these were computed by the code before the seeds moved here: a change to any of them
changes every recorded rollout)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.rollout import seeds
from rltt.rollout.sampler import RowRandom
from rltt.vllm.row_exits import row_keys, uniforms_from_keys


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_int_and_tensor_mix64_are_one_function(x):
    got = int(seeds.mix64_tensor(torch.tensor([seeds.signed(x)], dtype=torch.long)))
    assert got & ((1 << 64) - 1) == seeds.mix64(x)


def test_pinned_seeds():
    assert seeds.rollout_seed(0, 1, 0, 0) == 7557061629226788251
    assert seeds.rollout_seed(2026, 7, 1, -1) == 2057395110459515298
    assert seeds.segment_seed(5, 3, 2) == seeds.rollout_seed(5, 3, 2, -2) == 7336508279489509968
    assert seeds.turn_seed(17, 1, 2) == 4567191446944590175
    random = RowRandom(9, "cpu", None, [3, 4], 2)
    assert random.host_keys.tolist() == [-4841935175369521001, 4001975050689820764, -6893182575793277493,
                                         -3008528286414149617]
    assert random.uniform([0, 3], [0, 5], RowRandom.EXIT, host=True).tolist() == [0.10297848599950588,
                                                                                  0.7008706843802878]


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=(1 << 62)), st.lists(st.integers(min_value=0, max_value=(1 << 63) - 1),
                                                               min_size=1, max_size=4), st.integers(1, 3))
def test_the_engines_draw_from_the_seeds_module(seed, prompt_seeds, n):
    """The native engine's `RowRandom` and the vLLM worker's keys and uniforms are `seeds`'s."""
    for per_prompt in (None, prompt_seeds):
        rows = len(prompt_seeds) * n
        random = RowRandom(seed, "cpu", rows, per_prompt, n)
        keys = seeds.row_keys(seed, rows, per_prompt, n)
        assert torch.equal(random.host_keys, keys) and row_keys(seed, rows, per_prompt, n) == keys.tolist()
        counters = torch.arange(rows) * 3
        for stream in (seeds.TOKEN, seeds.EXIT):
            want = seeds.uniforms(keys, counters, stream)
            assert torch.equal(random.uniform(list(range(rows)), counters, stream), want)
            assert torch.equal(uniforms_from_keys(keys, counters, stream), want)
            assert bool(((want >= 0) & (want < 1)).all())
