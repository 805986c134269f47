"""Recipe schemas of the LM training stages: ``rltt pretrain`` and ``rltt convert``.

Both stages share the data, tokenizer, optimizer, objective, training, evaluation, logging,
checkpoint and alarm sections; they differ in ``model``. The sections and keys they have in
common with ``rltt train`` are the shared ones of `rltt.sections` (``logging.run_dir``,
``seed``, ``checkpoint.every``, ``model.dtype`` / ``model.device``, ``data.prompt_template``).
Load them with :func:`load_stage_recipe` (YAML + ``key=value`` overrides, see :mod:`rltt.config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from rltt.config import (Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Range,
                         load_recipe, recipe_error)
from rltt.sections import (STAGE_RENAMED, CheckpointSection, DataSection, LoggingSection, ModelPlacement,
                           TrainSection, is_dir, is_file, parsed_exit_policy)


@dataclass
class TextDataSection(DataSection):
    """Pretraining text.

    ``source``: ``synthetic`` / ``synthetic:PRESET`` (the generator), a local ``.jsonl`` /
    ``.parquet`` file (``text`` or ``question`` + ``answer`` fields, the question rendered with
    ``prompt_template``), or ``hf:NAME`` (a ``datasets`` dataset, ``hf_config`` / ``split``,
    ``text_field``, or question/answer). ``difficulty`` overrides the preset of a synthetic
    source (preset name or mapping). ``held_out_docs`` documents are kept out of training for
    the held-out loss (for a file source the last ones; for synthetic, problems of the eval
    seed ``seed + 1``).
    """

    source: str = "synthetic"
    difficulty: str | dict[str, Any] | None = None
    block_size: Annotated[int, Range(ge=2)] = 256
    shuffle: bool = True
    held_out_docs: PositiveInt = 256
    hf_config: str | None = None
    text_field: str = "text"

    def validate(self) -> None:
        super().validate()
        if not (self.is_synthetic or self.source.startswith("hf:")) and not is_file(self.source):
            raise recipe_error("data.source", f"file not found: {self.source!r}")
        if self.difficulty is not None:
            from rltt.data.synthetic import resolve_difficulty
            from rltt.errors import RlttError

            try:
                resolve_difficulty(self.difficulty)
            except RlttError as exc:
                raise recipe_error("data.difficulty", str(exc)) from None
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                raise recipe_error("data.difficulty", f"not a difficulty preset or mapping: {exc}") from None


@dataclass
class TokenizerSection:
    """The tokenizer: ``path`` to an existing one, else trained locally on ``train_docs``
    documents of the training source (``kind`` bpe | char, ``vocab_size``). A conversion uses
    the dense checkpoint's tokenizer when ``path`` is unset and one is there."""

    path: str | None = None
    kind: Literal["bpe", "char"] = "bpe"
    vocab_size: PositiveInt = 512
    train_docs: PositiveInt = 2000

    def validate(self) -> None:
        if self.path is not None and not is_dir(self.path):
            raise recipe_error("tokenizer.path", f"directory not found: {self.path!r}")


Beta = Annotated[float, Range(ge=0, lt=1)]


@dataclass
class OptimSection:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio · lr``; clip at ``grad_clip``
    (0 = off)."""

    lr: PositiveFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.1
    betas: list[Beta] = field(default_factory=lambda: [0.9, 0.95])
    eps: PositiveFloat = 1e-8
    warmup_steps: NonNegativeInt = 50
    min_lr_ratio: Fraction = 0.1
    grad_clip: NonNegativeFloat = 1.0

    def validate(self) -> None:
        if len(self.betas) != 2:
            raise recipe_error("optim.betas", f"must be two numbers in [0, 1), got {self.betas}")


@dataclass
class ObjectiveSection:
    """``L = (1−ε) Σ p_t L_t + (ε/T) Σ L_t − β H(p)`` (ε = 0: the pretraining objective)."""

    beta: NonNegativeFloat = 0.15
    eps: Fraction = 0.0


@dataclass
class StageTrainSection(TrainSection):
    """The loop: ``steps`` optimizer steps of ``batch_size`` blocks (× ``grad_accum``)."""

    steps: PositiveInt = 1000
    batch_size: PositiveInt = 16
    grad_accum: PositiveInt = 1


@dataclass
class EvalSection:
    """Periodic evaluation every ``every`` steps (and at the end): held-out loss over
    ``loss_batches`` batches; for a synthetic source also the solve rate of ``solve_problems``
    held-out problems sampled at ``temperature`` (0 = greedy) with exit policy ``exit_policy``
    (0 problems = off)."""

    every: PositiveInt = 200
    loss_batches: NonNegativeInt = 4
    solve_problems: NonNegativeInt = 128
    solve_batch_size: PositiveInt = 64
    max_new_tokens: PositiveInt = 96
    temperature: NonNegativeFloat = 1.0
    exit_policy: str = "final"
    seed: int = 1234


@dataclass
class StageLoggingSection(LoggingSection):
    """Also the metrics of every ``every``-th step go to ``metrics.jsonl``."""

    run_dir: str = "runs/stage"
    every: PositiveInt = 10


@dataclass
class AlarmSection:
    """Gate-collapse alarm: fires when mean p_1 > ``p1_threshold`` on ``patience``
    consecutive logged steps (after ``min_step``)."""

    p1_threshold: Fraction = 0.9
    patience: PositiveInt = 3
    min_step: NonNegativeInt = 0


@dataclass
class PretrainModelSection(ModelPlacement):
    """A from-scratch LoopLM: ``config`` holds `LoopConfig` fields (``vocab_size`` and the
    special-token ids come from the tokenizer); ``gate_bias`` initialises the exit-gate bias."""

    config: dict[str, Any] = field(default_factory=dict)
    gate_bias: float = 0.0

    def validate(self) -> None:
        super().validate()
        from rltt.errors import RlttError
        from rltt.model import LoopConfig

        known = set(LoopConfig.__annotations__)
        for key in self.config:
            if key not in known:
                raise recipe_error(f"model.config.{key}", "unknown LoopConfig field")
        try:  # the tokenizer fixes vocab_size later; check everything else now
            LoopConfig(**{"vocab_size": 512, **self.config})
        except (RlttError, TypeError, ValueError, OverflowError) as exc:
            raise recipe_error("model.config", str(exc)) from None

    @property
    def num_loops(self) -> int:
        from rltt.model import LoopConfig

        return self.config.get("num_loops", LoopConfig.__dataclass_fields__["num_loops"].default)


@dataclass
class DenseBuilder:
    """A small dense Qwen3 to create at ``model.dense_path`` when it is missing (tests and the
    CPU conversion recipe): it is built from ``config`` (Qwen3Config fields), given a tokenizer
    trained per the ``tokenizer`` section, and optionally pretrained densely for ``steps``
    steps on the recipe's data."""

    config: dict[str, Any] = field(default_factory=dict)
    steps: NonNegativeInt = 0
    lr: PositiveFloat = 3e-3
    seed: int = 0


@dataclass
class ConvertModelSection(ModelPlacement):
    """Dense → looped conversion of the HF checkpoint at ``dense_path`` (via ``loopify``)."""

    dense_path: str = ""
    num_loops: PositiveInt = 3
    injection: Literal["none", "scalar"] = "scalar"
    injection_init: float = 4.6
    carry_normed_state: bool = True
    gate_bias: float = 0.0
    lora_rank: NonNegativeInt = 0
    create_dense_if_missing: DenseBuilder | None = None

    def validate(self) -> None:
        super().validate()
        if not self.dense_path:
            raise recipe_error("model.dense_path", "is required")
        if self.create_dense_if_missing is None and not is_file(f"{self.dense_path}/config.json"):
            raise recipe_error("model.dense_path", f"no dense checkpoint (config.json) at {self.dense_path!r}")


@dataclass
class StageRecipe:
    """Sections shared by both LM stages."""

    RENAMED: ClassVar[dict[str, str]] = STAGE_RENAMED

    data: TextDataSection = field(default_factory=TextDataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    optim: OptimSection = field(default_factory=OptimSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    train: StageTrainSection = field(default_factory=StageTrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: StageLoggingSection = field(default_factory=StageLoggingSection)
    checkpoint: CheckpointSection = field(default_factory=lambda: CheckpointSection(every=200))
    alarm: AlarmSection = field(default_factory=AlarmSection)
    seed: int = 0

    def validate(self) -> None:
        parsed_exit_policy(self.eval, "exit_policy", "eval.exit_policy", self.model.num_loops)


@dataclass
class PretrainRecipe(StageRecipe):
    """``rltt pretrain``: a LoopLM from scratch (β = 0.15, T = 4, LR warmup)."""

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
