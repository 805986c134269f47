"""The `rltt train` recipe (also read by `rltt curate` and `rltt eval`): one typed YAML document,
every value checked before any model loads (see `rltt.config` and `rltt.sections`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from rltt.environments.env_section import EnvSection
from rltt.config import (NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Range,
                         load_recipe, recipe_error)
from rltt.learner.settings import AlgorithmConfig, LearnerConfig
from rltt.model.model_source import ModelSource
from rltt.orchestration.engines import ENGINES, engine_spec
from rltt.orchestration.orchestration_section import OrchestrationSection
from rltt.planning.run_settings import DEFAULT_HEADROOM
from rltt.rollout.attention import ATTENTION, DEFAULT_ATTENTION
from rltt.rollout.params import Schedule
from rltt.sections import (TRAIN_RENAMED, CheckpointSection, DataSection, LoggingSection, ModelPlacement,
                           TrainSection, parsed_exit_policy, path_exists)


@dataclass
class ModelSection(ModelPlacement):
    """``path``: a local checkpoint directory (rltt, Ouro or dense HF — dense ones are converted
    with ``convert``), or ``quickstart`` to build/use the tiny quickstart LoopLM."""

    path: str = "quickstart"
    convert: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        super().validate()
        if self.path != "quickstart" and not path_exists(self.path) and "/" not in self.path:
            raise recipe_error("model.path", f"no such checkpoint directory: {self.path!r}")

    def known_num_loops(self) -> int | None:
        """T of a local checkpoint directory, from its config.json (None when not known yet)."""
        source = ModelSource.local(self.path)
        return source.num_loops if source is not None else None


@dataclass
class PromptDataSection(DataSection):
    """``source``: ``synthetic[:PRESET]``, a GSM8K-format JSONL/Parquet file or directory, a curated
    file from ``rltt curate``, or a hub id (``openai/gsm8k``). ``eval_source`` likewise (default:
    held-out synthetic problems, or the source's ``test`` split); ``limit``: first N prompts.
    ``max_prompt_tokens``: the longest prompt, in tokens, a run budgets memory for (`rltt plan`
    plans prompt + completion positions per row); ``drop_long_prompts``: drop longer prompts
    instead of failing on them."""

    eval_source: str | None = None
    eval_split: str = "test"
    eval_size: PositiveInt = 128
    limit: PositiveInt | None = None
    max_prompt_tokens: PositiveInt = 512  # prompt length the memory plan (`rltt plan`) budgets for, in tokens
    drop_long_prompts: bool = False  # drop prompts longer than max_prompt_tokens (else they are an error)
    prompt_format: Literal["plain", "chat"] = "plain"  # plain (prompt_template) | chat (the tokenizer's chat template)
    system_prompt: str | None = None  # chat: an optional system message
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat: template options

    def validate(self) -> None:
        super().validate()
        for key, value in (("data.source", self.source), ("data.eval_source", self.eval_source)):
            if value and not value.startswith("synthetic") and not _is_hub_id(value) and not path_exists(value):
                raise recipe_error(key, f"no such file or directory: {value!r}")
        if self.prompt_format == "plain" and (self.system_prompt or self.chat_template_kwargs):
            key = "data.system_prompt" if self.system_prompt else "data.chat_template_kwargs"
            raise recipe_error(key, "needs data.prompt_format: chat")


def _is_hub_id(value: str) -> bool:
    return value.count("/") == 1 and not value.startswith((".", "/", "~")) and not Path(value).suffix


@dataclass
class RewardSpec:
    fn: str = "rewards/gsm8k.py:strict"
    weight: float = 1.0
    timeout_s: float = 5.0  # per call; an isolated reward past it is killed and scores 0

    def validate(self) -> None:
        import math

        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise recipe_error("rewards.timeout_s", f"must be a positive number of seconds, got {self.timeout_s}")


@dataclass
class ThinkingSection:
    """Thinking budget with a forced answer, for models that think in ``open … close``: a row that
    reaches ``budget`` completion tokens (0 = off) with its thinking still open gets
    ``interruption`` appended — forced, not sampled, never trained on — then samples up to
    ``answer_budget`` more tokens. ``interruption`` should end the thinking (hold ``close``)."""

    budget: NonNegativeInt = 0
    open: str = "<think>"
    close: str = "</think>"
    interruption: str = ("\n\nConsidering the limited time by the user, I have to give the solution based on "
                         "the thinking directly now.\n</think>\n\n")
    answer_budget: PositiveInt = 128

    def validate(self) -> None:
        for key in ("open", "close", "interruption"):
            if not getattr(self, key):
                raise recipe_error(f"rollout.thinking.{key}", "must be a non-empty string")


@dataclass
class VllmSection:
    """``rollout.vllm``: settings of the vLLM engine (``rollout.engine: vllm``).

    ``kv_cache_gb``: CPU KV cache space in GiB; ``gpu_memory_utilization``: the fraction of the GPU
    vLLM may take (weights, activations and KV cache; the learner needs the rest), used as given;
    ``max_model_len`` (null: ``data.max_prompt_tokens`` + ``rollout.max_new_tokens`` — or the
    thinking budget, interruption and answer budget when longer —, at most the model's
    max_position_embeddings); ``tensor_parallel_size``; ``enforce_eager`` (null: eager on CPU,
    torch.compile and CUDA graphs on GPU); ``max_num_seqs``: sequences decoded at once (null: the
    rows of a step, ``prompts_per_step × group_size``, at most ``chunk_rows``);
    ``enable_prefix_caching`` (a group's rows share their prompt's KV); ``multiprocess``: vLLM's
    engine core in its own process; ``sleep``: free the GPU (vLLM sleep level 1: weights to CPU
    memory, KV cache dropped) while the learner updates, waking for each rollout (null: on with
    CUDA, off on CPU, where vLLM cannot sleep); ``lora``: with ``learner.lora`` (shared adapters),
    ``adapters`` serves them through vLLM's own LoRA support and each update sends the adapter
    tensors alone, ``merged`` serves the base with the adapters merged in and sends every weight.
    A KV cache too small for one ``max_model_len`` sequence is an error naming these keys before
    vLLM starts."""

    kv_cache_gb: Annotated[float, Range(ge=1, why="GiB")] = 1.0
    gpu_memory_utilization: Annotated[float, Range(gt=0, le=1)] = 0.5
    max_model_len: Annotated[int, Range(ge=2)] | None = None
    tensor_parallel_size: PositiveInt = 1
    enforce_eager: bool | None = None
    max_num_seqs: PositiveInt | None = None
    enable_prefix_caching: bool = True
    multiprocess: bool = False
    sleep: bool | None = None
    lora: Literal["adapters", "merged"] = "adapters"

    def engine_options(self) -> dict:
        """Keyword arguments of `rltt.vllm.vllm_engine.VllmEngine` (``lora`` is how the engine is
        built, not an option of it)."""
        from dataclasses import asdict

        return {k: v for k, v in asdict(self).items() if k != "lora"}


@dataclass
class RolloutSection:
    """``group_size`` = G completions per prompt; ``prompts_per_step`` groups per RL step.
    ``temperature`` > 0 (RL samples), ``top_p`` in (0, 1], ``top_k`` (0 = off); ``exit_policy``
    ``final | fixed:k | threshold:q | sample`` (null: the model's own).
    ``engine``: ``native`` (rltt's PyTorch engine: dense or deferred schedule, bitwise replay) or
    ``vllm`` (vLLM: paged KV cache, continuous batching; dense schedule only; ``rollout.vllm``).
    ``chunk_rows``: rows the native engine samples at once — ``auto`` (the largest multiple of
    ``group_size`` whose KV fits the device, `rltt.planning`) or N, a multiple of ``group_size``.
    ``cuda_graphs``: the native engine's passes padded to bucketed sizes and replayed as CUDA graphs
    (`rltt.rollout.buckets`, docs/engine.md) — null: on with CUDA, off on CPU; true needs CUDA.
    ``attention``: the native engine's attention — ``sdpa`` (default; grouped SDPA calls) or ``triton``
    (one Triton launch per layer reading the KV cache in place; needs Triton and CUDA; measured once on a
    GPU with the attention between captured pieces, its whole-pass capture not yet; `rltt.rollout.attention`,
    docs/engine.md).
    ``continuous_batching`` (default true): the native engine keeps its ``chunk_rows`` slots full — a row
    of the next prompts takes the slot of a row that finished — instead of chunks of whole prompts one
    after another (`rltt.rollout.admission`, docs/engine.md; replay stays bitwise); false: chunks (vLLM
    always batches continuously)."""

    engine: Literal[tuple(ENGINES)] = "native"  # type: ignore[valid-type]  # the engine table's names
    prompts_per_step: PositiveInt = 8
    group_size: Annotated[int, Range(ge=2, why="group size 1 can never learn: every group is uniform, "
                                               "so every advantage is 0")] = 8
    temperature: PositiveFloat = 1.0
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    top_k: NonNegativeInt = 0
    max_new_tokens: PositiveInt = 64
    exit_policy: str | None = None
    schedule: Schedule = "deferred"
    stop_strings: list[str] = field(default_factory=list)
    thinking: ThinkingSection = field(default_factory=ThinkingSection)
    vllm: VllmSection = field(default_factory=VllmSection)
    chunk_rows: int | Literal["auto"] = "auto"  # rows sampled at once (a multiple of group_size); auto: `rltt plan` picks
    cuda_graphs: bool | None = None  # native engine: bucketed passes replayed as CUDA graphs (null: on with CUDA)
    attention: Literal[tuple(ATTENTION)] = DEFAULT_ATTENTION  # type: ignore[valid-type]  # native engine: sdpa | triton
    continuous_batching: bool = True  # native engine: finished rows' slots taken by the next prompts' rows

    def validate(self) -> None:
        if self.chunk_rows != "auto" and (self.chunk_rows < 1 or self.chunk_rows % self.group_size):
            raise recipe_error("rollout.chunk_rows", f"must be auto or a positive multiple of rollout.group_size="
                                                     f"{self.group_size}, got {self.chunk_rows}")
        if any(not s for s in self.stop_strings):
            raise recipe_error("rollout.stop_strings", "must be non-empty strings")
        if self.thinking.budget > self.max_new_tokens:
            raise recipe_error("rollout.thinking.budget", f"must be <= rollout.max_new_tokens={self.max_new_tokens}, "
                                                          f"got {self.thinking.budget}")
        spec = ENGINES[self.engine]
        spec.check_schedule(self.engine, self.schedule)
        spec.continuous(self)


@dataclass
class RLTrainSection(TrainSection):
    """``eval_every`` steps (0 = no evaluation) the held-out set is sampled ``eval_samples`` times
    per prompt at ``eval_temperature`` (0 = greedy) with the exit policy ``eval_exit_policy``
    (null: the rollout's; e.g. ``threshold:0.9`` scores at a deployment exit policy). The first
    evaluation runs before step 1 over all ``data.eval_size`` held-out prompts (``rltt train``
    states its cost first).

    ``memory_headroom``: the share of each device the memory plan leaves free (`rltt plan`; the
    rollout chunk and both phases fill at most ``1 - memory_headroom`` of it) for what the plan
    does not count as allocated bytes: the blocks the caching allocator reserves beyond them
    (fragmentation) and untracked library buffers. Default 0.10, not measured on a GPU yet."""

    eval_every: NonNegativeInt = 10
    eval_samples: PositiveInt = 1
    eval_temperature: NonNegativeFloat = 1.0
    eval_exit_policy: str | None = None
    memory_headroom: Annotated[float, Range(ge=0, lt=1)] = DEFAULT_HEADROOM


@dataclass
class RLLoggingSection(LoggingSection):
    """Also ``tensorboard`` / ``wandb`` sinks and the health review every ``review_every`` steps
    (0 = off) and at the end."""

    run_dir: str = "runs/quickstart"
    tensorboard: bool = False
    wandb: bool = False
    review_every: NonNegativeInt = 0
    review_at_end: bool = True


@dataclass
class TrainRecipe:
    RENAMED: ClassVar[dict[str, str]] = TRAIN_RENAMED

    model: ModelSection = field(default_factory=ModelSection)
    data: PromptDataSection = field(default_factory=PromptDataSection)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    rollout: RolloutSection = field(default_factory=RolloutSection)
    env: EnvSection = field(default_factory=EnvSection)  # multi-turn episodes (docs/environments.md)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: RLTrainSection = field(default_factory=RLTrainSection)
    logging: RLLoggingSection = field(default_factory=RLLoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    orchestration: OrchestrationSection = field(default_factory=OrchestrationSection)
    seed: int = 0

    def validate(self) -> None:
        if not self.rewards:
            raise recipe_error("rewards", "needs at least one reward function")
        policy = parsed_exit_policy(self.rollout, "exit_policy", "rollout.exit_policy", self.model.known_num_loops())
        self.env.check_rollout(self.rollout, self.orchestration)
        source = ModelSource.local(self.model.path)  # a local checkpoint's positions (None: not known yet)
        self.env.check_positions(self.data.max_prompt_tokens, source.max_positions if source is not None else None)
        parsed_exit_policy(self.train, "eval_exit_policy", "train.eval_exit_policy", self.model.known_num_loops())
        kind = policy.kind if policy is not None else ""
        lora = self.learner.lora
        serving = engine_spec(self.rollout.engine).adapters(self.rollout) if lora is not None else None
        if lora is not None and lora.per_loop and serving != "model":
            raise recipe_error("learner.lora.per_loop", f"true: rollout.engine={self.rollout.engine} applies one "
                                                        f"adapter to every loop step (merged or served), and per-loop "
                                                        f"adapters differ between steps (use per_loop: false or "
                                                        f"rollout.engine: native)")
        if serving == "served":
            from rltt.vllm.lora import rank_problem

            problem = rank_problem(lora.rank)
            if problem:
                raise recipe_error("learner.lora.rank", problem)
        if self.algorithm.exit_action and kind != "sample":  # only a sampled exit is an action with a probability
            raise recipe_error("algorithm.exit_action", f"needs rollout.exit_policy: sample (the exit step is then "
                                                        f"drawn from p, part of the action), got "
                                                        f"{self.rollout.exit_policy!r}")
        if self.algorithm.compute_cost > 0 and kind in ("final", "fixed"):  # t* is one constant: the price cancels
            raise recipe_error("algorithm.compute_cost", f"has no effect with rollout.exit_policy "
                                                         f"{self.rollout.exit_policy!r} (every token exits at the "
                                                         "same step, so the price is equal within every group); "
                                                         "use rollout.exit_policy sample or threshold:q")

    @property
    def batch_size(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.group_size


def load_train_recipe(path: str | Path | None, overrides=()) -> TrainRecipe:
    """Load and check a train recipe (unknown key, wrong type, bad value or missing file: a
    one-line error naming the key) and import its reward functions."""
    recipe = load_recipe(TrainRecipe, path, list(overrides))
    from rltt.data.rewards import load_reward_fn

    for i, spec in enumerate(recipe.rewards):
        try:
            load_reward_fn(spec.fn, root=Path(path).parent if path else None)
        except Exception as exc:  # noqa: BLE001 - re-raised as a recipe error naming the key
            raise recipe_error(f"rewards[{i}].fn", str(exc)) from None
    return recipe
