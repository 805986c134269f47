"""Prefix-shared, unpadded score mode: each distinct prompt is computed once per call.

An RL batch holds G completions of every prompt. The padded score forward runs every row's
prompt again (G times) and every row up to the longest row (padding). `PackedLayout` instead
lays the call's tokens out once each — the distinct prefixes (positions before a row's first
scored token), then every row's own suffix — as one packed sequence of N tokens. Projections,
MLPs, norms and the exit gate run over those N tokens only; attention runs in two padded
parts with masks:

- prefix part, one row per distinct prefix: causal over the prefix;
- suffix part, one row per sequence: keys are the row's prefix (shared, gathered from the
  prefix tokens) followed by the row's own suffix, causal.

It is the same function as the padded forward (every position sees exactly the keys it sees
there, at the same RoPE positions), so log-probs agree to floating-point rounding and
gradients flow to the shared prefix from all the rows that use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltt.model.layers import additive_mask, sdpa


@dataclass
class _Part:
    q_idx: torch.Tensor  # (R, Wq) packed index of each query slot (padding: any index, see below)
    k_idx: torch.Tensor  # (R, Wk) packed index of each key slot (padding: any index, see below)
    mask: torch.Tensor  # (R, 1, Wq, Wk) bool, True = attend


@dataclass
class PackedLayout:
    """Where the tokens of a right-padded (B, S) batch sit in the packed sequence."""

    input_ids: torch.Tensor  # (N,) packed token ids
    positions: torch.Tensor  # (N,) RoPE positions
    packed_of: torch.Tensor  # (B, S) packed index of each (row, position); N at padding
    parts: tuple[_Part, _Part]  # prefix part, suffix part
    back_idx: torch.Tensor  # (N,) row of each packed token in cat(prefix out, suffix out) flattened
    num_prefixes: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @staticmethod
    def build(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              score_mask: torch.Tensor) -> "PackedLayout | None":
        """The layout, or None when the batch is not right-padded (the caller then runs the
        padded forward)."""
        device = input_ids.device
        B, S = input_ids.shape
        if attention_mask is None:
            lengths = torch.full((B,), S, dtype=torch.long)
        else:
            am = attention_mask.bool().cpu()
            lengths = am.sum(-1)
            if not torch.equal(am, torch.arange(S)[None, :] < lengths[:, None]):
                return None
        if B == 0 or bool((lengths == 0).any()):
            return None
        scored = score_mask.bool().cpu()
        ids_cpu = input_ids.cpu()
        any_scored = scored.any(-1)
        first = torch.where(any_scored, scored.int().argmax(-1), lengths)
        # inputs needed: positions before the last scored one (the last token's own state predicts nothing)
        lengths = torch.where(any_scored, S - 1 - scored.flip(-1).int().argmax(-1), lengths)
        prefix_len = torch.minimum(first, lengths).clamp_min(1)  # position 0 is never scored
        suffix_len = lengths - prefix_len

        # distinct prefixes, in order of first appearance
        keys: dict[tuple, int] = {}
        owner = []
        for b in range(B):
            owner.append(keys.setdefault(tuple(ids_cpu[b, : prefix_len[b]].tolist()), len(keys)))
        U = len(keys)
        owner_t = torch.tensor(owner)
        rep = torch.zeros(U, dtype=torch.long)
        rep[owner_t.flip(0)] = torch.arange(B).flip(0)  # first row of each prefix
        p_u = prefix_len[rep]
        prefix_base = torch.cumsum(p_u, 0) - p_u
        n_prefix = int(p_u.sum())
        suffix_base = n_prefix + torch.cumsum(suffix_len, 0) - suffix_len
        N = n_prefix + int(suffix_len.sum())

        pos = torch.arange(S)[None, :]
        in_prefix = pos < prefix_len[:, None]
        valid = pos < lengths[:, None]
        packed_of = torch.where(in_prefix, prefix_base[owner_t][:, None] + pos,
                                suffix_base[:, None] + pos - prefix_len[:, None])
        packed_of = torch.where(valid, packed_of, torch.full_like(packed_of, N))

        flat_ids = torch.zeros(N + 1, dtype=torch.long)
        flat_pos = torch.zeros(N + 1, dtype=torch.long)
        # every valid (row, position) writes its token/position; shared prefix slots get equal values
        flat_ids[packed_of[valid]] = ids_cpu[valid]
        flat_pos[packed_of[valid]] = pos.expand(B, S)[valid]

        prefix = _prefix_part(prefix_base, p_u, N)
        suffix = _suffix_part(suffix_base, suffix_len, prefix.q_idx[owner_t], prefix_len, N)
        pre_q, suf_q = prefix.q_idx, suffix.q_idx
        U, Pmax = pre_q.shape
        Cmax = suf_q.shape[1]

        back = torch.zeros(N, dtype=torch.long)
        pv = pre_q < N
        back[pre_q[pv]] = torch.arange(U * Pmax).view(U, Pmax)[pv]
        sv = suf_q < N
        back[suf_q[sv]] = U * Pmax + torch.arange(B * Cmax).view(B, Cmax)[sv]

        def dev(t):
            return t.to(device)

        def gather_index(t):
            # padding slots read token 0: a padding key is masked out for every real query, and a
            # padding query's output is never read back, so what they hold does not matter
            return dev(torch.where(t == N, torch.zeros_like(t), t))

        return PackedLayout(
            input_ids=dev(flat_ids[:N]), positions=dev(flat_pos[:N]), packed_of=dev(packed_of),
            parts=tuple(_Part(gather_index(p.q_idx), gather_index(p.k_idx), dev(p.mask)) for p in (prefix, suffix)),
            back_idx=dev(back), num_prefixes=U,
        )


def _prefix_part(base: torch.Tensor, length: torch.Tensor, pad: int) -> _Part:
    """One attention row per distinct prefix u (``length[u]`` tokens from packed index
    ``base[u]``): causal over the prefix; padding query slots attend to key 0 only (no row is
    fully masked, so no NaN reaches the backward)."""
    U, width = length.shape[0], int(length.max())
    j = torch.arange(width)
    q_idx = torch.where(j[None, :] < length[:, None], base[:, None] + j[None, :], torch.full((U, width), pad))
    query, key = j[:, None], j[None, :]
    valid_query = query[None] < length[:, None, None]
    mask = torch.where(valid_query, key[None] <= query[None], (key == 0)[None].expand(U, width, width))
    return _Part(q_idx, q_idx, mask[:, None])


def _suffix_part(base: torch.Tensor, length: torch.Tensor, own_prefix: torch.Tensor, prefix_len: torch.Tensor,
                 pad: int) -> _Part:
    """One attention row per sequence b (``length[b]`` suffix tokens from packed index ``base[b]``):
    keys are the row's prefix (``own_prefix`` (B, Pmax) packed indices, its first ``prefix_len[b]``
    valid) then its own suffix, causal; padding query slots attend to key 0 only."""
    B, Pmax = own_prefix.shape
    width = max(int(length.max()), 1)
    c, j = torch.arange(width), torch.arange(Pmax)
    q_idx = torch.where(c[None, :] < length[:, None], base[:, None] + c[None, :], torch.full((B, width), pad))
    own_prefix = torch.where(j[None, :] < prefix_len[:, None], own_prefix, torch.full_like(own_prefix, pad))
    k_idx = torch.cat([own_prefix, q_idx], 1)  # (B, Pmax + width)
    valid_query = c[None, :, None] < length[:, None, None]  # (B, width, 1)
    key_prefix = j[None, None, :] < prefix_len[:, None, None]  # (B, 1, Pmax)
    key_suffix = c[None, None, :] <= c[None, :, None]  # (1, width, width)
    attend = torch.cat([key_prefix.expand(B, width, Pmax), key_suffix.expand(B, width, width)], -1)
    first_key = torch.zeros(Pmax + width, dtype=torch.bool)
    first_key[0] = True
    mask = torch.where(valid_query, attend, first_key[None, None, :])
    return _Part(q_idx, k_idx, mask[:, None])


class PackedAttend:
    """``attend(q, k, v, layer)`` over a packed sequence: q (1, Hq, N, D), k/v (1, Hkv, N, D).

    The parts' bool masks become additive masks (0 / −inf in ``dtype``, what SDPA makes of a bool
    mask) once per forward, not in each of the L·T attention calls."""

    def __init__(self, layout: PackedLayout, scale: float, dtype: torch.dtype = torch.float32):
        self.layout, self.scale = layout, scale
        self.masks = [additive_mask(p.mask, dtype) for p in layout.parts]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
        qf, kf, vf = (x[0].transpose(0, 1) for x in (q, k, v))  # (N, H, D)

        def rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            # x[index] as one index_select (its backward is one index_add_): (R, W, H, D) → (R, H, W, D)
            return x.index_select(0, index.flatten()).view(*index.shape, *x.shape[1:]).transpose(1, 2)

        outs = []
        for part, mask in zip(self.layout.parts, self.masks):
            Q = rows(qf, part.q_idx)  # (R, Hq, Wq, D)
            K, V = rows(kf, part.k_idx), rows(vf, part.k_idx)
            out = sdpa(Q, K, V, mask, False, self.scale)  # (R, Hq, Wq, D)
            outs.append(out.transpose(1, 2).flatten(0, 1))  # (R·Wq, Hq, D)
        out = torch.cat(outs).index_select(0, self.layout.back_idx)  # (N, Hq, D)
        return out.transpose(0, 1)[None]
