"""RL step time and solve-rate gain: rltt's Trainer vs TRL's GRPOTrainer, in one process.

    python bench/trl_compare.py                  # 12 steps (~2-4 min on 2 CPU cores)
    python bench/trl_compare.py --write          # ... and update bench/RESULTS.md's section
    python bench/trl_compare.py --model auto --threads 1 --steps 60 --lr 1e-4 --eval-size 256 --eval-samples 4 --rltt-set algorithm.track_kl=false
                                                 # the 60-step figures in bench/RESULTS.md (~5 min on 2 idle cores)

``--write`` replaces the whole section, notes included (``--write --append`` adds a table). ``--threads``
(default 1) is both trainers' torch thread count: with two OpenMP threads and other jobs on the
cores, steps swing from 2 s to 50 s.

Both trainers start from the same looped checkpoint (``--model``: ``auto`` = the cached
quickstart model if it is built, else a tiny random LoopLM from
``tests/orchestration/helpers.py::tiny_checkpoint``; ``quickstart`` builds it if needed; or a
checkpoint directory) and see, step for step, the same prompts: rltt's own prompt stream
(synthetic ``quickstart`` problems, the recipe's template), handed to TRL as a
``datasets.Dataset`` in the same order (``shuffle_dataset=False``). Same G (``num_generations``),
max completion length, temperature, top-p/top-k (off), lr and LR schedule (linear warmup then
constant: TRL gets an AdamW + LambdaLR built to rltt's formula), grad clip, AdamW betas, no KL,
PPO clip ε = 0.2 / ε_high = 0.28, token-mean loss over the whole batch (TRL ``loss_type=dapo``,
rltt ``aggregation=token_mean``), group-std advantage scaling, one optimizer update per step.
Per step both see ``prompts × G`` completions: TRL's ``per_device_train_batch_size`` is a
micro-batch of *completions*, so it is rltt's ``micro_batch_size`` and
``gradient_accumulation_steps = prompts × G / micro`` (TRL then generates the whole
``prompts × G`` batch once per optimizer step: ``steps_per_generation = grad_accum``).
Reward: ``rewards/gsm8k.py:strict`` for both (wrapped for TRL's ``reward_funcs`` signature).

TRL and the looped model: TRL 1.16 patches the model's forward with its fused LM head and
asks the backbone (``model.base_model``) for ``last_hidden_state``. A LoopLM's backbone
returns the per-loop states instead, so TRL gets a thin view whose backbone returns the final
loop's normed state h_T: TRL's log-probs are those of the *final-step* logits (what
``LoopedForCausalLM.forward`` returns under ``exit_policy=final``), and TRL's copy of the
model samples with ``exit_policy=final`` too, so its generation and its scoring agree. rltt
trains with the recipe's algorithm (``recipes/quickstart.yaml``: ``policy_logprob=exit``, the
model's own exit policy; for a model whose config says ``final`` that is the same thing).

Timing: the two trainers run interleaved — TRL drives, and after each TRL optimizer step a
callback runs one rltt step — so load from other jobs on the shared machine hits both alike.
A step's time is the wall (and process-CPU) time from the end of the previous step to the end
of this one: for TRL everything its loop does (generation, rewards, scoring, backward,
optimizer, logging), for rltt ``Trainer.train_step`` plus its metrics log. The first
``--warmup-steps`` steps are excluded; the figure is the median. Evaluation (not timed): the
same held-out problems (rltt's eval set), samples, temperature and length for the start model
and both final models, all through rltt's ``evaluate`` on a ``NativeEngine`` with
``exit_policy=final``; rltt's final model is also evaluated with its own rollout exit policy.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## RL step time vs TRL GRPOTrainer (bench/trl_compare.py)"
RECIPE = ROOT / "recipes" / "quickstart.yaml"
REWARD = "rewards/gsm8k.py:strict"


# -- the model -----------------------------------------------------------------------------------
def resolve_model(spec: str, workdir: Path) -> tuple[Path, str]:
    """(checkpoint directory, description) for ``--model``."""
    if spec == "quickstart":
        from rltt.lm_training.quickstart_model import ensure_quickstart_model

        path = ensure_quickstart_model(progress=False)
        return Path(path), f"quickstart model ({path})"
    if spec == "auto":
        from rltt.lm_training.quickstart_model import quickstart_info

        info = quickstart_info()  # a built one only: auto never starts the ~5 min build
        if info and (Path(info.get("model", "")) / "config.json").is_file():
            return Path(info["model"]), f"quickstart model ({info['model']}, build step {info.get('step')})"
        print("[trl_compare] no built quickstart model; using a tiny random LoopLM", file=sys.stderr)
        spec = "tiny"
    if spec == "tiny":
        sys.path.insert(0, str(ROOT))
        from tests.orchestration.helpers import tiny_checkpoint

        path = workdir / "tiny-model"
        if not (path / "config.json").is_file():
            tiny_checkpoint(path)
        return path, "tiny random LoopLM (tests/orchestration/helpers.py::tiny_checkpoint: d=32, L=1, T=3, char tokenizer)"
    return Path(spec).expanduser(), f"checkpoint {spec}"


class _FinalStateBackbone:
    """What TRL's fused LM head calls as ``model.base_model``: the LoopLM backbone, returning
    the final loop's normed state h_T as ``last_hidden_state``."""

    def __init__(self, looped_model):
        self.looped = looped_model

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **_):
        from types import SimpleNamespace

        step_hidden, _gates = self.looped(input_ids, attention_mask, position_ids, None, inputs_embeds)
        return SimpleNamespace(last_hidden_state=step_hidden[-1])


def trl_view_class():
    """A `LoopedForCausalLM` subclass for TRL: final-state backbone, timed ``generate``."""
    from rltt.model import LoopedForCausalLM

    class TRLLoopedView(LoopedForCausalLM):
        generate_seconds = 0.0
        generate_cpu_seconds = 0.0

        @property
        def base_model(self):
            return _FinalStateBackbone(self.model)

        def generate(self, *args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return super().generate(*args, **kwargs)
            finally:
                type(self).generate_seconds += time.perf_counter() - t0
                type(self).generate_cpu_seconds += time.process_time() - c0

    return TRLLoopedView


# -- the two trainers ---------------------------------------------------------------------------
def rltt_overrides(args, model_path: Path, run_dir: Path) -> list[str]:
    return [
        f"model.path={model_path}", f"train.steps={args.steps}", "train.eval_every=0",
        f"train.eval_samples={args.eval_samples}", f"train.eval_temperature={args.temperature}",
        f"data.eval_size={args.eval_size}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
        f"learner.lr={args.lr}", f"learner.warmup_steps={args.lr_warmup}", f"learner.micro_batch_size={args.micro}",
        f"logging.run_dir={run_dir}", "logging.progress=false", "logging.review_at_end=false",
        "checkpoint.every=0", "checkpoint.save_final=false", f"seed={args.seed}",
        f"train.threads={args.threads}",  # rltt's trainer sets the process's torch threads: TRL runs with the same
        *args.rltt_set,
    ]


def make_rltt(args, model_path: Path, run_dir: Path):
    from rltt.orchestration.trainer import Trainer
    from rltt.orchestration.train_recipe import load_train_recipe

    recipe = load_train_recipe(RECIPE, rltt_overrides(args, model_path, run_dir))
    return Trainer(recipe, recipe_root=ROOT)


def step_tasks(rl, steps: int) -> list:
    """The tasks rltt's prompt stream hands out over ``steps`` steps, in order (the stream is
    deterministic: a fresh one with the recipe's settings, not the trainer's own)."""
    from rltt.orchestration.prompt_stream import PromptStream

    r = rl.recipe
    encode = lambda text: rl.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    stream = PromptStream(r.data.source, encode, r.data.prompt_template, r.data.split, r.data.limit, r.data.seed)
    return stream.next(steps * r.rollout.prompts_per_step)


def trl_reward(strict):
    def gsm8k_strict(prompts, completions, answer, **_):
        return [float(strict(c, a)) for c, a in zip(completions, answer)]

    return gsm8k_strict


def lr_lambda(warmup: int):
    """rltt's schedule (`rltt/learner/backends.py`): update u gets lr · min(1, (u + 1) / warmup)."""
    return lambda u: 1.0 if warmup <= 0 else min(1.0, (u + 1) / warmup)


def make_trl(args, model_path: Path, tasks: list, out_dir: Path, callbacks):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rltt.data.rewards import load_reward_fn

    batch = args.prompts * args.group
    if batch % args.micro:
        raise SystemExit(f"--micro {args.micro} must divide prompts x G = {batch}")
    model = trl_view_class().from_pretrained(model_path)
    model.config.exit_policy = "final"  # sample what TRL scores (the final-step logits)
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    dataset = Dataset.from_list([{"prompt": t.prompt, "answer": t.answer, "task_id": t.id} for t in tasks])
    config = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=args.seed, data_seed=args.seed, dataloader_num_workers=0,
        max_steps=args.steps, num_generations=args.group, max_completion_length=args.max_new_tokens,
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=batch // args.micro,
        temperature=args.temperature, top_p=1.0, top_k=0, learning_rate=args.lr, max_grad_norm=1.0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, beta=0.0, num_iterations=1, epsilon=0.2,
        epsilon_high=0.28, loss_type="dapo", scale_rewards="group", shuffle_dataset=False, use_vllm=False,
        log_completions=False, gradient_checkpointing=False,  # GRPOConfig defaults it on; LoopLMs do not support it
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.lr_warmup))
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward(load_reward_fn(REWARD, root=ROOT))],
                          args=config, train_dataset=dataset, processing_class=tokenizer,
                          optimizers=(optimizer, scheduler), callbacks=callbacks)
    return trainer, model


# -- timing -------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def interleave_callback(rl, state: dict):
    """A TrainerCallback: time each TRL step, then run (and time) one rltt step."""
    from transformers import TrainerCallback

    from rltt.telemetry import schema as m

    class Interleave(TrainerCallback):
        def on_train_begin(self, *a, **k):
            state["clock"] = Clock()
            state["gen0"] = (state["view"].generate_seconds, state["view"].generate_cpu_seconds)

        def on_step_end(self, args, trainer_state, control, **kwargs):
            wall, cpu = state["clock"].lap()
            view = state["view"]
            gen = (view.generate_seconds - state["gen0"][0], view.generate_cpu_seconds - state["gen0"][1])
            state["gen0"] = (view.generate_seconds, view.generate_cpu_seconds)
            state["trl"].append({"wall": wall, "cpu": cpu, "generate": gen[0], "generate_cpu": gen[1]})
            if state.get("run_rltt", True):
                rl.step += 1
                metrics = rl.train_step(rl.step)
                rl.logger.log(rl.step, metrics)
                wall, cpu = state["clock"].lap()
                state["rltt"].append({"wall": wall, "cpu": cpu, **{k: v for k, v in metrics.items()
                                                                     if k.startswith("time/")},
                                      "reward": metrics[m.REWARD_MEAN]})
            state["clock"].lap()  # the callback's own bookkeeping is nobody's step

        def on_log(self, args, trainer_state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                state["trl_logs"].append(dict(logs))

    return Interleave()


def run_rltt_alone(rl, state: dict, steps: int) -> None:
    from rltt.telemetry import schema as m

    clock = Clock()
    for _ in range(steps):
        rl.step += 1
        metrics = rl.train_step(rl.step)
        rl.logger.log(rl.step, metrics)
        wall, cpu = clock.lap()
        state["rltt"].append({"wall": wall, "cpu": cpu, **{k: v for k, v in metrics.items() if k.startswith("time/")},
                              "reward": metrics[m.REWARD_MEAN]})


def median(rows: list[dict], key: str, skip: int) -> float:
    values = [r[key] for r in rows[skip:] if key in r]
    return statistics.median(values) if values else float("nan")


# -- evaluation ---------------------------------------------------------------------------------
def solve_rate(model, rl, args, exit_policy: str | None = "final") -> float:
    from dataclasses import replace

    from rltt.orchestration.evaluator import evaluate
    from rltt.rollout import NativeEngine

    was_training = model.training  # the run's held-out settings (train.eval_*), at ``exit_policy``
    result = evaluate(NativeEngine(model), rl.eval_tasks, rl.tokenizer.decode, rl.runner,
                      replace(rl.evaluate.params, exit_policy=exit_policy))
    model.train(was_training)
    return result.solve_rate


def plain_copy(model_path: Path, state_dict: dict):
    """A fresh `LoopedForCausalLM` from ``model_path`` holding ``state_dict`` (TRL's trained weights)."""
    from rltt.orchestration.policy import load_policy

    model, _ = load_policy(model_path, "fp32", "cpu")
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"TRL weights do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


# -- the benchmark --------------------------------------------------------------------------------
def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    model_path, model_desc = resolve_model(args.model, out)
    for sub in ("rltt", "trl"):  # a fresh run: rltt's metrics logger appends to an existing metrics.jsonl
        shutil.rmtree(out / sub, ignore_errors=True)

    from rltt.orchestration.policy import load_policy

    rl = make_rltt(args, model_path, out / "rltt")
    start_model, _ = load_policy(model_path, "fp32", "cpu")
    model_exit_policy = rl.learner_model().config.exit_policy
    rl_exit_policy = rl.recipe.rollout.exit_policy or model_exit_policy
    t0 = time.perf_counter()
    before = solve_rate(start_model, rl, args)
    before_own = solve_rate(start_model, rl, args, rl_exit_policy) if rl_exit_policy != "final" else before
    eval_seconds = time.perf_counter() - t0

    tasks = step_tasks(rl, args.steps)
    state: dict = {"trl": [], "rltt": [], "trl_logs": [], "run_rltt": args.schedule == "interleaved"}
    callback = interleave_callback(rl, state)
    trainer, view = make_trl(args, model_path, tasks, out / "trl", [callback])
    state["view"] = type(view)
    if args.schedule == "rltt-first":
        run_rltt_alone(rl, state, args.steps)
    trainer.train()
    if args.schedule == "trl-first":
        run_rltt_alone(rl, state, args.steps)
    rl.logger.close()
    if state["trl_logs"] and len(state["trl"]) != args.steps:
        raise RuntimeError(f"TRL ran {len(state['trl'])} optimizer steps, expected {args.steps}")

    # same evaluator, same held-out problems, for both final models
    trl_model = plain_copy(model_path, {k: v.detach().clone() for k, v in view.state_dict().items()})
    rltt_final = rl.learner_model()
    after_rltt = solve_rate(rltt_final, rl, args)
    after_rltt_own = solve_rate(rltt_final, rl, args, rl_exit_policy) if rl_exit_policy != "final" else after_rltt
    after_trl = solve_rate(trl_model, rl, args)

    skip = min(args.warmup_steps, args.steps - 1)
    res = {
        "model": model_desc, "model_exit_policy": model_exit_policy, "rltt_exit_policy": rl_exit_policy,
        "steps": args.steps, "warmup_steps_excluded": skip, "prompts": args.prompts, "group": args.group,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "lr": args.lr,
        "lr_warmup": args.lr_warmup, "micro": args.micro, "schedule": args.schedule,
        "threads": torch.get_num_threads(), "eval_size": len(rl.eval_tasks), "eval_samples": args.eval_samples,
        "rltt_algorithm": {k: getattr(rl.recipe.algorithm, k) for k in
                           ("policy_logprob", "loss", "eps_low", "eps_high", "aggregation", "advantage_scale",
                            "kl_coef", "track_kl", "hybrid_logprob", "ppo_epochs")},
        "rltt_step_s": median(state["rltt"], "wall", skip), "trl_step_s": median(state["trl"], "wall", skip),
        "rltt_step_cpu_s": median(state["rltt"], "cpu", skip), "trl_step_cpu_s": median(state["trl"], "cpu", skip),
        "rltt_time": {k: median(state["rltt"], k, skip) for k in
                      ("time/rollout", "time/learner", "time/weight_sync", "time/step")},
        "trl_time": {"generate": median(state["trl"], "generate", skip),
                     "generate_cpu": median(state["trl"], "generate_cpu", skip)},
        "rltt_steps": state["rltt"], "trl_steps": state["trl"],
        "train_reward_rltt": [r["reward"] for r in state["rltt"]],
        "train_reward_trl": [float(r["reward"]) for r in state["trl_logs"]],
        "solve_before": before, "solve_before_own": before_own, "solve_after_rltt": after_rltt,
        "solve_after_rltt_own": after_rltt_own, "solve_after_trl": after_trl,
        "eval_seconds_one": eval_seconds / (1 if before_own is before else 2),
        "total_seconds": time.perf_counter() - t_start,
    }
    res["ratio_wall"] = res["rltt_step_s"] / res["trl_step_s"]
    res["ratio_cpu"] = res["rltt_step_cpu_s"] / res["trl_step_cpu_s"]
    res["gain_rltt"] = after_rltt - before
    res["gain_trl"] = after_trl - before
    res["target_met"] = bool(res["ratio_wall"] <= 0.5 and res["gain_rltt"] >= res["gain_trl"])
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    return res


def format_table(res: dict) -> str:
    rt, tt = res["rltt_time"], res["trl_time"]
    lines = [
        f"model: {res['model']}; config exit_policy={res['model_exit_policy']}, rltt rollout exit policy="
        f"{res['rltt_exit_policy']}, TRL: final",
        f"P={res['prompts']} prompts x G={res['group']} = {res['prompts'] * res['group']} completions/step, "
        f"max_new_tokens={res['max_new_tokens']}, temperature={res['temperature']}, lr={res['lr']} "
        f"(warmup {res['lr_warmup']}), micro-batch {res['micro']}, {res['steps']} steps ({res['schedule']}), "
        f"median over steps {res['warmup_steps_excluded'] + 1}..{res['steps']}, {res['threads']} threads",
        "",
        "                         rltt      TRL   ratio rltt/TRL",
        f"step wall s          {res['rltt_step_s']:8.2f} {res['trl_step_s']:8.2f}   {res['ratio_wall']:6.2f}",
        f"step process-CPU s   {res['rltt_step_cpu_s']:8.2f} {res['trl_step_cpu_s']:8.2f}   {res['ratio_cpu']:6.2f}",
        f"  rollout/generate s {rt['time/rollout']:8.2f} {tt['generate']:8.2f}",
        f"  learner (rest) s   {rt['time/learner']:8.2f} {res['trl_step_s'] - tt['generate']:8.2f}",
        "",
        f"held-out solve rate ({res['eval_size']} problems x {res['eval_samples']} samples, T={res['temperature']}, "
        f"exit_policy=final, rltt evaluate/NativeEngine):",
        f"  start {res['solve_before']:.3f} | rltt {res['solve_after_rltt']:.3f} (gain {res['gain_rltt']:+.3f}) | "
        f"TRL {res['solve_after_trl']:.3f} (gain {res['gain_trl']:+.3f})",
    ]
    if res["rltt_exit_policy"] != "final":
        lines.append(f"  rltt's own exit policy ({res['rltt_exit_policy']}): start {res['solve_before_own']:.3f} -> "
                     f"{res['solve_after_rltt_own']:.3f}")
    lines.append(f"train reward per step: rltt {' '.join(f'{r:.2f}' for r in res['train_reward_rltt'])}")
    lines.append(f"                       TRL  {' '.join(f'{r:.2f}' for r in res['train_reward_trl'])}")
    lines.append(f"target (ratio <= 0.5 and gain >= TRL's): {'met' if res['target_met'] else 'missed'}; "
                 f"total {res['total_seconds']:.0f} s")
    return "\n".join(lines)


def write_section(body: str, path: Path = ROOT / "bench" / "RESULTS.md", append: bool = False) -> None:
    """Replace (or append) this benchmark's section of RESULTS.md, leaving the others alone;
    ``append`` adds ``body`` at the end of the existing section instead."""
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    found = pattern.search(text)
    if append and found:
        body = found.group(0)[len(SECTION):].strip() + "\n\n" + body.strip()
    block = f"{SECTION}\n\n{body.strip()}\n"
    if found:
        text = pattern.sub(lambda _: block + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="auto", help="auto | quickstart | tiny | checkpoint directory")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the median")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup", type=int, default=5)
    p.add_argument("--micro", type=int, default=32, help="micro-batch (completions); divides prompts x G")
    p.add_argument("--eval-size", type=int, default=128)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for both trainers (0: torch's default)")
    p.add_argument("--schedule", default="interleaved", choices=("interleaved", "rltt-first", "trl-first"))
    p.add_argument("--rltt-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra rltt recipe override (repeatable), e.g. algorithm.track_kl=false")
    p.add_argument("--out", default=str(ROOT / "runs" / "trl_compare"))
    p.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    p.add_argument("--append", action="store_true", help="with --write: add the table to the section "
                   "(another configuration) instead of replacing the section")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    table = format_table(res)
    print(table)
    if args.write:
        command = "python bench/trl_compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(f"Command:\n\n    {command.strip()}\n\n```\n{table}\n```\n", append=args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
