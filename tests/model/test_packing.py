"""Prefix-shared, unpadded score mode equals the padded score mode (values and gradients)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.model.packing import PackedLayout

from .helpers import tiny_model


def grouped_batch(seed: int, prompt_lengths, group: int, max_completion: int, vocab: int = 97):
    """Rows of G completions per prompt, right-padded; the completion tokens are scored."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for p in prompt_lengths:
        prompt = torch.randint(1, vocab, (p,), generator=gen)
        for _ in range(group):
            c = int(torch.randint(0, max_completion + 1, (), generator=gen))
            rows.append((prompt, torch.randint(1, vocab, (c,), generator=gen)))
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    score = torch.zeros(ids.shape, dtype=torch.bool)
    for r, (p, c) in enumerate(rows):
        ids[r, : len(p) + len(c)] = torch.cat([p, c])
        attention[r, : len(p) + len(c)] = 1
        score[r, len(p): len(p) + len(c)] = True
    return ids, attention, score


def score_and_grads(model, ids, attention, score, pack: bool):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=attention, score_mask=score, temperature=0.7, pack=pack)
    weights = torch.linspace(0.5, 1.5, out.token_logprobs.numel()).view_as(out.token_logprobs)
    loss = (out.token_logprobs * weights).sum() + 0.3 * out.token_entropy.sum() + out.token_exit_probs[0].sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same_function(model, ids, attention, score):
    padded, g_padded = score_and_grads(model, ids, attention, score, pack=False)
    packed, g_packed = score_and_grads(model, ids, attention, score, pack=True)
    for key in ("token_logprobs", "token_entropy", "token_exit_probs"):
        torch.testing.assert_close(getattr(packed, key), getattr(padded, key), rtol=1e-5, atol=2e-5)
    assert g_packed.keys() == g_padded.keys()
    for name in g_padded:
        scale = float(g_padded[name].abs().max()) + 1.0  # gradients reach O(100): compare relative to their size
        assert float((g_packed[name] - g_padded[name]).abs().max()) <= 2e-5 * scale, name


@pytest.mark.parametrize("variant", [
    {},
    {"injection": "scalar", "carry_normed_state": False},
    {"norm_placement": "ouro", "num_key_value_heads": 4},
    {"lora_rank": 2, "lora_targets": ["q_proj", "down_proj"]},
])
def test_packed_scoring_equals_padded_scoring(variant):
    torch.manual_seed(0)
    model = tiny_model(**variant).train()
    if variant.get("lora_rank"):
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.1)
    assert_same_function(model, *grouped_batch(0, [5, 9, 3], group=4, max_completion=12))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), prompts=st.lists(st.integers(1, 10), min_size=1, max_size=4),
       group=st.integers(1, 4), max_completion=st.integers(0, 9))
def test_packed_scoring_equals_padded_on_random_shapes(seed, prompts, group, max_completion):
    torch.manual_seed(seed)
    model = tiny_model(num_loops=2)
    ids, attention, score = grouped_batch(seed, prompts, group, max_completion)
    if not score.any():
        return
    assert_same_function(model, ids, attention, score)


def test_layout_shares_each_prompt_once_and_drops_padding():
    ids, attention, score = grouped_batch(1, [6, 4], group=3, max_completion=5)
    layout = PackedLayout.build(ids, attention, score)
    assert layout.num_prefixes == 2
    lengths = attention.sum(-1)
    completions = score.sum(-1)
    # each prompt once; each completion but its last token (whose state predicts nothing)
    assert layout.num_tokens == 6 + 4 + int((completions - 1).clamp_min(0).sum())
    assert layout.num_tokens < int(lengths.sum()) <= ids.numel()
    # every input the scores need maps to a packed token with its id and position
    needed = attention.bool() & ~(score & ~torch.roll(score, -1, 1))  # all but each row's last scored token
    needed[completions == 0] = attention.bool()[completions == 0]
    assert torch.equal(layout.input_ids[layout.packed_of[needed]], ids[needed])
    assert torch.equal(layout.positions[layout.packed_of[needed]], torch.arange(ids.shape[1]).expand_as(ids)[needed])
    assert bool((layout.packed_of[~needed] == layout.num_tokens).all())


def test_rows_whose_prompts_match_but_split_differently_are_not_merged():
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    score = torch.tensor([[False, False, True, True], [False, False, False, True]])
    layout = PackedLayout.build(ids, torch.ones_like(ids), score)
    assert layout.num_prefixes == 2
    model = tiny_model()
    assert_same_function(model, ids, torch.ones_like(ids), score)


def test_left_padded_batches_fall_back_to_the_padded_forward():
    ids = torch.tensor([[0, 5, 6, 7], [4, 5, 6, 7]])
    attention = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    score = torch.tensor([[False, False, True, True], [False, False, True, True]])
    assert PackedLayout.build(ids, attention, score) is None
    model = tiny_model()
    out = model(input_ids=ids, attention_mask=attention, score_mask=score, pack=True)
    ref = model(input_ids=ids, attention_mask=attention, score_mask=score, pack=False)
    assert torch.equal(out.token_logprobs, ref.token_logprobs)


def _reference_packed_attend(layout, scale):
    """The packed attention written plainly (oracle): advanced-index gathers and the bool masks
    handed to SDPA on every call."""
    from rltt.model.layers import sdpa

    def attend(q, k, v, layer_idx):
        qf, kf, vf = (x[0].transpose(0, 1) for x in (q, k, v))
        outs = []
        for part in layout.parts:
            Q = qf[part.q_idx].transpose(1, 2)
            K, V = kf[part.k_idx].transpose(1, 2), vf[part.k_idx].transpose(1, 2)
            outs.append(sdpa(Q, K, V, part.mask, False, scale).transpose(1, 2).flatten(0, 1))
        return torch.cat(outs)[layout.back_idx].transpose(0, 1)[None]

    return attend


def _attend_and_grads(attend, base, weight, dtype):
    q, k, v = (t.to(dtype).clone().requires_grad_() for t in base)
    out = attend(q, k, v, 0)
    (out.float() * weight).sum().backward()
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_packed_attend_matches_the_plain_formulation(kv_heads):
    """PackedAttend's once-per-forward additive masks and index_select gathers against bool masks
    and advanced indexing (the oracle): the same bits in fp32, forward and backward. In bf16 the
    forward and the query gradient are the same bits; the key/value gradients sum the repeats of
    each shared prefix key, which index_add_ rounds once and index_put_(accumulate) at every add,
    so they may differ in the last bits — never further from the fp32 gradient than the oracle's."""
    from rltt.model.packing import PackedAttend

    ids, attention, score = grouped_batch(3, [7, 5], group=3, max_completion=6)
    layout = PackedLayout.build(ids, attention, score)
    n, heads, head_dim = layout.num_tokens, 2, 8
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(1, h, n, head_dim, generator=gen).bfloat16() for h in (heads, kv_heads, kv_heads)]
    weight = torch.randn(1, heads, n, head_dim, generator=gen)
    oracle = _reference_packed_attend(layout, 0.3)
    for got, want in zip(_attend_and_grads(PackedAttend(layout, 0.3, torch.float32), base, weight, torch.float32),
                         _attend_and_grads(oracle, base, weight, torch.float32)):
        assert torch.equal(got, want)
    exact = _attend_and_grads(oracle, base, weight, torch.float32)  # the same bf16 values, fp32 arithmetic
    new = _attend_and_grads(PackedAttend(layout, 0.3, torch.bfloat16), base, weight, torch.bfloat16)
    old = _attend_and_grads(oracle, base, weight, torch.bfloat16)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    for i in (2, 3):
        assert float((new[i] - exact[i]).abs().max()) <= float((old[i] - exact[i]).abs().max())
