"""Token sampling, sampling log-probs and online exit decisions.

Exit decisions are made step by step, from the gate probabilities computed so far, so a
token exits without computing deeper steps (docs/design.md §1.8):

- ``final`` / ``fixed:k``: t* = T / k, known upfront;
- ``threshold:q``: exit at the first t with CDF_t ≥ q (else T) — the CDF is computed with
  `rltt.model.exit_distribution` exactly as `ExitPolicy.choose` does, on the prefix of gates;
- ``sample``: draw u ~ U[0, 1) once per token and exit at the first t with CDF_t > u (else T):
  inverse-CDF sampling of t* ~ p.

Randomness is counter-based (`RowRandom`, over `rltt.rollout.seeds`): the uniform behind row r's
j-th token (and the one behind its exit) is a hash of (seed, r, j, stream), computed for all rows of a pass in one
vectorised op on the model's device. So a row's draws do not depend on the batch, the
schedule or the order of passes — `dense` and `deferred` with the same seed make the same
draws — and sampling needs no per-row generator calls and no copy of the logits to the CPU.
"""

from __future__ import annotations

import torch

from rltt.model.exits import ExitPolicy, exit_distribution
from rltt.rollout.params import SamplingParams
from rltt.rollout.seeds import EXIT, TOKEN, row_keys, uniforms


class RowRandom:
    """Counter-based uniforms: ``uniform(rows, counters, stream)`` is a pure function of the
    row's key, the counter and the stream, in [0, 1) with 53 random bits, on ``device``.

    A row's key comes from (seed, row) — or, with per-prompt seeds, from (prompt seed, the row's
    sample index within its prompt), so a prompt's samples do not depend on which other prompts
    share the call (one prompt per call with ``seed=s`` draws what ``prompt_seeds=[s]`` draws)."""

    TOKEN, EXIT = TOKEN, EXIT  # streams

    def __init__(self, seed: int, device: torch.device | str = "cpu", num_rows: int | None = None,
                 prompt_seeds: list[int] | None = None, n: int = 1):
        self.device = torch.device(device)
        self.host_keys = row_keys(seed, num_rows, prompt_seeds, n)  # (R,) on the host
        self.keys = self.host_keys.to(self.device)

    def take(self, start: int, end: int) -> "RowRandom":
        """The draws of rows ``start..end-1`` as rows ``0..``: a chunk of a call's rows keeps the
        keys the whole call gives them (with a call seed, a row's key is its index in the call)."""
        out = object.__new__(RowRandom)
        out.device, out.keys, out.host_keys = self.device, self.keys[start:end], self.host_keys[start:end]
        return out

    def slots(self, num: int) -> "RowRandom":
        """Keys for ``num`` (at most this one's rows) slots of a decode loop: a copy of the first rows', each
        slot taking the key of the row it holds (`assign`)."""
        if num > len(self.host_keys):
            raise ValueError(f"RowRandom.slots: {num} slots for {len(self.host_keys)} rows")
        out = self.take(0, num)
        out.keys, out.host_keys = out.keys.clone(), out.host_keys.clone()
        return out

    def assign(self, slot: int, source: "RowRandom", row: int) -> None:
        """Slot ``slot`` draws from now on what row ``row`` of ``source`` draws."""
        self.keys[slot] = source.keys[row]
        self.host_keys[slot] = source.host_keys[row]

    def rekey(self, slots: list[int], fresh: "RowRandom") -> None:
        """Slots ``slots`` draw from now on what rows ``0..`` of ``fresh`` draw (a turn's own seeds)."""
        index = torch.tensor(slots, dtype=torch.long)
        self.host_keys[index] = fresh.host_keys
        self.keys[index.to(self.keys.device)] = fresh.keys

    def uniform(self, rows, counters, stream: int, host: bool = False) -> torch.Tensor:
        """The uniforms of ``rows`` at ``counters`` (lists or int64 tensors on the keys' device);
        ``host``: computed on the host from lists (integer arithmetic: the same values)."""
        keys = self.host_keys if host else self.keys
        rows = torch.as_tensor(rows, dtype=torch.long, device=keys.device)
        counters = torch.as_tensor(counters, dtype=torch.long, device=keys.device)
        return uniforms(keys[rows], counters, stream)


class ExitDecider:
    """Decides, after a token's step t is computed, whether it exits there."""

    def __init__(self, policy: ExitPolicy, num_loops: int, random: RowRandom, num_rows: int):
        self.policy, self.num_loops, self.random = policy, num_loops, random
        self.uniform = torch.zeros(num_rows, dtype=torch.float64)  # u of each row's current token (sample policy)

    def start_tokens(self, rows: list[int], token_index: list[int]) -> None:
        """Rows beginning their ``token_index``-th token: draw its u (sample policy only)."""
        if self.policy.kind == "sample" and rows:  # on the host, where the decisions are made: no read
            self.uniform[torch.tensor(rows)] = self.random.uniform(rows, token_index, RowRandom.EXIT, host=True)

    def exits(self, rows: list[int], step: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        """Bool (n,): does the decode token of each row exit at ``step`` (n,)?

        ``gates`` (T, n) fp32 holds λ_1..λ_step of each token (later entries are ignored); the
        ``final`` and ``fixed`` policies do not read it (None)."""
        kind = self.policy.kind
        if kind == "final":
            return step == self.num_loops
        if kind == "fixed":
            return step == int(self.policy.value)
        steps = torch.arange(1, self.num_loops + 1)[:, None]
        lam = torch.where(steps <= step[None], torch.nan_to_num(gates), torch.zeros_like(gates))
        cdf = torch.cumsum(exit_distribution(lam), dim=0).gather(0, (step - 1)[None])[0]
        if kind == "threshold":
            reached = cdf >= float(self.policy.value)
        else:
            reached = cdf > self.uniform[rows]
        return reached | (step == self.num_loops)


NO_FLOOR = -1  # `kept_floor` of a token drawn from the whole vocabulary (nothing truncated)


def kept_floor(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The kept set of top-k/top-p on tempered ``scores`` (k, V) fp32, as its *floor*: per row the
    id of a kept token with the lowest score, or `NO_FLOOR` when every token is kept.

    The kept set is exactly ``{i : scores[i] >= scores[floor]}`` (ties at the boundary are kept):
    top-k keeps the scores at least the k-th largest; top-p, on what top-k kept, keeps the tokens
    whose probability mass before them (in descending order, renormalised over the top-k set) is
    below ``top_p``, and then every token scoring at least as high as the lowest of those."""
    rows, vocab = scores.shape
    none = torch.full((rows,), NO_FLOOR, dtype=torch.long, device=scores.device)
    if not truncates(params, vocab):
        return none
    if params.top_k and params.top_k < vocab:
        top = torch.topk(scores, params.top_k, dim=-1)
        threshold, floor = top.values[:, -1], top.indices[:, -1]
    else:
        threshold = torch.full((rows,), float("-inf"), dtype=scores.dtype, device=scores.device)
        floor = none
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores.masked_fill(scores < threshold[:, None], float("-inf")),
                                          dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        keep = (probs.cumsum(-1) - probs) < params.top_p  # the mass before the token is below p
        keep[:, 0] = True
        lowest = torch.where(keep, sorted_scores, float("inf")).amin(-1)
        last = torch.where(keep & (sorted_scores == lowest[:, None]), torch.arange(vocab, device=scores.device),
                           vocab).amin(-1)
        tighter = lowest > threshold
        threshold = torch.where(tighter, lowest, threshold)
        floor = torch.where(tighter, order.gather(1, last[:, None])[:, 0], floor)
    everything = (scores >= threshold[:, None]).all(-1)
    return torch.where(everything, none, floor)


def truncates(params: SamplingParams, vocab: int) -> bool:
    """Whether ``params`` sample from a truncated distribution (top-k below the vocabulary or
    top-p below 1, not greedy)."""
    return not params.greedy and (params.top_p < 1.0 or 0 < params.top_k < vocab)


def kept_scores(scores: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """``scores`` (k, V) with the tokens outside each row's kept set (`kept_floor`) at -inf; rows
    with `NO_FLOOR` unchanged."""
    at = scores.gather(1, floor.clamp_min(0)[:, None])
    threshold = torch.where(floor[:, None] >= 0, at, torch.full_like(at, float("-inf")))
    return scores.masked_fill(scores < threshold, float("-inf"))


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                floor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, tempered) fp32 log-probs of ``tokens`` (k,) under fp32 ``logits`` (k, V).

    raw: ``log_softmax(logits)``, the model's distribution; tempered: the distribution the token
    was drawn from — ``log_softmax(logits / temperature)`` renormalised over the kept set of
    top-k/top-p (``floor`` (k,), `kept_floor`; None or `NO_FLOOR` rows: the whole vocabulary).
    Greedy (temperature 0): tempered = raw.

    No host-device sync: a ``floor`` is applied as given (`kept_scores` leaves `NO_FLOOR` rows'
    scores as they are, so their log-probs have the same bits as without it); pass None when
    nothing can be truncated."""
    index = tokens[:, None]
    raw = torch.log_softmax(logits, dim=-1).gather(1, index)[:, 0]
    if temperature == 0 or (temperature == 1 and floor is None):
        return raw, raw.clone()
    scores = logits / temperature if temperature != 1 else logits
    if floor is not None:
        scores = kept_scores(scores, floor)
    tempered = torch.log_softmax(scores, dim=-1).gather(1, index)[:, 0]
    return raw, tempered


def sample_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None) -> torch.Tensor:
    """Next tokens (k,) from fp32 ``logits`` (k, V): argmax when greedy, else temperature, top-k,
    top-p, then inverse-CDF sampling with row i's uniform ``uniforms[i]`` (float64, [0, 1))."""
    return sample(logits, params, uniforms)[0]


def sample(logits: torch.Tensor, params: SamplingParams,
           uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens (k,), floor (k,))``: `sample_tokens` and the kept set each token was drawn from
    (`kept_floor`; `NO_FLOOR` when greedy or nothing was truncated)."""
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.full_like(tokens, NO_FLOOR)
    scores = logits / params.temperature
    floor = kept_floor(scores, params)
    if truncates(params, scores.shape[-1]):
        scores = kept_scores(scores, floor)
    cdf = torch.softmax(scores, dim=-1, dtype=torch.float64).cumsum(-1)
    # the first token whose CDF exceeds u·total: never a token of probability 0 (its CDF equals its predecessor's)
    point = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, point, right=True)[:, 0].clamp_max(cdf.shape[-1] - 1), floor
