"""Tiny configs for model tests."""

from rltt.model import LoopConfig, LoopedForCausalLM


def tiny_config(**overrides) -> LoopConfig:
    fields = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_loops=3, max_position_embeddings=128)
    fields.update(overrides)
    return LoopConfig(**fields)


def tiny_model(**overrides) -> LoopedForCausalLM:
    model = LoopedForCausalLM(tiny_config(**overrides)).eval()
    # a non-trivial gate so exit distributions are not uniform
    model.model.exit_gate.weight.data.normal_(0, 0.5)
    return model
