"""The ``ray`` orchestration: the run's engine a `RayRolloutPool` and its learner a
`RayLearnerGroup`, driven by the very same loop and training step as a run in one process.

The driver owns the prompt stream, seeds, rewards, advantages, metrics, evaluation and
checkpoints; the actors own the weights. The step is an `OverlappedStep`: with
``orchestration.max_staleness: K`` (``overlap: 1`` is K = 1) it samples up to K steps ahead; with
``orchestration.partial_rollouts`` it is a `PartialStep` (rows continued across weights versions).
A learner's death (`LearnerGroupDied`) ends the trainer; `rltt.orchestration.trainer.train`
rebuilds the parts and resumes from the newest checkpoint, up to
``orchestration.ray.learner_restarts`` times.

``RUN_DIR/cluster.json`` lists every actor (role, node, pid, restarts) as the run goes.

The driver process holds the run directory's lock and handles SIGTERM / SIGINT like any
`rltt train` (`rltt.runtime.stop`): after the checkpoint of the last completed step it closes
the pool and the learner group and shuts down the local cluster it started (`RunParts.release`).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from rltt.errors import RlttError
from rltt.orchestration.parts import Orchestration, RunParts
from rltt.orchestration.ray.builders import EngineFromDir, LearnerFromDir
from rltt.orchestration.orchestration_section import check_recipe
from rltt.orchestration.ray.overlap import OverlappedStep
from rltt.orchestration.ray.partial_step import PartialStep
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.runtime.distributed import Ranks

CLUSTER_FILE = "cluster.json"
#: ``orchestration.partial_rollouts`` → the driver's training step: the deterministic K-deep pipeline,
#: or rows continued across weights versions (docs/async.md).
STEPS = {False: OverlappedStep, True: PartialStep}


def ray_ranks(recipe: TrainRecipe) -> Ranks:
    """One driver process (the actors are the parallelism), once ray is importable and the
    recipe's orchestration section is consistent."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise RlttError("orchestration.backend: 'ray' needs ray (pip install 'rltt[ray]')") from None
    check_recipe(recipe)
    return Ranks()


def build_ray_parts(recipe: TrainRecipe, model_path: Path, run_dir: Path, ranks: Ranks,
                    restarts: int = 0) -> RunParts:
    """Connect to (or start) the cluster, then the learner group and the rollout pool; the driver
    loads the tokenizer only (the model lives in the actors)."""
    from transformers import AutoTokenizer

    from rltt.orchestration.ray.cluster import ClusterLog, connect, disconnect
    from rltt.orchestration.ray.learner_group import RayLearnerGroup
    from rltt.orchestration.ray.rollout_pool import RayRolloutPool

    r = recipe
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RlttError(f"model.path: no tokenizer in {model_path} ({type(exc).__name__})") from None
    cfg = r.orchestration.ray
    started = connect(cfg)
    learner = engine = None
    try:
        cluster = ClusterLog(run_dir / CLUSTER_FILE, restarts)
        learner = RayLearnerGroup(LearnerFromDir(r, str(model_path), str(run_dir)), cfg, cluster)
        engine = RayRolloutPool(EngineFromDir(r, str(model_path)), cfg, cluster)
    except BaseException:
        for part in (engine, learner):
            if part is not None:
                part.close()
        disconnect(started)
        raise
    o = r.orchestration
    extra = {"segment_tokens": o.partial_segment_tokens,
             "max_positions": model_positions(r, model_path)} if o.partial_rollouts else {}
    step = partial(STEPS[o.partial_rollouts], max_staleness=o.staleness, last_step=r.train.steps, **extra)
    return RunParts(tokenizer, engine, learner, step=step, release=partial(disconnect, started))


def model_positions(recipe: TrainRecipe, model_path: Path) -> int | None:
    """The model's positions, from its config.json (the driver loads no model); None without one."""
    from rltt.planning.shapes import model_shape

    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    return model_shape(json.loads(path.read_text()), recipe.model.convert).max_positions


RAY = Orchestration(ranks=ray_ranks, build=build_ray_parts,
                    planned_ranks=lambda recipe, ranks: recipe.orchestration.ray.learners,
                    restarts_key="orchestration.ray.learner_restarts", rebuilds="the learner group")
