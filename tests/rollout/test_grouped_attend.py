"""`GroupedAttend`: every entry attends to its own row's keys at its step, positions ≤ its own —
whether the group reads the step's cache as a view with padded queries (most rows present),
gathers its rows' slots (few rows, or mixed steps), or mixes single- and multi-token entries."""

import pytest
import torch
import torch.nn.functional as F

from rltt.rollout.kv_cache import GroupedAttend, StepKVCache, plan_groups

R, T, L, D, HKV, NREP = 6, 3, 12, 8, 1, 2


def reference(cache, q, rows, starts, ends, steps, scale):
    """One SDPA call per (row, position): the definition."""
    outs, item = [], 0
    for r, s, e, st in zip(rows, starts, ends, steps):
        for p in range(s, e + 1):
            k = cache.keys[0][st - 1, r, :, : p + 1].repeat_interleave(NREP, 0)  # (Hq, p+1, D)
            v = cache.values[0][st - 1, r, :, : p + 1].repeat_interleave(NREP, 0)
            outs.append(F.scaled_dot_product_attention(q[item][:, None], k, v, scale=scale)[:, 0])
            item += 1
    return torch.stack(outs)


@pytest.mark.parametrize("rows,starts,ends,steps,padded", [
    ([0, 2, 3, 5], [4, 6, 3, 7], [4, 6, 3, 7], [2, 2, 2, 2], True),  # most rows, one step: the view
    ([1, 4], [5, 2], [5, 2], [3, 3], False),  # few rows: gathered
    ([0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7], [1, 2, 1, 3], False),  # mixed steps: gathered
    ([0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7], [2] * 6, False),  # every row: the view, unpadded
    ([0, 2, 3, 5], [1, 6, 3, 4], [4, 6, 3, 7], [2, 2, 2, 2], False),  # multi-token entries beside single ones
])
def test_grouped_attention_equals_per_entry_attention(rows, starts, ends, steps, padded):
    torch.manual_seed(0)
    cache = StepKVCache(1, T, R, HKV, L, D, torch.float32, torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    groups = plan_groups(rows, starts, ends, steps, R, NREP, torch.device("cpu"))
    assert any(g.pad_rows is not None for g in groups) == padded
    item_rows = torch.tensor([r for r, s, e in zip(rows, starts, ends) for _ in range(s, e + 1)])
    item_pos = torch.tensor([p for s, e in zip(starts, ends) for p in range(s, e + 1)])
    item_steps = torch.tensor([st for st, s, e in zip(steps, starts, ends) for _ in range(s, e + 1)])
    n = len(item_rows)
    q, k, v = torch.randn(n, HKV * NREP, 1, D), torch.randn(n, HKV, 1, D), torch.randn(n, HKV, 1, D)
    attend = GroupedAttend(cache, groups, GroupedAttend.write_rows_of(cache, item_rows, item_pos, item_steps),
                           D ** -0.5)
    got = attend(q, k, v, 0)[:, :, 0]  # writes the items' k/v, then attends
    for i in range(n):  # the writes landed at (step, row, position)
        assert torch.equal(cache.keys[0][item_steps[i] - 1, item_rows[i], :, item_pos[i]], k[i, :, 0])
    want = reference(cache, q[:, :, 0], rows, starts, ends, steps, D ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
