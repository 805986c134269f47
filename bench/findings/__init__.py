"""RL findings at small scale: solve-rate band, learning rate, dense twin, per-loop credit, depth.

Tests five findings reported for RL on looped models (the "Reported" lines below: figures
from other runs, not measured here; bench/RESULTS.md says which hold at this scale) with real
``rltt curate`` / ``rltt train`` / ``rltt pretrain`` runs of the shipped recipes
(``recipes/quickstart.yaml``, ``recipes/pretrain-tiny.yaml``) on the quickstart model and the
synthetic task:

1. **Solve-rate band**: the same RL budget on prompts curated into a low (~0.1), mixed
   (~0.3-0.5) and high (~0.8) solve-rate band. The pool mixes the synthetic difficulty presets;
   ``rltt curate --band`` splits it by each prompt's measured solve rate. Held-out gain and the
   share of uniform groups (zero advantage) per band. Reported: +12 points at s ~ 0.30, none at
   s ~ 0.77, where the groups are uniform.
2. **Learning rate**: lr 1e-6 / 1e-5 / 1e-4 / 1e-3 at equal steps: KL to the reference, grad
   norm, held-out gain, and what ``rltt review`` diagnoses for each run. Reported: lr 1e-6
   left KL at ~2e-4 (the policy did not move), 1e-5 worked.
3. **Dense twin**: ``recipes/pretrain-tiny.yaml`` at T = 4 and at T = 1 (the same block, so the
   same parameters, and the same data): held-out LM loss and solve rate, then equal RL steps on
   each (``--dense-seeds``); every model's ``rltt eval`` compared, T = 4 − T = 1 paired over the
   same problems. Reported: recurrence beats a parameter-matched dense model at equal data.
4. **Per-loop credit**: ``algorithm.policy_logprob`` = exit / final / rltt (omega exit_pdf and
   progressive) at equal steps and seeds, with sampled exits (``rollout.exit_policy=sample``;
   under the quickstart's own ``final`` exits, exit and final are the same log-prob): held-out
   gain and exit distribution after RL, and each final checkpoint's ``rltt eval`` compared with
   ``final`` (paired over problems, seeds as runs; ``--credit-arms`` picks the arms).
   Reported: RLTT's credit beats final-loop GRPO.
5. **Depth**: the dense twin again, on a depth-hungry task: ``recipes/pretrain-tiny.yaml`` on
   the multi-hop lookups of ``synthetic:chains`` (the answer alone: every hop is resolved inside
   the forward pass; ``--depth-source synthetic:chains-easy`` for 0–3 hops, the direct lookup
   first) at T = 4 and T = 1, then equal RL steps; held-out pass@1 per hop count
   after each stage, T = 4 − T = 1 paired over the same problems with intervals and p-values.
   Reported: a looped model beats a parameter-matched dense one where depth is needed.

    python bench/findings [--out runs/bench-findings] [--smoke] [--jobs 2] [--only band,lr,dense,credit,depth]
                          [--credit-arms final,rltt-exit_pdf] [--credit-seeds 10] [--dense-seeds 10]
                          [--depth-source synthetic:chains-easy] [--depth-pretrain-steps 1500]
                          [--depth-pretrain-override model.config.hidden_size=256 ...]
    rltt bench findings --smoke --out /tmp/findings

Every arm is a subprocess (one CPU thread each), ``--jobs`` of them at a time. Writes
``OUT/findings.json``, ``OUT/findings.md`` (a Markdown section per finding, with the exact
commands), ``OUT/<finding>.png``, the run directories under ``OUT/runs`` and one log per arm
under ``OUT/logs``. The full mode (40 RL steps per arm; two seeds for the per-loop credit arms,
one for the others) took 33 minutes on 2 CPU cores shared with other jobs (load 4-8); ``--smoke``
(one seed, a few steps per arm, tiny evaluations and pretraining) checks that every arm runs in a
few minutes. ``--resume`` continues an interrupted run; ``--report-only`` rebuilds the outputs. The full mode reuses the cached quickstart model (built by
``rltt.lm_training.quickstart_model`` from ``recipes/pretrain-tiny.yaml``) as the T = 4 pretraining arm;
``--retrain-t4`` runs that pretraining again.

Layout: `runner` (the scale of each arm, the arms and their scheduler), `metrics` (reading the
runs), a module per finding (`band`, `lr`, `dense`, `credit`, `depth`: its arms and its results), `figures`,
`markdown` (the report) and `cli` (the flags and the outputs); ``__main__`` runs `cli.main`.
"""

from .band import BANDS, POOL_PRESETS
from .cli import FINDINGS, main, parse_args, run
from .credit import CREDIT
from .dense import PRETRAIN_RECIPE
from .lr import LRS
from .markdown import SECTION
from .runner import FULL, RL_RECIPE, SMOKE, Arm, Scale, T, run_arms

__all__ = ["Arm", "BANDS", "CREDIT", "FINDINGS", "FULL", "LRS", "POOL_PRESETS", "PRETRAIN_RECIPE", "RL_RECIPE",
           "SECTION", "SMOKE", "Scale", "T", "main", "parse_args", "run", "run_arms"]
