"""Scale: the memory plan (`rltt plan`) against measured peaks, at full size, on CPU.

Commands (from the repository root; each prints its tables and writes JSON under ``--out``,
default ``runs/bench-scale``):

    python bench/scale.py measure            # (a) plan vs measured: 12M / 80M / 320M, checkpointing off / on
    python bench/scale.py measure --smoke --out /tmp/scale    # tiny sizes (tests/bench/test_scale.py)
    python bench/scale.py report             # (a)'s tables from every configuration measured into --out
    python bench/scale.py full-shape         # (b) Ouro-1.4B's shape: bf16 rollouts + scoring; one fp32 step
    python bench/scale.py recipes            # (c) the plans of the GPU recipes on 80 GB and 141 GB GPUs

**(a) measure.** Random looped models (T = 4, Ouro-style sandwich norms, no injection; a char
tokenizer trained locally; the model's vocabulary is larger than the tokenizer's, ids beyond it
decode to nothing) of three sizes run ``rltt train`` (`rltt.orchestration.trainer.Trainer`,
in-process) on ``synthetic:quickstart``: torch backend, fp32, packed scoring (the default),
``algorithm.track_kl`` (a reference copy), two steps, no evaluation, no checkpoints. Each
(size, checkpointing) configuration runs in its own subprocess. ``trainer.engine.generate`` and
``trainer.learner.update`` are wrapped and the second step's calls measured (the first step
creates AdamW's moments, which the plan counts as resident: the second is the steady state).
Measured peak of a phase =

    live tensor bytes at the phase start (a gc scan of every tensor and parameter gradient,
    unique storages: ``t.untyped_storage().data_ptr()`` → ``nbytes()``)
  + the peak, over the phase, of the running sum of the CPU allocator's events in a
    ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` (+bytes at each allocation,
    −bytes at each free, in time order; a free of an older tensor counts negative).

That running sum is what the memory timeline sums (``prof._memory_profile().timeline``, CREATE −
DESTROY, with ``record_shapes=True, with_stack=True``): ``--timeline SIZES`` measures both and
they are equal to the byte on every configuration checked (tests/bench/test_scale.py too); the
timeline is opt-in because its analysis costs ~2 ms per event (80 k events in a 12 M rollout) and
stack capture slows small ops ~5×. It adds the profiler's tensor categories and the largest
tensors alive at the peak with the ops that made them (how the loop-summed gradients were found).

It is bytes of tensors (what the plan models), not RSS: allocator caches, the Python heap and
libraries are the plan's ``runtime`` component, left out on both sides. The plan is the run's own
(``Trainer.plan``, device ``cpu``), with ``data.max_prompt_tokens`` set to the longest prompt the
two steps draw (drawn first, with the run's tokenizer and template); completions run to
``max_new_tokens`` unless the random model stops (``length/mean`` is reported beside each row).

**(b) full-shape.** A random model of Ouro-1.4B's exact config (`bench/gpu_check`'s
``OURO_1_4B`` through `rltt.model.ouro.ouro_to_loop_config`, all 24 layers), built in bf16:
native rollouts (a few prompts, short completions) and the learner's scoring forward (packed, no
gradients), timed and measured as above; then one real ``rltt train`` step (rollout, rewards,
learner update, weight sync; the second step measured as in (a)) at full width and vocabulary
with ``--update-layers`` layers in fp32 (bf16 matmul backward on an AVX2 CPU is ~30× slower than
fp32) — ``auto``: the most layers whose plan fits half the memory available.

**(c) recipes.** The plans of ``recipes/gsm8k.yaml``, ``recipes/gsm8k-thinking.yaml`` and
``recipes/rltt-math.yaml`` with a
config-only Ouro-1.4B folder (what ``rltt plan RECIPE model.path=DIR --gpu-memory GiB`` prints).
``--gpu-memory`` is in GiB (2^30 bytes): an "80 GB" card is planned at 74.5 GiB (80·10^9 bytes,
the strictest reading; an 80 GB A100 or H100 reports about 79 GiB to CUDA) and the "141 GB" H200 at 131.3 GiB
(141·10^9 bytes; torch reports 139.8 GiB on one).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rltt.telemetry.schema import GIB  # noqa: E402

#: model sizes of (a): a LoopConfig's fields (T = 4, Ouro-style norms); parameters in the name
SIZES = {
    "12M": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=768, vocab_size=16384),
    "80M": dict(hidden_size=640, num_hidden_layers=8, num_attention_heads=10, intermediate_size=1792,
                vocab_size=32000),
    "320M": dict(hidden_size=1280, num_hidden_layers=12, num_attention_heads=10, intermediate_size=3456,
                 vocab_size=32000),
}
SMOKE_SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=512),
}


@dataclass(frozen=True)
class Work:
    """One step's work: prompts × G rows, completions of up to ``new_tokens``, learner micro-batch."""

    prompts: int = 2
    group: int = 4
    new_tokens: int = 32
    micro: int = 4


WORK = Work()
SMOKE_WORK = Work(prompts=2, group=2, new_tokens=6, micro=2)
STEPS = 2  # the second step is measured


# -- the meter -----------------------------------------------------------------------------------------
def live_tensor_bytes() -> int:
    """Bytes of the storages of every live tensor Python can see (and of every parameter's
    gradient), each storage once."""
    import torch

    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on lazy modules' objects warns
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor):
                    continue
                tensors = [obj]
                if obj.is_leaf and obj.requires_grad and obj.grad is not None:
                    tensors.append(obj.grad)
                for t in tensors:
                    if t.is_sparse or t.device.type == "meta":
                        continue
                    s = t.untyped_storage()
                    storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
            except Exception:  # noqa: BLE001 - odd objects (nested, functional wrappers): skipped
                continue
    storages.pop(0, None)  # empty storages
    return sum(storages.values())


@dataclass
class PhaseMeasure:
    """One measured call: live bytes at its start, the peak of what it created, its time."""

    start_bytes: int
    created_peak: int
    seconds: float
    events: int = 0  # allocator events
    timeline_peak: int | None = None  # the memory timeline's CREATE − DESTROY peak (``timeline``)
    categories: dict = field(default_factory=dict)  # created bytes per profiler category at that peak
    largest: list = field(default_factory=list)  # the largest tensors created and alive there, with their ops

    @property
    def peak(self) -> int:
        return self.start_bytes + self.created_peak

    def to_json(self) -> dict:
        return {**asdict(self), "peak": self.peak}


def allocation_peak(prof) -> tuple[int, int]:
    """``(peak, events)`` of the running sum of the allocator's ``[memory]`` events of a profile
    (+bytes at an allocation, −bytes at a free, in time order): the peak of what was allocated
    and not yet freed since the profile started (a free of an older allocation counts negative)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak, len(events)


def memory_timeline_peak(prof, top: int = 12) -> tuple[int, int, dict, list]:
    """``(peak, events, categories, largest)`` of the running sum CREATE − DESTROY over
    ``prof._memory_profile().timeline`` (tensors created in the profile, less those destroyed): its
    peak, the created bytes per profiler category at that peak, and the ``top`` largest tensors
    created and alive there with the op (and its parent op) that made them — a diagnosis."""
    from torch.profiler._memory_profiler import Action

    memory = prof._memory_profile()
    timeline = memory.timeline
    running = peak = 0
    peak_at = -1
    for i, (_, action, _, size) in enumerate(timeline):
        if action in (Action.CREATE, Action.DESTROY):
            running += size if action == Action.CREATE else -size
            if running > peak:
                peak, peak_at = running, i
    live: dict = {}
    for _, action, (key, version), size in timeline[: peak_at + 1]:
        if action == Action.CREATE:
            live[key] = (size, version)
        elif action == Action.DESTROY:
            live.pop(key, None)

    def category(key, version) -> str:
        try:
            c = memory._categories.get(key, version)
        except Exception:  # noqa: BLE001 - categories are a diagnosis only
            c = None
        return c.name.lower() if c is not None else "unknown"

    by_cat: dict[str, int] = {}
    for key, (size, version) in live.items():
        name = category(key, version)
        by_cat[name] = by_cat.get(name, 0) + size
    creators: dict = {}
    for node in memory._data_flow_graph.flow_nodes:
        event = node._event
        parent = getattr(event, "parent", None)
        where = event.name + (f" < {parent.name}" if parent is not None else "")
        for key in node.outputs:
            creators.setdefault(key, where)
        for key in node.intermediates:
            creators.setdefault(key, where + " (intermediate)")
    largest = sorted(live.items(), key=lambda kv: -kv[1][0])[:top]
    largest = [{"bytes": size, "category": category(key, version), "op": creators.get(key, "?")}
               for key, (size, version) in largest]
    return peak, len(timeline), {k: v for k, v in by_cat.items() if v}, largest


def measure_call(fn, *args, timeline: bool = False, **kwargs):
    """``(fn(*args, **kwargs), PhaseMeasure)`` on CPU (module docstring). ``created_peak`` is the
    allocator events' running peak; with ``timeline`` the call is profiled with shapes and stacks
    too and the memory timeline's CREATE − DESTROY peak is recorded beside it (``timeline_peak``,
    with the profiler's tensor categories at that peak) — the two agree; the timeline's analysis
    costs ~2 ms per event, so it is opt-in."""
    from torch.profiler import ProfilerActivity, profile

    start = live_tensor_bytes()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=timeline,
                 with_stack=timeline) as prof:
        out = fn(*args, **kwargs)
    seconds = time.perf_counter() - t0
    peak, events = allocation_peak(prof)
    measured = PhaseMeasure(start, peak, seconds, events)
    if timeline:
        measured.timeline_peak, _, measured.categories, measured.largest = memory_timeline_peak(prof)
    return out, measured


class PhaseRecorder:
    """Wraps ``engine.generate`` (phase ``rollout``) and ``learner.update`` (phase ``learner``) of a
    trainer; call number ``at_call`` of each is measured."""

    def __init__(self, engine, learner, at_call: int, timeline: tuple[str, ...] = ()):
        self.at_call, self.timeline = at_call, timeline  # the phases also measured by the memory timeline
        self.calls = {"rollout": 0, "learner": 0}
        self.results: dict[str, PhaseMeasure] = {}
        self._wrap(engine, "generate", "rollout")
        self._wrap(learner, "update", "learner")

    def _wrap(self, obj, attr: str, phase: str) -> None:
        original = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            self.calls[phase] += 1
            if self.calls[phase] != self.at_call:
                return original(*args, **kwargs)
            out, measured = measure_call(original, *args, timeline=phase in self.timeline, **kwargs)
            self.results[phase] = measured
            return out

        setattr(obj, attr, wrapped)


# -- models and recipes -------------------------------------------------------------------------------
def train_char_tokenizer():
    from rltt.data import synthetic
    from rltt.data.tokenizer import train_tokenizer

    texts = [r["question"] + "\n" + r["answer"] for r in synthetic.generate(200, "quickstart", seed=5)]
    return train_tokenizer(texts, vocab_size=128, kind="char")


def build_model(path: Path, fields: dict, dtype: str = "fp32") -> int:
    """A random LoopLM (T = 4, Ouro-style norms unless ``fields`` say otherwise) with a char tokenizer,
    saved to ``path``; its parameter count. The vocabulary is the model's (the tokenizer's ids are
    its first ones; a sampled id beyond them decodes to nothing)."""
    import torch

    from rltt.model import LoopConfig, LoopedForCausalLM

    tok = train_char_tokenizer()
    fields = dict(dict(num_loops=4, norm_placement="ouro", injection="none", max_position_embeddings=2048,
                       exit_policy="final"), **fields)
    config = LoopConfig(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, **fields)
    torch.manual_seed(0)
    model = LoopedForCausalLM(config)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def recipe_dict(model_dir: Path, run_dir: Path, work: Work, checkpointing: bool, pack: bool, threads: int,
                max_prompt_tokens: int = 512, steps: int = STEPS) -> dict:
    return {
        "model": {"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        "data": {"source": "synthetic:quickstart", "eval_size": 8, "max_prompt_tokens": max_prompt_tokens,
                 "drop_long_prompts": True},  # the held-out prompts (no evaluation runs)
        "rewards": [{"fn": str(ROOT / "rewards" / "gsm8k.py") + ":strict"}],
        "rollout": {"prompts_per_step": work.prompts, "group_size": work.group, "max_new_tokens": work.new_tokens,
                    "schedule": "deferred", "exit_policy": "sample"},
        "algorithm": {"track_kl": True},
        "learner": {"backend": "torch", "dtype": "fp32", "lr": 1e-5, "micro_batch_size": work.micro,
                    "activation_checkpointing": checkpointing, "pack_sequences": pack},
        "train": {"steps": steps, "eval_every": 0, "threads": threads},
        "logging": {"run_dir": str(run_dir), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0, "save_final": False},
    }


def write_recipe(path: Path, recipe: dict) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def drawn_prompt_lengths(recipe, steps: int) -> list[int]:
    """Token counts of the prompts ``steps`` steps of ``recipe`` draw, with its tokenizer and
    template, in order (as `Trainer` builds its prompt stream)."""
    from transformers import AutoTokenizer

    from rltt.data.prompts import recipe_prompt_renderer
    from rltt.orchestration.prompt_stream import PromptStream

    tok = AutoTokenizer.from_pretrained(recipe.model.path, local_files_only=True)
    encode = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    template = recipe_prompt_renderer(recipe.data, tok)
    d = recipe.data
    stream = PromptStream(d.source, encode, template, d.split, d.limit, d.seed)
    return [len(t.prompt_ids) for t in stream.next(recipe.rollout.prompts_per_step * steps)]


def plan_figures(plan) -> dict:
    """The plan without its runtime/reserve component (no tensors): resident, per phase."""
    from rltt.planning.footprint import LEARNER, RESIDENT, ROLLOUT

    c = plan.components
    resident = sum(c[k] for k in RESIDENT if k != "runtime")
    return {
        "components": dict(c),
        "resident": resident,
        "rollout_extra": sum(c[k] for k in ROLLOUT),
        "learner_extra": plan.phases["learner"] - c["runtime"] - resident,
        "rollout": plan.phases["rollout"] - c["runtime"],
        "learner": plan.phases["learner"] - c["runtime"],
        "prompt_tokens": plan.prompt_tokens, "completion_tokens": plan.completion_tokens,
        "micro_batch_rows": plan.micro_batch_rows, "rows_per_chunk": plan.rollout_rows_per_chunk,
        "parameters": plan.parameters,
    }


# -- one configuration (in its own process) ---------------------------------------------------------------
def run_train_config(recipe_path: Path, steps: int = STEPS, timeline: tuple[str, ...] = ()) -> dict:
    """``rltt train`` of a written recipe, in this process, its last step's phases measured; the
    recipe's ``data.max_prompt_tokens`` is first set to the longest prompt the run draws."""
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.orchestration.trainer import Trainer
    from rltt.telemetry import read_metrics
    from rltt.telemetry import schema as m

    import yaml

    lengths = drawn_prompt_lengths(load_train_recipe(recipe_path, []), steps)
    raw = yaml.safe_load(recipe_path.read_text())
    raw["data"]["max_prompt_tokens"] = max(lengths)
    write_recipe(recipe_path, raw)  # the recipe as run: `rltt train RECIPE` reproduces it
    recipe = load_train_recipe(recipe_path, [])
    run_dir = Path(recipe.logging.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    trainer = Trainer(recipe, recipe_root=ROOT)
    load_s = time.perf_counter() - t0
    recorder = PhaseRecorder(trainer.engine, trainer.learner, at_call=steps, timeline=timeline)
    t0 = time.perf_counter()
    trainer.run()
    run_s = time.perf_counter() - t0
    records = [r for r in read_metrics(run_dir) if r["step"] == steps]
    metrics = records[-1] if records else {}
    per_step = recipe.rollout.prompts_per_step
    return {
        "recipe": str(recipe_path),
        "plan": plan_figures(trainer.plan),
        "measured": {k: v.to_json() for k, v in recorder.results.items()},
        "prompt_lengths": lengths,
        "measured_step_longest_prompt": max(lengths[(steps - 1) * per_step: steps * per_step]),
        "length_mean": metrics.get(m.LENGTH_MEAN), "length_max": metrics.get(m.LENGTH_MAX),
        "time_rollout_s": metrics.get(m.TIME_ROLLOUT), "time_learner_s": metrics.get(m.TIME_LEARNER),
        "load_s": round(load_s, 2), "run_s": round(run_s, 2),
    }


def worker(args) -> int:
    """``_config``: one configuration, its result as JSON in ``--result``."""
    import torch

    torch.set_num_threads(args.threads)
    if args.build:
        spec = json.loads(args.build)
        build_model(Path(spec["path"]), spec["fields"], spec.get("dtype", "fp32"))
    timeline = tuple(p for p in args.timeline.split(",") if p)
    result = run_train_config(Path(args.recipe), timeline=timeline) if args.recipe else {}
    result["peak_rss_gib"] = round(_status_kib("VmHWM") / (1 << 20), 3)
    Path(args.result).write_text(json.dumps(result, indent=1))
    return 0


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def run_worker(argv: list[str], log: Path, timeout: float | None = None) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_config", *argv], cwd=ROOT, env=env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"worker {' '.join(argv)} exited {proc.returncode}; log: {log}\n"
                           + log.read_text()[-3000:])


# -- (a) measure ------------------------------------------------------------------------------------------
def measure(args) -> int:
    sizes = SMOKE_SIZES if args.smoke else SIZES
    work = SMOKE_WORK if args.smoke else WORK
    names = [s.strip() for s in (args.sizes or ",".join(sizes)).split(",") if s.strip()]
    unknown = [s for s in names if s not in sizes]
    if unknown:
        raise SystemExit(f"--sizes: unknown size {unknown[0]!r} (choose from {', '.join(sizes)})")
    modes = [m.strip() for m in args.checkpointing.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        model_dir = out / "models" / name
        for mode in modes:
            ckpt = mode == "on"
            tag = f"{name}-ckpt-{mode}" + ("" if args.pack else "-padded")
            recipe = write_recipe(out / "recipes" / f"{tag}.yaml",
                                  recipe_dict(model_dir, out / "runs" / tag, work, ckpt, args.pack, args.threads))
            argv = ["--recipe", str(recipe), "--result", str(out / f"{tag}.json"), "--threads", str(args.threads)]
            if name in args.timeline.split(","):
                argv += ["--timeline", args.timeline_phases]
            if not (model_dir / "config.json").is_file():
                argv += ["--build", json.dumps({"path": str(model_dir), "fields": sizes[name]})]
            print(f"[scale] {tag} ...", flush=True)
            start = time.perf_counter()
            run_worker(argv, out / f"{tag}.log")
            result = json.loads((out / f"{tag}.json").read_text())
            result.update(size=name, checkpointing=ckpt, pack=args.pack, wall_s=round(time.perf_counter() - start, 1))
            (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
            rows.append(result)
            print(format_rows([result]), flush=True)
    summary = {"command": "python bench/scale.py " + " ".join(args.argv), "work": asdict(work), "rows": rows}
    (out / "measure.json").write_text(json.dumps(summary, indent=1))
    print()
    print(format_rows(rows, header=True))
    print()
    print(format_breakdown(rows))
    return 0


def _gib(n) -> str:
    return "—" if n is None else f"{n / GIB:.3f}"


def format_rows(rows: list[dict], header: bool = True) -> str:
    lines = []
    if header:
        lines += ["| size | params | phase | checkpointing | planned GiB | measured GiB | planned/measured | "
                  "prompt + completion (mean) |",
                  "|---|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        for phase in ("rollout", "learner"):
            planned = r["plan"][phase]
            measured = r["measured"].get(phase, {}).get("peak")
            ratio = f"{planned / measured:.3f}" if measured else "—"
            lengths = f"{r['plan']['prompt_tokens']} + {r['plan']['completion_tokens']} ({r['length_mean']:.1f})" \
                if r.get("length_mean") is not None else ""
            lines.append(f"| {r['size']} | {r['plan']['parameters'] / 1e6:.1f} M | {phase} | "
                         f"{'on' if r['checkpointing'] else 'off'} | {_gib(planned)} | {_gib(measured)} | "
                         f"{ratio} | {lengths} |")
    return "\n".join(lines)


def format_breakdown(rows: list[dict]) -> str:
    """Resident (planned vs live at the phase start) and the phase's own part (planned vs the peak
    of what the phase created), with the profiler's categories at that peak."""
    lines = ["| size | phase | ckpt | resident planned / at start GiB | phase part planned / created peak GiB | "
             "created at the peak, by profiler category (GiB) |", "|---|---|---|---|---|---|"]
    for r in rows:
        for phase in ("rollout", "learner"):
            m = r["measured"].get(phase)
            if not m:
                continue
            cats = ", ".join(f"{k} {v / GIB:.3f}" for k, v in sorted(m["categories"].items(), key=lambda kv: -kv[1]))
            if m.get("timeline_peak") is not None:
                cats = f"timeline peak {_gib(m['timeline_peak'])}: {cats}"
            lines.append(f"| {r['size']} | {phase} | {'on' if r['checkpointing'] else 'off'} | "
                         f"{_gib(r['plan']['resident'])} / {_gib(m['start_bytes'])} | "
                         f"{_gib(r['plan'][phase + '_extra'])} / {_gib(m['created_peak'])} | {cats} |")
    return "\n".join(lines)


def report(args) -> int:
    """The tables of every configuration measured into ``--out`` so far (``<size>-ckpt-<mode>.json``)."""
    out = Path(args.out)
    order = {name: i for i, name in enumerate([*SMOKE_SIZES, *SIZES])}
    rows = []
    for f in sorted(out.glob("*-ckpt-*.json")):
        r = json.loads(f.read_text())
        if "size" in r:
            rows.append(r)
    rows.sort(key=lambda r: (order.get(r["size"], 99), not r.get("pack", True), r["checkpointing"]))
    print(format_rows(rows))
    print()
    print(format_breakdown(rows))
    return 0


# -- (b) the full shape -------------------------------------------------------------------------------------
def ouro_1_4b() -> dict:
    """Ouro-1.4B's config.json fields (bench/gpu_check's ``OURO_1_4B``)."""
    import importlib.util

    package = ROOT / "bench" / "gpu_check"
    spec = importlib.util.spec_from_file_location("gpu_check", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return dict(module.OURO_1_4B)


#: ``full-shape --smoke``: the same code paths on an Ouro-style config of tiny sizes
SMOKE_OURO = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2)


def ouro_config(smoke: bool = False) -> dict:
    """Ouro-1.4B's config.json, or with ``smoke`` its tiny variant."""
    return dict(ouro_1_4b(), **SMOKE_OURO) if smoke else ouro_1_4b()


def ouro_fields(layers: int | None = None, smoke: bool = False) -> dict:
    """LoopConfig fields of Ouro-1.4B (`rltt.model.ouro.ouro_to_loop_config`), optionally fewer layers."""
    from rltt.model.ouro import ouro_to_loop_config

    config = ouro_config(smoke)
    if layers is not None:
        config["num_hidden_layers"] = layers
    c = ouro_to_loop_config(config)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "attention_bias", "tie_word_embeddings", "num_loops", "norm_placement", "injection", "carry_normed_state")
    return {k: getattr(c, k) for k in keys}


SHAPE_WORK = dict(prompts=2, group=2, prompt_len=16, new_tokens=8)  # bf16 rollouts + scoring of the full shape
UPDATE_WORK = Work(prompts=2, group=4, new_tokens=16, micro=4)  # the fp32 train step


def shape_worker(args) -> int:
    """``_shape``: Ouro-1.4B's full shape in bf16 — build, native rollouts, the scoring forward."""
    import math

    import torch

    from rltt.learner.learner_batch import LearnerBatch
    from rltt.learner.scoring import score_tokens
    from rltt.model import LoopConfig, LoopedForCausalLM
    from rltt.model.exits import gate_lambda
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.planning import plan_run
    from rltt.rollout import NativeEngine, SamplingParams

    torch.set_num_threads(args.threads)
    w = SHAPE_WORK
    out = Path(args.out)
    result: dict = {"work": w, "smoke": args.smoke}
    fields = ouro_fields(smoke=args.smoke)
    config = LoopConfig(exit_policy="sample", **fields)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy on the way
    torch.manual_seed(0)
    model = LoopedForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    lam = gate_lambda(2.5, config.num_loops)  # E[t*] = 2.5 of 4 under the sample exit policy
    with torch.no_grad():
        model.model.exit_gate.weight.zero_()
        model.model.exit_gate.bias.fill_(math.log(lam / (1 - lam)))
    result["build_s"] = round(time.perf_counter() - t0, 2)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["layers"] = config.num_hidden_layers
    result["rss_after_build_gib"] = round(_status_kib("VmRSS") / (1 << 20), 3)
    print(f"[scale] built {result['parameters']:,} parameters in {result['build_s']} s", flush=True)

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, config.vocab_size, (w["prompt_len"],), generator=gen).tolist()
               for _ in range(w["prompts"])]
    params = SamplingParams(temperature=1.0, max_new_tokens=w["new_tokens"], n=w["group"], seed=3,
                            schedule="deferred", exit_policy="sample", ignore_eos=True)
    engine = NativeEngine(model)
    rollout, measured = measure_call(engine.generate, prompts, params)
    result["rollout"] = measured.to_json()
    result["rollout_tokens"] = int(rollout.completion_mask.sum())
    result["rollout_passes"] = rollout.stats.passes
    print(f"[scale] rollout {measured.seconds:.1f} s", flush=True)

    batch = LearnerBatch.from_rollout(rollout)
    model.train()  # the learner's scoring pass (at the rollout weights: no gradients)
    with torch.no_grad():
        scores, measured = measure_call(score_tokens, model, batch, pack=True)
    model.eval()
    result["scoring"] = measured.to_json()
    result["scored_tokens"] = int(batch.target_mask.sum())
    result["scoring_finite"] = bool(torch.isfinite(scores.logprobs).all())
    print(f"[scale] scoring forward {measured.seconds:.1f} s", flush=True)

    # the plan of the same rollout: the engine alone holds the weights (bf16, no learner here)
    folder = out / "ouro-1.4b-config"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(ouro_config(args.smoke)))
    recipe = load_train_recipe(write_recipe(out / "recipes" / "full-shape-bf16.yaml", {
        "model": {"path": str(folder), "dtype": "bf16", "device": "cpu"},
        "data": {"source": "synthetic:quickstart", "max_prompt_tokens": w["prompt_len"]},
        "rollout": {"prompts_per_step": w["prompts"], "group_size": w["group"], "max_new_tokens": w["new_tokens"]},
        "algorithm": {"track_kl": False},
        "learner": {"backend": "torch", "dtype": "bf16"},
        "logging": {"run_dir": str(out / "runs" / "full-shape-bf16")},
    }), [])
    plan = plan_run(recipe, ouro_config(args.smoke), 64 * GIB, device="cpu")
    c = plan.components
    result["plan"] = {"weights": c["weights"], "rollout_extra": c["rollout_kv"] + c["rollout_state"]
                      + c["rollout_workspace"], "components": dict(c)}
    result["peak_rss_gib"] = round(_status_kib("VmHWM") / (1 << 20), 3)
    Path(args.result).write_text(json.dumps(result, indent=1))
    return 0


def update_layers_auto(work: Work, budget_bytes: int) -> tuple[int, int]:
    """The most layers (4–24, at least 4) whose fp32 ``rltt train`` step plans within
    ``budget_bytes`` (the plan's peak without its runtime, plus ~2 GiB for the process); and that
    peak."""
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.planning import plan_run

    import tempfile

    best = None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        recipe_path = write_recipe(Path(tmp) / "r.yaml", recipe_dict(folder, Path(tmp) / "run", work, False, True, 1,
                                                                    max_prompt_tokens=160))
        for layers in range(4, 25):
            config = {"model_type": "rltt_looped", **ouro_fields(layers)}
            (folder / "config.json").write_text(json.dumps(config))
            plan = plan_run(load_train_recipe(recipe_path, []), config, 1 << 50, device="cpu")
            peak = plan.peak_bytes - plan.components["runtime"] + 2 * GIB  # the process itself: ~2 GiB
            if peak > budget_bytes and best is not None:
                break
            best = (layers, peak)  # at least 4 layers, whatever the budget
            if peak > budget_bytes:
                break
    return best


def full_shape(args) -> int:
    from rltt.planning.sources import available_cpu_bytes

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"command": "python bench/scale.py " + " ".join(args.argv)}
    if "shape" in args.parts:
        print("[scale] full shape in bf16: build, rollouts, scoring forward ...", flush=True)
        run_worker_cmd("_shape", ["--out", str(out), "--result", str(out / "full-shape-bf16.json"),
                                  "--threads", str(args.threads)] + ["--smoke"] * args.smoke,
                       out / "full-shape-bf16.log")
        summary["bf16"] = json.loads((out / "full-shape-bf16.json").read_text())
    if "update" in args.parts:
        available = available_cpu_bytes()
        planned_peak = None
        if args.smoke:
            layers = 1
        elif args.update_layers == "auto":
            layers, planned_peak = update_layers_auto(UPDATE_WORK, int(args.memory_fraction * available))
        else:
            layers = int(args.update_layers)
        print(f"[scale] fp32 rltt train step with {layers} of 24 layers (available {available / GIB:.1f} GiB) ...",
              flush=True)
        tag = f"full-width-{layers}L" + "-smoke" * args.smoke
        model_dir = out / "models" / tag
        work = SMOKE_WORK if args.smoke else UPDATE_WORK
        recipe = write_recipe(out / "recipes" / f"{tag}.yaml",
                              recipe_dict(model_dir, out / "runs" / tag, work, False, True, args.threads))
        argv = ["--recipe", str(recipe), "--result", str(out / f"{tag}.json"), "--threads", str(args.threads)]
        if not (model_dir / "config.json").is_file():
            argv += ["--build", json.dumps({"path": str(model_dir), "fields": ouro_fields(layers, args.smoke)})]
        start = time.perf_counter()
        run_worker(argv, out / f"{tag}.log")
        result = json.loads((out / f"{tag}.json").read_text())
        result.update(size=f"Ouro width, {layers} layers", layers=layers, checkpointing=False, pack=True,
                      available_gib=round(available / GIB, 1), wall_s=round(time.perf_counter() - start, 1),
                      layers_choice=None if planned_peak is None else
                      f"auto: the most layers whose planned peak + ~2 GiB of process is within "
                      f"{args.memory_fraction:g} of the {available / GIB:.1f} GiB available "
                      f"({planned_peak / GIB:.1f} GiB)")
        (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
        summary["update"] = result
    (out / "full-shape.json").write_text(json.dumps(summary, indent=1, default=str))
    print(format_full_shape(summary))
    return 0


def format_full_shape(summary: dict) -> str:
    lines = []
    bf16 = summary.get("bf16")
    if bf16:
        w, r, sc = bf16["work"], bf16["rollout"], bf16["scoring"]
        planned = bf16["plan"]["weights"] + bf16["plan"]["rollout_extra"]
        lines += [
            f"Ouro-1.4B shape, random, bf16: {bf16['parameters']:,} parameters, built in {bf16['build_s']} s "
            f"(RSS {bf16['rss_after_build_gib']} GiB)",
            "",
            "| what | work | time s | live at start GiB | created peak GiB | peak GiB | planned GiB | "
            "planned/measured |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
            f"| native rollout (deferred, sampled exits) | {w['prompts']} prompts × G={w['group']}, prompt "
            f"{w['prompt_len']} + {w['new_tokens']} new tokens ({bf16['rollout_tokens']} tokens, "
            f"{bf16['rollout_passes']} passes) | {r['seconds']:.1f} | {_gib(r['start_bytes'])} | "
            f"{_gib(r['created_peak'])} | {_gib(r['peak'])} | {_gib(planned)} (weights + rollout terms) | "
            f"{planned / r['peak']:.3f} |",
            f"| learner scoring forward (packed, no gradients) | the rollout's {bf16['scored_tokens']} completion "
            f"tokens, all {bf16['layers']} layers × T=4 | {sc['seconds']:.1f} | {_gib(sc['start_bytes'])} | "
            f"{_gib(sc['created_peak'])} | {_gib(sc['peak'])} | — | — |",
            "",
            f"peak RSS of the process: {bf16['peak_rss_gib']} GiB; log-probs finite: {bf16['scoring_finite']}",
        ]
    update = summary.get("update")
    if update:
        lines += ["", f"fp32 `rltt train` at full width and vocabulary, {update['layers']} of 24 layers "
                      f"({update['plan']['parameters']:,} parameters; second step measured; rollout "
                      f"{update['time_rollout_s']:.1f} s, learner {update['time_learner_s']:.1f} s; peak RSS "
                      f"{update['peak_rss_gib']} GiB):", "", format_rows([update])]
    return "\n".join(lines)


def run_worker_cmd(command: str, argv: list[str], log: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), command, *argv], cwd=ROOT, env=env,
                              stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{command} exited {proc.returncode}; log: {log}\n" + log.read_text()[-3000:])


# -- (c) the GPU recipes' plans --------------------------------------------------------------------------------
RECIPES = ("recipes/gsm8k.yaml", "recipes/gsm8k-thinking.yaml", "recipes/rltt-math.yaml")


def recipe_plans(args) -> int:
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.planning import plan_run

    out = Path(args.out)
    folder = out / "ouro-1.4b-config"
    folder.mkdir(parents=True, exist_ok=True)
    config = ouro_1_4b()
    (folder / "config.json").write_text(json.dumps(config))
    sizes = [float(x) for x in args.gpu_memory.split(",")]
    rows = []
    for name in RECIPES:
        recipe = load_train_recipe(ROOT / name, [f"model.path={folder}"])
        for gib in sizes:
            plan = plan_run(recipe, config, int(gib * GIB), device="cuda")
            rows.append({"recipe": name, "gpu_gib": gib, **plan.to_json()})
    (out / "recipes.json").write_text(json.dumps(rows, indent=1))
    print(format_recipe_plans(rows))
    return 0


def format_recipe_plans(rows: list[dict]) -> str:
    g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
    lines = ["| recipe | --gpu-memory GiB | fits | rollout phase GiB (rows per chunk × chunks) | learner phase GiB | "
             "activations GiB (micro-batch, checkpointing) | resident GiB |", "|---|---:|---|---|---:|---|---:|"]
    for r in rows:
        c = r["components"]
        resident = sum(c[k] for k in ("weights", "reference", "engine_copy", "vllm", "optimizer", "master_weights"))
        lines.append(f"| {r['recipe']} | {r['gpu_gib']:g} | {'yes' if r['fits'] else 'NO'} | "
                     f"{g(r['phases']['rollout'])} "
                     f"({r['rollout_rows_per_chunk']} × {r['chunks_per_step']}) | {g(r['phases']['learner'])} | "
                     f"{g(c['activations'])} ({r['micro_batch_rows']} rows, "
                     f"{'on' if r['activation_checkpointing'] else 'off'}) | {g(resident)} |")
    first = rows[0]["components"]
    lines += ["", "components at the first size (GiB): "
              + ", ".join(f"{k} {v / GIB:.2f}" for k, v in first.items() if v)]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("measure", help="(a) plan vs measured peak memory of rltt train steps")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and work: seconds")
    p.add_argument("--sizes", default=None, help="comma-separated subset of the sizes")
    p.add_argument("--checkpointing", default="off,on", help="off, on or off,on (default)")
    p.add_argument("--padded", dest="pack", action="store_false", help="learner.pack_sequences=false")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeline", default="",
                   help="comma-separated sizes whose phases are also measured by the memory timeline (slow: ~2 ms "
                        "per event)")
    p.add_argument("--timeline-phases", default="rollout,learner", help="of those sizes, these phases")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-scale"))
    p.set_defaults(func=measure)
    r = sub.add_parser("report", help="the tables of every configuration measured into --out so far")
    r.add_argument("--out", default=str(ROOT / "runs" / "bench-scale"))
    r.set_defaults(func=report)
    f = sub.add_parser("full-shape", help="(b) Ouro-1.4B's shape: bf16 rollouts + scoring, one fp32 train step")
    f.add_argument("--parts", default="shape,update", help="shape (bf16, 24 layers), update (fp32 train step)")
    f.add_argument("--update-layers", default="auto",
                   help="layers of the fp32 train step; auto: the most whose plan fits --memory-fraction of the "
                        "available memory (at least 4)")
    f.add_argument("--memory-fraction", type=float, default=0.5)
    f.add_argument("--smoke", action="store_true", help="the same code paths on a tiny Ouro-style config")
    f.add_argument("--threads", type=int, default=2)
    f.add_argument("--out", default=str(ROOT / "runs" / "bench-scale"))
    f.set_defaults(func=full_shape)
    c = sub.add_parser("recipes", help="(c) plans of the GPU recipes on one GPU of each size")
    c.add_argument("--gpu-memory", default="74.5,131.3", help="GiB per GPU, comma-separated (default: 80 GB and "
                                                             "141 GB as 10^9 bytes)")
    c.add_argument("--out", default=str(ROOT / "runs" / "bench-scale"))
    c.set_defaults(func=recipe_plans)
    sh = sub.add_parser("_shape", help=argparse.SUPPRESS)
    sh.add_argument("--out", required=True)
    sh.add_argument("--result", required=True)
    sh.add_argument("--threads", type=int, default=2)
    sh.add_argument("--smoke", action="store_true")
    sh.set_defaults(func=shape_worker)
    w = sub.add_parser("_config", help=argparse.SUPPRESS)
    w.add_argument("--recipe", default=None)
    w.add_argument("--result", required=True)
    w.add_argument("--build", default=None)
    w.add_argument("--threads", type=int, default=2)
    w.add_argument("--timeline", default="", help="phases also measured by the memory timeline")
    w.set_defaults(func=worker)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if hasattr(args, "parts"):
        args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    return args


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
