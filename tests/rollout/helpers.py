"""Tiny looped models and prompts for rollout tests, and the dense-forward oracle of a rollout's log-probs."""

from dataclasses import dataclass

import torch

from rltt.model import LoopConfig, LoopedForCausalLM
from rltt.rollout import RolloutBatch, Schedule

VOCAB = 61


def tiny_model(num_loops: int = 4, gate_bias: float = -0.5, dtype=torch.float32, **overrides) -> LoopedForCausalLM:
    """A random tiny model whose gate gives mixed exits (different t* across tokens)."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_loops=num_loops, max_position_embeddings=64)
    fields.update(overrides)
    torch.manual_seed(1234)
    model = LoopedForCausalLM(LoopConfig(**fields)).eval()
    with torch.no_grad():
        model.model.exit_gate.weight.normal_(0, 1.0)
        model.model.exit_gate.bias.fill_(gate_bias)
    return model.to(dtype)


def prompts(sizes, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in sizes]


@dataclass
class DenseLogprobs:
    """Full-forward log-probs of a batch's completion tokens (R rows, C completion columns).

    ``per_loop`` (T, R, C): log P^(t)(y); ``exit_probs`` (T, R, C): p_t of the producing state;
    ``exit`` (R, C): per_loop at the recorded t*; all 0 on padding."""

    per_loop: torch.Tensor
    exit_probs: torch.Tensor
    exit: torch.Tensor


def dense_logprobs(model: LoopedForCausalLM, batch: RolloutBatch, temperature: float = 1.0,
                   truncated: bool = False) -> DenseLogprobs:
    """The rollout's completion log-probs from one full forward of the model's score mode (the
    learner's path, differentiable), with the recorded exit steps (the learner never re-decides
    exits): the oracle the engine's recorded log-probs are checked against. ``truncated``: over
    the recorded top-k/top-p kept sets (``batch.kept_floor``), as the learner scores them."""
    ids, mask, start = batch.padded_sequences()
    device = model.lm_head.weight.device
    cmask = batch.completion_mask.to(device)
    # completion token c of row r sits at start[r] + c
    positions = start[:, None] + torch.arange(cmask.shape[1])[None, :]
    score_mask = torch.zeros(ids.shape, dtype=torch.bool)
    score_mask.scatter_(1, positions.clamp_max(ids.shape[1] - 1), batch.completion_mask)
    extra = {}
    if truncated:
        floors = torch.full(ids.shape, -1, dtype=torch.long)
        rows = torch.arange(ids.shape[0])[:, None].expand_as(positions)
        floors[rows[batch.completion_mask], positions[batch.completion_mask]] = batch.kept_floor[batch.completion_mask]
        extra["kept_floor"] = floors.to(device)
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), score_mask=score_mask.to(device),
                temperature=temperature, use_cache=False, **extra)
    T = out.token_logprobs.shape[0]
    where = cmask[None].expand(T, -1, -1)
    per_loop = out.token_logprobs.new_zeros((T, *cmask.shape)).masked_scatter(where, out.token_logprobs)
    exit_probs = out.token_exit_probs.new_zeros((T, *cmask.shape)).masked_scatter(where, out.token_exit_probs)
    steps = batch.exit_steps.to(device).clamp_min(1)
    exit_lp = per_loop.gather(0, (steps - 1)[None])[0].masked_fill(~cmask, 0.0)
    return DenseLogprobs(per_loop, exit_probs, exit_lp)


def assert_same_passes(got: Schedule, want: Schedule) -> None:
    """Pass for pass the same record: dtypes, shapes and values, ``fork`` and ``admit`` None where they were; the
    same chunks."""
    assert got.kind == want.kind
    assert got.chunks == want.chunks
    assert len(got.passes) == len(want.passes)
    for i, (g, w) in enumerate(zip(got.passes, want.passes)):
        for name in ("work", "exits", "fork", "admit"):
            a, b = getattr(g, name), getattr(w, name)
            if b is None:
                assert a is None, (i, name)
                continue
            assert isinstance(a, torch.Tensor), (i, name)
            assert a.dtype == b.dtype and a.shape == b.shape, (i, name, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), (i, name)


def assert_forced_at_budget(batch: RolloutBatch, budget: int, interruption: list[int], answer: int) -> None:
    """Every row was forced at the thinking budget: the interruption follows ``budget`` sampled
    tokens, ``answer`` sampled tokens follow it, and forced tokens carry no log-prob or exit."""
    k = len(interruption)
    expected = torch.zeros(batch.completion_ids.shape, dtype=torch.bool)
    expected[:, budget: budget + k] = True
    assert torch.equal(batch.forced_mask, expected)  # on exactly the interruption tokens, in every row
    for r in range(batch.num_rows):
        completion = batch.completion(r)
        assert completion[budget: budget + k] == interruption
        assert len(completion) == budget + k + answer  # answer_budget sampled tokens after it
        assert batch.finish_reasons[r] == "length"
    forced, sampled = batch.forced_mask, batch.action_mask
    assert (batch.logprobs[forced] == 0).all() and (batch.tempered_logprobs[forced] == 0).all()
    assert (batch.exit_steps[forced] == 0).all()
    assert (batch.logprobs[sampled] < 0).all() and (batch.exit_steps[sampled] >= 1).all()


def rollout_fields(batch):
    """Every recorded field of a rollout (tokens, exits, log-probs, gates, pass records), for bitwise
    comparisons between engines and paths."""
    fields = [batch.completion_ids, batch.exit_steps, batch.logprobs, batch.tempered_logprobs,
              batch.gate_probs.nan_to_num(-1.0), batch.exit_logprobs, batch.kept_floor, batch.completion_mask,
              batch.stats.row_passes]
    return fields + [t for p in batch.schedule.passes for t in (p.work, p.exits)]


def fields_equal(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@dataclass(frozen=True)
class ReorderBound:
    """How far two fp32 evaluations of the same rows may differ when they run the same operations on
    other batch shapes (chunked or continuous against unchunked: GEMMs over other row counts, attention
    groups padded to other widths), which changes only the order of each reduction's additions.

    Derived from the arithmetic (docs/design.md §3.8), not measured: a dot product of length K summed in
    any order is within γ_K = K·u of the exact one relative to Σ|aᵢbᵢ| (u = 2⁻²⁴, fp32's unit roundoff).
    A log-prob's path is D = T·L·6 + 2 such reductions in sequence (per layer: q/k/v, QKᵀ, PV, o, gate/up,
    down; then the final norm and the head), so, to first order, the normed state h_t of either
    evaluation is within ε = D·K·u of the exact one relative to its norm, K the longest reduction
    (hidden, FFN or key length). A logit w_yᵀh moves by at most ‖w_y‖·‖h‖·ε and a log-prob
    z_y − logsumexp(z) by twice that, ‖h‖ ≤ √d·max|γ| after the final norm's weights γ; a gate
    σ(w_gᵀh + b) by a quarter of ‖w_g‖·‖h‖·ε. Two evaluations: twice each."""

    logprob: float
    gate: float

    @classmethod
    def of(cls, model: LoopedForCausalLM, temperature: float = 1.0) -> "ReorderBound":
        c = model.config
        u = torch.finfo(torch.float32).eps / 2
        depth = c.num_loops * c.num_hidden_layers * 6 + 2
        longest = max(c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim,
                      c.max_position_embeddings)
        eps = depth * longest * u
        with torch.no_grad():
            h_norm = c.hidden_size ** 0.5 * model.model.norm.weight.float().abs().max().item()
            head = model.lm_head.weight.float().norm(dim=1).max().item()
            gate = model.model.exit_gate.weight.float().norm().item()
        logprob = 2 * 2 * head * h_norm * eps / min(temperature, 1.0)
        return cls(logprob=logprob, gate=2 * 0.25 * gate * h_norm * eps)
