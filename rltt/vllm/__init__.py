"""rltt's looped models inside vLLM (optional: ``pip install 'rltt[vllm]'``).

- `rltt.vllm.plugin`: ``register()``, vLLM's ``vllm.general_plugins`` entry point (rltt's
  architecture in vLLM's model registry, rltt's config in transformers' ``AutoConfig``).
- `rltt.vllm.model`: the vLLM model class — rltt's loop arithmetic on vLLM layers, one
  ``Attention`` (one KV cache) per (step, layer), exit gate and exit policy in ``compute_logits``.
- `rltt.vllm.worker`: the worker extension that records every sampled token's exit step,
  gate values and sampler log-probs under vLLM's Model Runner V1 or V2, and swaps weights in place.
- `rltt.vllm.row_exits`: the vLLM-free part (per-row exit decisions, counter-based exit draws).

Only this package and `rltt.vllm.vllm_engine` import vllm; ``import rltt`` never does.
"""
