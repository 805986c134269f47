"""The packed-scoring activation estimate (``learner.pack_sequences``, the default) against the
tensors autograd saves in the packed score forward, and the packed micro-batch geometry the plan
uses (`RunSettings.learner_positions`). bench/scale.py measures the same at 12 M–320 M parameters."""

from dataclasses import replace

import pytest
import torch

from rltt.model import LoopConfig, LoopedForCausalLM
from rltt.planning.activations import activation_bytes
from rltt.planning.run_settings import RunSettings
from rltt.planning.shapes import ModelShape


def saved_bytes(model, input_ids, attention_mask, score_mask, pack: bool) -> int:
    """Distinct storages autograd saves in the score forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model(input_ids=input_ids, attention_mask=attention_mask, score_mask=score_mask, use_cache=False,
                    pack=pack)
    assert out.token_logprobs.requires_grad
    return sum(seen.values())


def rl_batch(vocab: int, prompts: int, group: int, prompt_len: int, completion: int):
    """G rows per prompt, each prompt + a full-length completion (right-padded: no padding here)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(prompts):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=gen)
        rows += [torch.cat([prompt, torch.randint(1, vocab, (completion,), generator=gen)]) for _ in range(group)]
    ids = torch.stack(rows)
    score = torch.zeros_like(ids, dtype=torch.bool)
    score[:, prompt_len:] = True
    return ids, torch.ones_like(ids), score


CASES = [
    ("pre", dict(), torch.float32),
    ("ouro", dict(norm_placement="ouro", num_hidden_layers=3, num_loops=4), torch.bfloat16),
    ("qwen3-like-gqa", dict(qk_norm=True, num_key_value_heads=2, injection="scalar"), torch.float32),
]


@pytest.mark.parametrize("name,fields,dtype", CASES, ids=[c[0] for c in CASES])
def test_packed_estimate_within_15_percent_of_the_saved_tensors(name, fields, dtype):
    config = LoopConfig(**{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_loops": 3, **fields})
    torch.manual_seed(0)
    model = LoopedForCausalLM(config).to(dtype)
    prompts, group, p, c = 2, 3, 40, 12
    ids, attention, score = rl_batch(config.vocab_size, prompts, group, p, c)
    measured = saved_bytes(model, ids, attention, score, pack=True)
    rows, b = prompts * group, 4 if dtype == torch.float32 else 2
    positions, keys = prompts * p + rows * (c - 1), prompts * p + rows * (p + c - 1)
    shape = ModelShape.of(config)
    estimate = activation_bytes(shape, b, positions, rows * c, key_positions=keys)
    assert abs(estimate - measured) <= 0.05 * measured, (estimate, measured)  # measured: within 1 %
    # the padded estimate of the same rows is far over what packing saves when prompts dominate
    padded = activation_bytes(shape, b, rows * (p + c), rows * c)
    assert padded > 1.5 * measured
    # and the padded estimate still matches the padded forward
    measured_padded = saved_bytes(model, ids, attention, score, pack=False)
    assert abs(padded - measured_padded) <= 0.15 * measured_padded, (padded, measured_padded)


def _settings(**changes) -> RunSettings:
    base = RunSettings(device="cuda", gpus=1, model_dtype="bf16", learner_dtype="bf16", backend="torch", zero_stage=0,
                       micro_batch_size=8, checkpointing=False, needs_reference=True, kl_coef=0.0, engine="native",
                       vllm_utilization=0.5, vllm_kv_gb=1.0, prompts_per_step=4, group_size=8, prompt_tokens=100,
                       completion_tokens=50, top_p=1.0, top_k=0, chunk_rows="auto")
    return replace(base, **changes)


def test_packed_micro_batch_counts_each_prompt_once_and_straddling_groups():
    s = _settings()
    assert s.micro_prompts == 1
    assert s.learner_positions() == (100 + 8 * 49, 8 * 50, 100 + 8 * (100 + 49))
    assert _settings(pack_sequences=False).learner_positions() == (8 * 150, 8 * 50, None)
    # micro-batches of 6 rows over groups of 8: rows 6..11 span two prompts
    assert _settings(micro_batch_size=6).micro_prompts == 2
    # 16 rows: two whole groups; 12 rows: rows 12..23 span prompts 1 and 2
    assert _settings(micro_batch_size=16).micro_prompts == 2
    assert _settings(micro_batch_size=12).micro_prompts == 2
    assert _settings(micro_batch_size=20).micro_prompts == 3  # rows 0..19: prompts 0, 1, 2
    # a micro-batch larger than the step: every prompt
    assert _settings(micro_batch_size=64).micro_prompts == 4
