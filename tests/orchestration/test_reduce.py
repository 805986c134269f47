"""The one cross-rank reduction: `combine` against hand computations, `reduce_ranks` in one process."""

import pytest
import torch

from rltt.runtime.distributed import Ranks, combine, reduce_ranks


def test_combine_each_op_by_hand():
    parts = [{"n": 2, "x": 1.0, "hi": 0.5, "lo": 0.5, "rows": [1, 2], "t": torch.tensor([[1.0, 2.0]]), "d": {"a": 1}},
             {"n": 3, "x": 4.0, "hi": 2.5, "lo": -1.0, "rows": [3], "t": torch.tensor([[3.0, 4.0]]), "d": {"b": 2}},
             {"n": 5, "x": 7.0, "hi": 1.0, "lo": 0.0, "rows": [], "t": torch.zeros((0, 2)), "d": {}}]
    ops = {"n": "sum", "x": "mean", "hi": "max", "lo": "min", "rows": "concat", "t": "concat", "d": "concat"}
    out = combine(parts, ops)
    assert out["n"] == 10 and isinstance(out["n"], int)
    assert out["x"] == pytest.approx((1.0 + 4.0 + 7.0) / 3)
    assert (out["hi"], out["lo"]) == (2.5, -1.0)
    assert out["rows"] == [1, 2, 3]  # rank order
    assert torch.equal(out["t"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert out["d"] == {"a": 1, "b": 2}


def test_combine_needs_an_op_for_every_key_and_the_same_keys_everywhere():
    with pytest.raises(ValueError, match="'y'"):
        combine([{"x": 1, "y": 2}], {"x": "sum"})
    with pytest.raises(ValueError, match="op"):
        combine([{"x": 1}], "median")
    with pytest.raises(ValueError, match="keys differ"):
        combine([{"x": 1}, {"z": 1}], "sum")


def test_one_process_reduction_is_the_identity():
    values = {"n": 4, "x": 0.25, "rows": [7], "t": torch.arange(3)}
    ops = {"n": "sum", "x": "mean", "rows": "concat", "t": "concat"}
    for out in (reduce_ranks(values, ops, world=1), Ranks().reduce(values, ops)):
        assert out["n"] == 4 and out["x"] == 0.25 and out["rows"] == [7] and torch.equal(out["t"], torch.arange(3))
