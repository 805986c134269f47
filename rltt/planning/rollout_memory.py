"""Rollout memory of the native engine for one chunk of R rows (`rltt.rollout.executor.PassExecutor`),
S = prompt + completion positions per row, b = bytes of the engine's dtype. With a multi-turn
environment the completion is the episode (``env.max_tokens``, `run_settings.completion_width`):
the engine keeps a chunk's executor across the turns of its episodes (`rltt.rollout.continuation`),
one chunk at a time, so these terms are what it holds between turns too::

    rollout_kv        = R · S · T·L · 2 · Hkv · D · b        (StepKVCache: keys and values of every slot)
    rollout_state     = R · S · (d·b + 4·T + 8 + 12 + 32)    (per-token carry, gates λ_t, token ids; the
                                                            kept-set floor (int64) and log p_t* (fp32);
                                                            a sampled token's four float64 values, held on
                                                            the device until the chunk ends when no token
                                                            can stop a row)
    rollout_workspace = max(sampling, prefill)
        sampling      = R · V · (24 + 28·[top_p < 1] + 4·[top_k])
                        (fp32 logits and tempered scores, the float64 softmax and its CDF; top-p
                        adds the sort, its indices and its softmax/cumsum)
        prefill       = R/G · (P − 1) · b · (4d + 2q + 2kv + 3F) + R/G · n_rep · (P − 1)² · b
                        (the shared prefill pass runs each prompt's P − 1 positions once, without
                        gradients: one layer's tensors at a time, and the additive attention mask)

With continuous batching (``rollout.continuous_batching``, `rltt.rollout.admission.Continuous`) R is the slots
(``chunk_rows``) of the one executor a call keeps, S still the longest prompt + the completion width
(the call's longest prompt, within ``data.max_prompt_tokens``). What changes::

    rollout_held      = R_call · C · (4·T + 32)               (every row of the call, C = completion width:
                                                            a finished row's gates λ_t (fp32) copied out
                                                            of its slot, and its sampled tokens' four
                                                            float64 values, both held on the device until
                                                            the call ends), counted in rollout_state
    prefill           = (R/G + 1) prompts' prefixes in one pass (rows join one by one, so a pass can
                        hold one more prompt's prefix than a chunk), plus R decode items beside them
"""

from __future__ import annotations

from rltt.planning.shapes import ModelShape


def kv_bytes(shape: ModelShape, rows: int, positions: int, b: int) -> int:
    return rows * positions * shape.kv_bytes_per_token(b)


def state_bytes(shape: ModelShape, rows: int, positions: int, b: int) -> int:
    return rows * positions * (shape.hidden * b + 4 * shape.loops + 8 + 12 + 32)


def sampling_bytes(shape: ModelShape, rows: int, top_p: float, top_k: int) -> int:
    per_logit = 24 + 28 * (top_p < 1.0) + 4 * (top_k > 0)
    return rows * shape.vocab * per_logit


def prefill_bytes(shape: ModelShape, prompts: int, prompt_tokens: int, b: int) -> int:
    items = prompts * max(prompt_tokens - 1, 0)
    per_item = b * (4 * shape.hidden + 2 * shape.q_dim + 2 * shape.kv_dim + 3 * shape.intermediate)
    n_rep = shape.heads // shape.kv_heads
    return items * per_item + prompts * n_rep * max(prompt_tokens - 1, 0) ** 2 * b


def workspace_bytes(shape: ModelShape, rows: int, group_size: int, prompt_tokens: int, b: int,
                    top_p: float, top_k: int) -> int:
    prompts = -(-rows // group_size)
    return max(sampling_bytes(shape, rows, top_p, top_k), prefill_bytes(shape, prompts, prompt_tokens, b))


def held_bytes(shape: ModelShape, call_rows: int, completion: int) -> int:
    """Continuous batching: the gates and sampled values of every row of the call, held until it ends."""
    return call_rows * completion * (4 * shape.loops + 32)


def continuous_workspace_bytes(shape: ModelShape, rows: int, group_size: int, prompt_tokens: int, b: int,
                               top_p: float, top_k: int) -> int:
    """Continuous batching's workspace: one more prompt's prefix in a pass than a chunk holds, beside
    the decode items of every slot."""
    prompts = -(-rows // group_size) + 1
    per_item = b * (4 * shape.hidden + 2 * shape.q_dim + 2 * shape.kv_dim + 3 * shape.intermediate)
    return max(sampling_bytes(shape, rows, top_p, top_k),
               prefill_bytes(shape, prompts, prompt_tokens, b) + rows * per_item)
