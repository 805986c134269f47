"""Recipe schemas of the LM training stages: ``rltt pretrain`` and ``rltt convert``.

Both stages share the data, tokenizer, optimizer, objective, training, evaluation and alarm
sections; they differ in ``model``. Load them with :func:`load_stage_recipe` (YAML +
``key=value`` overrides, see :mod:`rltt.config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rltt.config import load_recipe, recipe_error


@dataclass
class DataSection:
    """Pretraining text.

    ``source``: ``synthetic`` / ``synthetic:PRESET`` (the generator), a local ``.jsonl`` /
    ``.parquet`` file (``text`` or ``question`` + ``answer`` fields), or ``hf:NAME`` (a
    ``datasets`` dataset, ``hf_config`` / ``hf_split``, ``text_field``, or question/answer).
    ``difficulty`` overrides the preset of a synthetic source (preset name or mapping).
    ``held_out_docs`` documents are kept out of training for the held-out loss (for a file
    source the last ones; for synthetic, problems of the eval seed ``seed + 1``).
    """

    source: str = "synthetic"
    difficulty: str | dict[str, Any] | None = None
    seed: int = 0
    block_size: int = 256
    shuffle: bool = True
    template: str = "Question: {question}\nAnswer:"
    held_out_docs: int = 256
    hf_split: str = "train"
    hf_config: str | None = None
    text_field: str = "text"

    def validate(self) -> None:
        if self.block_size < 2:
            raise recipe_error("data.block_size", f"must be >= 2, got {self.block_size}")
        if self.held_out_docs < 1:
            raise recipe_error("data.held_out_docs", f"must be >= 1, got {self.held_out_docs}")
        if "{question}" not in self.template:
            raise recipe_error("data.template", "must contain '{question}'")
        if not (self.is_synthetic or self.source.startswith("hf:")) and not Path(self.source).is_file():
            raise recipe_error("data.source", f"file not found: {self.source}")
        if self.difficulty is not None:
            from rltt.data.synthetic import resolve_difficulty
            from rltt.errors import RlttError

            try:
                resolve_difficulty(self.difficulty)
            except RlttError as exc:
                raise recipe_error("data.difficulty", str(exc)) from None

    @property
    def is_synthetic(self) -> bool:
        return self.source == "synthetic" or self.source.startswith("synthetic:")


@dataclass
class TokenizerSection:
    """The tokenizer: ``path`` to an existing one, else trained locally on ``train_docs``
    documents of the training source (``kind`` bpe | char, ``vocab_size``). A conversion uses
    the dense checkpoint's tokenizer when ``path`` is unset and one is there."""

    path: str | None = None
    kind: Literal["bpe", "char"] = "bpe"
    vocab_size: int = 512
    train_docs: int = 2000

    def validate(self) -> None:
        if self.path is not None and not Path(self.path).is_dir():
            raise recipe_error("tokenizer.path", f"directory not found: {self.path}")
        if self.train_docs < 1:
            raise recipe_error("tokenizer.train_docs", f"must be >= 1, got {self.train_docs}")


@dataclass
class OptimSection:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio · lr``; clip at ``grad_clip``
    (0 = off)."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def validate(self) -> None:
        if self.lr <= 0:
            raise recipe_error("optim.lr", f"must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise recipe_error("optim.betas", f"must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            raise recipe_error("optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise recipe_error("optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise recipe_error("optim.grad_clip", f"must be >= 0, got {self.grad_clip}")


@dataclass
class ObjectiveSection:
    """``L = (1−ε) Σ p_t L_t + (ε/T) Σ L_t − β H(p)`` (ε = 0: the pretraining objective)."""

    beta: float = 0.15
    eps: float = 0.0

    def validate(self) -> None:
        if not 0 <= self.eps <= 1:
            raise recipe_error("objective.eps", f"must be in [0, 1], got {self.eps}")
        if self.beta < 0:
            raise recipe_error("objective.beta", f"must be >= 0, got {self.beta}")


@dataclass
class TrainSection:
    """The loop: ``steps`` optimizer steps of ``batch_size`` blocks (× ``grad_accum``)."""

    steps: int = 1000
    batch_size: int = 16
    grad_accum: int = 1
    dtype: Literal["fp32", "bf16"] = "fp32"
    device: str = "auto"
    seed: int = 0
    threads: int | None = None
    log_every: int = 10
    save_every: int = 200
    progress: bool = True
    max_consecutive_skips: int = 3  # non-finite steps in a row (skipped, no update) before the run stops

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "log_every", "save_every"):
            if getattr(self, name) < 1:
                raise recipe_error(f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.max_consecutive_skips < 0:
            raise recipe_error("train.max_consecutive_skips", f"must be >= 0 (0 = never stop), got {self.max_consecutive_skips}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise recipe_error("train.device", f"must be auto | cpu | cuda[:i], got {self.device!r}")


@dataclass
class EvalSection:
    """Periodic evaluation every ``every`` steps (and at the end): held-out loss over
    ``loss_batches`` batches; for a synthetic source also the solve rate of ``solve_problems``
    held-out problems sampled at ``temperature`` with exit policy ``exit_policy``
    (0 problems = off)."""

    every: int = 200
    loss_batches: int = 4
    solve_problems: int = 128
    solve_batch_size: int = 64
    max_new_tokens: int = 96
    temperature: float = 1.0
    exit_policy: str = "final"
    seed: int = 1234

    def validate(self) -> None:
        if self.every < 1:
            raise recipe_error("eval.every", f"must be >= 1, got {self.every}")
        if self.solve_problems < 0 or self.loss_batches < 0:
            raise recipe_error("eval", "solve_problems and loss_batches must be >= 0")
        if self.temperature <= 0:
            raise recipe_error("eval.temperature", f"must be > 0, got {self.temperature}")


@dataclass
class AlarmSection:
    """Gate-collapse alarm: fires when mean p_1 > ``p1_threshold`` on ``patience``
    consecutive logged steps (after ``min_step``)."""

    p1_threshold: float = 0.9
    patience: int = 3
    min_step: int = 0


@dataclass
class CheckpointSection:
    """Retention: the newest ``keep_last`` checkpoints (0 = all), plus every ``keep_every``-th step (0 = none)."""

    keep_last: int = 3
    keep_every: int = 0

    def validate(self) -> None:
        for name in ("keep_last", "keep_every"):
            if getattr(self, name) < 0:
                raise recipe_error(f"checkpoint.{name}", f"must be >= 0, got {getattr(self, name)}")


@dataclass
class PretrainModelSection:
    """A from-scratch LoopLM: ``config`` holds `LoopConfig` fields (``vocab_size`` and the
    special-token ids come from the tokenizer); ``gate_bias`` initialises the exit-gate bias."""

    config: dict[str, Any] = field(default_factory=dict)
    gate_bias: float = 0.0

    def validate(self) -> None:
        from rltt.model import LoopConfig

        from rltt.errors import RlttError

        known = set(LoopConfig.__annotations__)
        for key in self.config:
            if key not in known:
                raise recipe_error(f"model.config.{key}", "unknown LoopConfig field")
        try:  # the tokenizer fixes vocab_size later; check everything else now
            LoopConfig(**{"vocab_size": 512, **self.config})
        except (RlttError, TypeError, ValueError) as exc:
            raise recipe_error("model.config", str(exc).splitlines()[0]) from None


@dataclass
class DenseBuilder:
    """A small dense Qwen3 to create at ``model.dense_path`` when it is missing (tests and the
    CPU conversion recipe): it is built from ``config`` (Qwen3Config fields), given a tokenizer
    trained per the ``tokenizer`` section, and optionally pretrained densely for ``steps``
    steps on the recipe's data."""

    config: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    lr: float = 3e-3
    seed: int = 0


@dataclass
class ConvertModelSection:
    """Dense → looped conversion of the HF checkpoint at ``dense_path`` (via ``loopify``)."""

    dense_path: str = ""
    num_loops: int = 3
    injection: Literal["none", "scalar"] = "scalar"
    injection_init: float = 4.6
    carry_normed_state: bool = True
    gate_bias: float = 0.0
    lora_rank: int = 0
    create_dense_if_missing: DenseBuilder | None = None

    def validate(self) -> None:
        if not self.dense_path:
            raise recipe_error("model.dense_path", "is required")
        if self.num_loops < 1:
            raise recipe_error("model.num_loops", f"must be >= 1, got {self.num_loops}")
        if self.create_dense_if_missing is None and not (Path(self.dense_path) / "config.json").is_file():
            raise recipe_error("model.dense_path", f"no dense checkpoint (config.json) at {self.dense_path}")


@dataclass
class StageRecipe:
    """Sections shared by both LM stages."""

    output_dir: str = "runs/stage"
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    optim: OptimSection = field(default_factory=OptimSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    alarm: AlarmSection = field(default_factory=AlarmSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)


@dataclass
class PretrainRecipe(StageRecipe):
    """``rltt pretrain``: a LoopLM from scratch (SPEC §4: β = 0.15, T = 4, LR warmup)."""

    model: PretrainModelSection = field(default_factory=PretrainModelSection)


@dataclass
class ConvertRecipe(StageRecipe):
    """``rltt convert``: dense → looped with the smoothed exit loss (ε = 0.05, T = 3)."""

    model: ConvertModelSection = field(default_factory=ConvertModelSection)
    objective: ObjectiveSection = field(default_factory=lambda: ObjectiveSection(beta=0.15, eps=0.05))


def load_stage_recipe(kind: Literal["pretrain", "convert"], path=None, overrides=(), data=None):
    """A checked `PretrainRecipe` / `ConvertRecipe` from a YAML file (or ``data``) + overrides."""
    cls = PretrainRecipe if kind == "pretrain" else ConvertRecipe
    return load_recipe(cls, path, overrides, data=data)
