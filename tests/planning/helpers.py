"""Config-only model folders for the planning tests (no weights)."""

import json
from pathlib import Path

# Ouro-1.4B's shape, as its config.json holds it (OuroForCausalLM layout; `rltt.model.ouro` maps it)
OURO_1_4B = {
    "model_type": "ouro", "architectures": ["OuroForCausalLM"], "vocab_size": 49152, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "head_dim": 128, "total_ut_steps": 4, "early_exit_threshold": 1.0, "tie_word_embeddings": False,
    "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 1000000.0,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "bfloat16",
}

TINY_LOOPED = {
    "model_type": "rltt_looped", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_loops": 3, "max_position_embeddings": 512,
}


def config_folder(root: Path, config: dict, name: str = "model") -> Path:
    """A folder holding only ``config.json``."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder

#: Ouro-2.6B's shape: Ouro-1.4B's layer, 48 layers
OURO_2_6B = {**OURO_1_4B, "num_hidden_layers": 48}
