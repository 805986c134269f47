"""`LoopConfig`: the Hugging Face config of a looped language model (docs/design.md §1)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from rltt.errors import ConfigError

NORM_PLACEMENTS = ("pre", "post", "sandwich", "ouro")
INJECTIONS = ("none", "scalar")
FINAL_NORMS = ("rmsnorm", "none")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@strict
class LoopConfig(PreTrainedConfig):
    """A shared block of `num_hidden_layers` decoder layers applied `num_loops` times.

    The layer fields follow Qwen3/Qwen2/Llama (so dense checkpoints convert by copying
    weights); the loop fields are rltt's:

    - ``num_loops`` (T): recurrent steps of the shared block.
    - ``injection``: ``none`` (z_t = h_{t-1}, Ouro) or ``scalar``
      (z_t = w·e + (1−w)·h_{t-1} for t > 1, w = σ(a), a initialised to ``injection_init``).
    - ``carry_normed_state``: feed norm_f(B(z_t)) to the next step (Ouro) or the un-normed B(z_t).
    - ``norm_placement``: ``pre`` | ``post`` | ``sandwich`` | ``ouro`` (= sandwich + carried norm).
    - ``final_norm``: ``rmsnorm`` (norm_f after every step) or ``none``.
    - ``exit_policy``: default policy of the forward: ``final`` | ``fixed:k`` | ``threshold:q`` | ``sample``.
    - ``lora_rank``: LoRA rank (0 = off) on ``lora_targets``, scaled by ``lora_alpha / lora_rank``;
      ``lora_per_loop``: one adapter per loop step (true) or one shared by all steps;
      ``lora_dropout``: dropout on the adapter's input while training.
    """

    model_type = "rltt_looped"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False  # bias on q/k/v projections
    attention_out_bias: bool | None = None  # bias on o_proj (None: same as attention_bias; Qwen2: False)
    mlp_bias: bool = False
    qk_norm: bool = False
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    num_loops: int = 4
    injection: str = "none"
    injection_init: float = 4.6
    carry_normed_state: bool = True
    norm_placement: str = "pre"
    final_norm: str = "rmsnorm"
    exit_policy: str = "final"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: list[str] | None = None
    lora_per_loop: bool = True
    lora_dropout: float = 0.0

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads > 0:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads} (set head_dim explicitly)"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        if self.norm_placement == "ouro":
            self.carry_normed_state = True
        if self.lora_targets is None:
            self.lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        self.check()
        super().__post_init__(**kwargs)

    def check(self) -> None:
        """Raise a one-line `ConfigError` naming the first impossible field."""
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_loops < 1:
            raise ConfigError(f"num_loops must be >= 1, got {self.num_loops}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name, allowed in (("norm_placement", NORM_PLACEMENTS), ("injection", INJECTIONS),
                              ("final_norm", FINAL_NORMS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {'|'.join(allowed)}, got {getattr(self, name)!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0, got {self.lora_rank}")
        bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if bad:
            raise ConfigError(f"lora_targets has unknown module {bad[0]!r}; choose from {', '.join(LORA_TARGETS)}")
        from rltt.model.exits import ExitPolicy  # local import: exits does not need the config

        ExitPolicy.parse(self.exit_policy, self.num_loops, field="exit_policy")
