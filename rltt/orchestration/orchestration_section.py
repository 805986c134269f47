"""The ``orchestration`` recipe section: where the training step's engine and learner run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rltt.config import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Range, recipe_error

Backend = Literal["local", "ray"]
Sync = Literal["object_store"]  # a GPU broadcast path (NCCL / vLLM weight transfer) is the next one


@dataclass
class RaySection:
    """``orchestration.ray``.

    - ``address``: an existing cluster (``auto``, ``ray://host:10001``, ``host:6379``); None
      starts a local one (no dashboard, ``object_store_mb`` of object store).
    - ``rollout_workers`` / ``learners``: actor counts. Several learners form one
      torch.distributed group (gloo on CPU, NCCL on GPU) and need ``learner.backend=deepspeed``.
    - ``num_cpus`` / ``num_gpus``: resources each actor reserves (0 CPUs: actors only share
      the machine; torch in an actor runs ``max(1, num_cpus)`` threads).
    - ``timeout_s``: the longest any wait on the cluster may take (scheduling, a call, a
      restart); past it the run stops with a one-line error instead of hanging.
    - ``max_restarts``: how often Ray restarts a dead actor; a dead rollout worker's shard is
      re-issued once it is back (calls are never retried silently).
    - ``learner_restarts``: how often the run rebuilds its learner group after a learner died,
      resuming from the newest checkpoint (exactly: the steps after it are redone as they were);
      past it, or with 0, the run stops with a one-line error naming that checkpoint.
    - ``sync``: how weights reach the rollout workers each step (``object_store``).
    """

    address: str | None = None
    rollout_workers: PositiveInt = 1
    learners: PositiveInt = 1
    num_cpus: NonNegativeFloat = 0.0
    num_gpus: NonNegativeFloat = 0.0
    timeout_s: PositiveFloat = 300.0
    max_restarts: NonNegativeInt = 3
    learner_restarts: NonNegativeInt = 2
    object_store_mb: Annotated[int, Range(ge=64)] = 256
    sync: Sync = "object_store"

    @property
    def threads(self) -> int:
        return max(1, int(self.num_cpus))


@dataclass
class OrchestrationSection:
    """``orchestration``: ``backend`` local (one process, or torchrun ranks) | ray.

    ``max_staleness`` K: the rollout workers run up to K weights versions ahead of the learner —
    the rows of step n are sampled with the weights the learner had at the start of step
    max(1, n − K), whatever the timing (0: synchronous; the learner's ratio is against the
    recorded sampler log-probs). ``overlap`` is its older name: 1 is K = 1 (step k+1 sampled while
    step k learns); set together, they must agree. None: unset (K = 0).

    ``partial_rollouts`` (K ≥ 1): rows are generated in segments of ``partial_segment_tokens``
    tokens; a row still generating when the learner publishes new weights continues under them
    (its tokens so far re-submitted as the prompt), each token recording the version and the
    log-prob of the policy that sampled it. A step trains on the first groups to complete; a group
    with a token more than K versions behind the learner is dropped, never trained on
    (docs/async.md). Timing-dependent: not bitwise reproducible."""

    backend: Backend = "local"
    overlap: Literal[0, 1] | None = None
    max_staleness: NonNegativeInt | None = None
    partial_rollouts: bool = False
    partial_segment_tokens: PositiveInt = 32
    ray: RaySection = field(default_factory=RaySection)

    def validate(self) -> None:
        if self.overlap is not None and self.max_staleness is not None and self.overlap != self.max_staleness:
            raise recipe_error("orchestration.overlap", f"{self.overlap} is max_staleness {self.overlap}; it "
                                                        f"contradicts orchestration.max_staleness="
                                                        f"{self.max_staleness} (set one of them)")
        self.max_staleness = self.staleness
        if self.max_staleness and self.backend != "ray":
            raise recipe_error(self.staleness_key, f"{self.max_staleness} needs orchestration.backend=ray (rollouts "
                                                   f"run on their own actors while the learner updates)")
        if self.partial_rollouts and self.backend != "ray":
            raise recipe_error("orchestration.partial_rollouts", "true needs orchestration.backend=ray (rows "
                                                                 "continue on the rollout actors across updates)")
        if self.partial_rollouts and not self.max_staleness:
            raise recipe_error("orchestration.partial_rollouts", "true needs orchestration.max_staleness >= 1 "
                                                                 "(the versions a row may span; got 0)")

    @property
    def staleness(self) -> int:
        """K: ``max_staleness``, or its older name ``overlap`` — the one place the alias is resolved
        (`validate` stores the answer in ``max_staleness``)."""
        return self.max_staleness if self.max_staleness is not None else (self.overlap or 0)

    @property
    def staleness_key(self) -> str:
        """The recipe key K was given by, for messages: ``orchestration.overlap`` when only the alias
        was set."""
        return "orchestration.overlap" if self.overlap is not None else "orchestration.max_staleness"


def check_recipe(recipe) -> None:
    """Cross-section checks of a Ray run (one-line `ConfigError` naming the key)."""
    o = recipe.orchestration
    ray = o.ray
    from rltt.learner.backends import BACKENDS

    data_parallel = [name for name, backend in BACKENDS.items() if backend.data_parallel]
    if ray.learners > 1 and recipe.learner.backend not in data_parallel:
        raise recipe_error("orchestration.ray.learners", f"{ray.learners} learners need learner.backend="
                                                         f"{' | '.join(data_parallel)} (the {recipe.learner.backend} "
                                                         f"backend trains in one process)")
    if recipe.rollout.prompts_per_step % ray.learners:
        raise recipe_error("orchestration.ray.learners", f"{ray.learners} does not divide rollout.prompts_per_step="
                                                         f"{recipe.rollout.prompts_per_step} (each learner takes "
                                                         f"whole groups)")
    a = recipe.algorithm
    if o.staleness and not ((a.policy_logprob == "exit" and a.hybrid_logprob) or a.correction != "none"):
        raise recipe_error(o.staleness_key, f"{o.staleness} trains on rollouts up to {o.staleness} step(s) old: it needs the "
                                f"ratio against the sampler's log-probs (algorithm.policy_logprob=exit with "
                                f"hybrid_logprob=true, or an algorithm.correction such as decoupled or token_tis)")
    if o.partial_rollouts:
        for key, value, why in partial_excludes(recipe):
            if value:
                raise recipe_error("orchestration.partial_rollouts", f"true cannot be combined with {key} ({why})")


def partial_excludes(recipe) -> list[tuple[str, bool, str]]:
    """What a partial rollout cannot do yet: (recipe key, whether the recipe sets it, why). A thinking
    budget it can (a row's tokens are counted across its segments, `partial_rows.PartialRow.append_segment`), and
    the KL in the reward (measured when a batch is formed, between updates)."""
    r = recipe
    return [
        ("algorithm.dynamic_sampling", r.algorithm.dynamic_sampling,
         "groups are taken as they complete; refills are per-step rollouts"),
    ]
