"""`exit_logprob`: log p_{t*} of the recorded exit under the survival exit distribution of the gates."""

import math

import pytest
import torch

from rltt.model.exits import exit_distribution, exit_logprob


def test_against_a_hand_computation_and_the_exit_distribution():
    gates = torch.tensor([0.2, 0.5, 0.9])[:, None]  # T = 3, one token: p = (0.2, 0.4, 0.4); λ_3 unused
    for step, p in ((1, 0.2), (2, 0.4), (3, 0.4)):
        assert exit_logprob(gates, torch.tensor([step])).item() == pytest.approx(math.log(p), rel=1e-6)
    g = torch.rand(4, 3, 5)
    steps = torch.randint(1, 5, (3, 5))
    want = exit_distribution(g).log().gather(0, (steps - 1)[None]).squeeze(0)
    assert torch.equal(exit_logprob(g, steps), want)


def test_needs_only_the_gates_up_to_the_exit_and_zeroes_what_is_not_a_token():
    g = torch.rand(4, 2, 3)
    steps = torch.tensor([[1, 3, 4], [2, 0, 2]])  # 0: a forced token (no exit)
    full = exit_logprob(g, steps)
    deferred = g.clone()
    for r in range(2):
        for j in range(3):
            deferred[max(int(steps[r, j]), 1):, r, j] = float("nan")  # steps after t* never computed
    assert torch.equal(exit_logprob(deferred, steps), torch.where(steps > 0, full, torch.zeros_like(full)))
    assert exit_logprob(deferred, steps)[1, 1] == 0.0
    mask = torch.tensor([[True, False, True], [True, True, False]])
    masked = exit_logprob(deferred, steps, mask)
    assert masked[0, 1] == 0.0 and masked[1, 2] == 0.0 and masked[0, 0] == full[0, 0]
