"""The attention implementations of the native engine's passes: a table ``{name: AttentionSpec}``.

``rollout.attention`` (`NativeEngine(attention=...)`) names one; its allowed values are this
table's keys. Both write each item's keys and values into the cache the same way (one
``index_copy_`` each, `rltt.rollout.kv_cache.GroupedAttend.write_rows_of`; a captured Triton pass
copies the same bits with one launch of its own) and differ in how they read it:

- ``sdpa`` (default): `GroupedAttend`, one ``scaled_dot_product_attention`` call per attention
  group of the pass (single-token entries, multi-token entries), the keys of entries at different
  loop steps gathered first (`rltt.rollout.kv_cache.layout_groups`).
- ``triton``: `SlotAttend`, one launch of `rltt.kernels.slot_attention` per layer for all the
  pass's items, reading each item's cache slot in place (no gather). Needs Triton, and CUDA or
  Triton's interpreter (``TRITON_INTERPRET=1``, CPU, slow: tests only). With CUDA graphs a
  bucketed pass is captured whole, its writes and attention launches included
  (`rltt.rollout.buckets.PassBuckets`; the sdpa attention runs eagerly between captured pieces).

A rollout records the implementation it ran (`Schedule.attention`) and `replay_logprobs` replays
with it, so replay stays bitwise under either. The two agree within floating-point tolerance,
not bit for bit (different summation orders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rltt.rollout.kv_cache import GroupedAttend, SlotAttend


def _triton_missing(device: torch.device) -> str | None:
    """Why the Triton attention cannot run on ``device`` (None: it can)."""
    from rltt.kernels.dispatch import triton_installed, triton_interpreting

    if not triton_installed():
        return "triton needs the triton package (pip install 'rltt[triton]'); use sdpa"
    if device.type != "cuda" and not triton_interpreting():
        return (f"triton needs a CUDA device, the model is on {device.type} (TRITON_INTERPRET=1 runs it on CPU); "
                "use sdpa")
    return None


#: ``rollout.attention``'s default, written once (the recipe, the engine, a schedule record, the plan)
DEFAULT_ATTENTION = "sdpa"


@dataclass(frozen=True)
class AttentionSpec:
    """An attention implementation. ``name``: its key in `ATTENTION` (what a `Schedule` records);
    ``grouped``: the pass plan lays out SDPA groups (`layout_groups`); else it derives each item's
    cache slot and position. ``attend(cache, plan, scale)``: the pass's ``attend`` callable.
    ``missing(device)``: why it cannot run there, or None."""

    name: str
    grouped: bool
    attend: Callable
    missing: Callable[[torch.device], str | None]


ATTENTION: dict[str, AttentionSpec] = {
    "sdpa": AttentionSpec("sdpa", grouped=True, missing=lambda device: None,
                          attend=lambda cache, plan, scale: GroupedAttend(cache, plan.groups, plan.write_rows, scale)),
    "triton": AttentionSpec("triton", grouped=False, missing=_triton_missing,
                            attend=lambda cache, plan, scale: SlotAttend(cache, plan.write_rows, plan.item_slots,
                                                                         plan.item_pos, scale)),
}


def resolve_attention(name: str, device: torch.device | str, key: str = "rollout.attention") -> AttentionSpec:
    """The table's entry for ``name``; a one-line recipe error (naming ``key``) when it is unknown or
    cannot run on ``device``."""
    from rltt.config import recipe_error

    spec = ATTENTION.get(name)
    if spec is None:
        raise recipe_error(key, f"must be one of {' | '.join(ATTENTION)}, got {name!r}")
    why = spec.missing(torch.device(device))
    if why is not None:
        raise recipe_error(key, why)
    return spec


@dataclass(frozen=True)
class PassSetup:
    """How an engine's passes run, resolved once and handed to every executor it makes: its
    attention implementation and its CUDA-graph buckets (`rltt.rollout.buckets.PassBuckets`; None:
    every pass unpadded). A replay builds the one its record names (`replay_logprobs`)."""

    attention: AttentionSpec
    buckets: object | None = None

    @classmethod
    def of(cls, attention: "str | AttentionSpec" = DEFAULT_ATTENTION, device: torch.device | str = "cpu",
           buckets=None) -> "PassSetup":
        """``attention`` resolved for ``device`` (a one-line recipe error when it cannot run there)."""
        spec = attention if isinstance(attention, AttentionSpec) else resolve_attention(attention, device)
        return cls(spec, buckets)
