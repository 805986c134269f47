"""Ray orchestration: the same training step as the local loop, with its two seams served by actors.

- `RayRolloutPool` (a `RolloutEngine`): N rollout-worker actors, each wrapping an engine built
  from the model directory; a call's prompts (with their prompt seeds) are sharded across the
  workers and merged back in prompt order; every call carries the weights version it expects.
- `RayLearnerGroup` (a `Learner`): M learner actors forming one torch.distributed group.
- `connect` / `Cluster`: a local cluster (or an existing one at ``orchestration.ray.address``),
  resources checked within ``timeout_s``, and ``RUN_DIR/cluster.json``.

Ray is an optional dependency (``pip install 'rltt[ray]'``); nothing here imports it at module
import time except `cluster`, `rollout_pool` and `learner_group`. The recipe section that chooses
this orchestration (``orchestration.*``, with ``orchestration.ray``) serves local runs too and lives
beside the trainer: `rltt.orchestration.orchestration_section`.
"""
