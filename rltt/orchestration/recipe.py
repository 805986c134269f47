"""The `rltt train` recipe: one typed YAML document (SPEC §8), validated before any work starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltt.config import load_recipe, recipe_error
from rltt.data.gsm8k import DEFAULT_TEMPLATE
from rltt.learner.config import AlgorithmConfig, LearnerConfig
from rltt.rollout.params import SCHEDULES


@dataclass
class ModelSection:
    """``path``: a local checkpoint directory (rltt, Ouro or dense HF — dense ones are converted
    with ``convert``), or ``quickstart`` to build/use the tiny quickstart LoopLM."""

    path: str = "quickstart"
    dtype: str = "fp32"
    device: str = "auto"
    convert: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.dtype not in ("fp32", "bf16"):
            raise recipe_error("model.dtype", f"must be fp32 | bf16, got {self.dtype!r}")
        if self.path != "quickstart" and not Path(self.path).expanduser().exists() and "/" not in self.path:
            raise recipe_error("model.path", f"no such checkpoint directory: {self.path}")


@dataclass
class DataSection:
    """``source``: ``synthetic[:PRESET]``, a GSM8K-format JSONL/Parquet file or directory, a curated
    file from ``rltt curate``, or a hub id (``openai/gsm8k``). ``eval_source`` likewise (default:
    held-out synthetic problems, or the source's ``test`` split)."""

    source: str = "synthetic:quickstart"
    split: str = "train"
    eval_source: str | None = None
    eval_split: str = "test"
    eval_size: int = 128
    limit: int | None = None
    prompt_template: str = DEFAULT_TEMPLATE
    seed: int = 0

    def validate(self) -> None:
        for key, value in (("data.source", self.source), ("data.eval_source", self.eval_source)):
            if value and not value.startswith("synthetic") and not _is_hub_id(value) and not Path(value).exists():
                raise recipe_error(key, f"no such file or directory: {value}")
        if "{question}" not in self.prompt_template:
            raise recipe_error("data.prompt_template", "must contain {question}")
        if self.eval_size < 1:
            raise recipe_error("data.eval_size", f"must be >= 1, got {self.eval_size}")


def _is_hub_id(value: str) -> bool:
    return value.count("/") == 1 and not value.startswith((".", "/", "~")) and not Path(value).suffix


@dataclass
class RewardSpec:
    fn: str = "rewards/gsm8k.py:strict"
    weight: float = 1.0


ENGINES = ("native", "vllm")


@dataclass
class VllmSection:
    """``rollout.vllm``: settings of the vLLM engine (``rollout.engine: vllm``).

    ``kv_cache_gb``: CPU KV cache space in GiB; ``gpu_memory_utilization``: the fraction of the GPU
    vLLM may take (weights + KV cache; the learner needs the rest); ``max_model_len`` (null: the
    model's max_position_embeddings); ``tensor_parallel_size``; ``enforce_eager`` (null: eager on
    CPU, CUDA graphs on GPU); ``max_num_seqs``: sequences decoded at once; ``enable_prefix_caching``
    (a group's rows share their prompt's KV); ``multiprocess``: vLLM's engine core in its own process."""

    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.5
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    multiprocess: bool = False

    def validate(self) -> None:
        if self.kv_cache_gb < 1:
            raise recipe_error("rollout.vllm.kv_cache_gb", f"must be >= 1 (GiB), got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise recipe_error("rollout.vllm.gpu_memory_utilization", f"must be in (0, 1], got "
                                                                       f"{self.gpu_memory_utilization}")
        for key in ("tensor_parallel_size", "max_num_seqs"):
            if getattr(self, key) < 1:
                raise recipe_error(f"rollout.vllm.{key}", f"must be >= 1, got {getattr(self, key)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise recipe_error("rollout.vllm.max_model_len", f"must be >= 2 or null, got {self.max_model_len}")

    def engine_options(self) -> dict:
        """Keyword arguments of `rltt.rollout.vllm_engine.VllmEngine`."""
        from dataclasses import asdict

        return asdict(self)


@dataclass
class RolloutSection:
    """``group_size`` = G completions per prompt; ``prompts_per_step`` groups per RL step.
    ``engine``: ``native`` (rltt's PyTorch engine: dense or deferred schedule, bitwise replay) or
    ``vllm`` (vLLM: paged KV cache, continuous batching; dense schedule only; ``rollout.vllm``)."""

    engine: str = "native"
    prompts_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    exit_policy: str | None = None
    schedule: str = "deferred"
    stop_strings: list[str] = field(default_factory=list)
    vllm: VllmSection = field(default_factory=VllmSection)

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise recipe_error("rollout.engine", f"must be one of {' | '.join(ENGINES)}, got {self.engine!r}")
        if self.schedule not in SCHEDULES:
            raise recipe_error("rollout.schedule", f"must be one of {' | '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.engine == "vllm" and self.schedule != "dense":
            raise recipe_error("rollout.schedule", f"vLLM computes every step of every token, so rollout.engine=vllm "
                                                   f"needs rollout.schedule=dense, got {self.schedule!r}")
        for key in ("prompts_per_step", "group_size", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise recipe_error(f"rollout.{key}", f"must be >= 1, got {getattr(self, key)}")
        if self.temperature <= 0:
            raise recipe_error("rollout.temperature", "RL needs sampling: must be > 0")


@dataclass
class TrainSection:
    steps: int = 20
    eval_every: int = 10
    eval_samples: int = 1
    eval_temperature: float = 1.0
    threads: int = 0  # torch CPU threads (0 = torch's default)

    def validate(self) -> None:
        if self.threads < 0:
            raise recipe_error("train.threads", f"must be >= 0, got {self.threads}")
        if self.steps < 1:
            raise recipe_error("train.steps", f"must be >= 1, got {self.steps}")


@dataclass
class LoggingSection:
    run_dir: str = "runs/quickstart"
    tensorboard: bool = False
    wandb: bool = False
    review_every: int = 0
    review_at_end: bool = True
    progress: bool = True


@dataclass
class CheckpointSection:
    every: int = 10
    save_final: bool = True


@dataclass
class TrainRecipe:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    seed: int = 0

    def validate(self) -> None:
        if not self.rewards:
            raise recipe_error("rewards", "needs at least one reward function")

    @property
    def batch_size(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.group_size


def load_train_recipe(path: str | Path | None, overrides=()) -> TrainRecipe:
    """Load and validate a train recipe (unknown key, wrong type or missing file: one-line error)."""
    recipe = load_recipe(TrainRecipe, path, list(overrides))
    from rltt.data.rewards import load_reward_fn

    for i, spec in enumerate(recipe.rewards):
        try:
            load_reward_fn(spec.fn, root=Path(path).parent if path else None)
        except Exception as exc:  # noqa: BLE001 - re-raised as a recipe error naming the key
            raise recipe_error(f"rewards.{i}.fn", str(exc)) from None
    return recipe
