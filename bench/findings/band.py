"""Finding 1, the solve-rate band: the same RL budget on prompts curated into a low, a mixed and
a high solve-rate band (``rltt curate --band`` on a pool that mixes the synthetic difficulty
presets); held-out gain and the share of uniform groups (zero advantage) per band."""

from __future__ import annotations

import json
from pathlib import Path

from .metrics import aggregate, diff_verdict, mean, rl_summary
from .runner import RL_RECIPE, Arm, Scale, done_arms, rel, train_arm

#: kept solve-rate windows (inclusive) of the three bands
BANDS = {"low": (0.0, 0.2), "mixed": (0.25, 0.6), "high": (0.7, 1.0)}
#: the synthetic difficulty presets the band pool is drawn from
POOL_PRESETS = ("trivial", "easy", "quickstart", "medium")


def write_pool(path: Path, per_preset: int) -> dict[str, int]:
    """The band pool: ``per_preset`` problems of each difficulty preset as one GSM8K file (ids
    ``PRESET-i``, unique across presets)."""
    from rltt.data import synthetic

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for preset in POOL_PRESETS:
            for i, record in enumerate(synthetic.generate(per_preset, preset, seed=0)):
                f.write(json.dumps({**record, "id": f"{preset}-{i}"}) + "\n")
    return {p: per_preset for p in POOL_PRESETS}


def band_arms(out: Path, scale: Scale) -> dict[str, Arm]:
    d = out / "band"
    pool, records = d / "pool.jsonl", d / "pool.curated.jsonl"
    arms = {"band-pool": Arm("band-pool", fn=lambda: write_pool(pool, scale.pool_per_preset), cost=0.1,
                             describe=f"{rel(pool)}: {scale.pool_per_preset} problems of each preset "
                                      f"{', '.join(POOL_PRESETS)} (rltt.data.synthetic.generate, seed 0; "
                                      "ids PRESET-i), one GSM8K-format JSONL")}
    previous = "band-pool"
    for band, (lo, hi) in BANDS.items():
        # the first call samples the pool; the next resume its records and write their own band
        name = f"band-curate-{band}"
        arms[name] = Arm(name, ["curate", RL_RECIPE, "train.threads=1", "--source", rel(pool), "--samples",
                                str(scale.curate_samples), "--band", f"{lo},{hi}", "--out", rel(records),
                                "--kept", rel(d / f"{band}.jsonl"), "--no-progress"],
                         deps=(previous,), cost=8.0 if band == "low" else 0.5)
        previous = name
    for band in BANDS:
        for seed in range(scale.seeds):
            name = f"band-{band}-s{seed}"
            arms[name] = train_arm(out, scale, name, seed, scale.rl_steps,
                                   [f"data.source={rel(d / f'{band}.jsonl')}", "data.eval_source=synthetic:quickstart"],
                                   cost=scale.rl_steps / 60 * 4, deps=(f"band-curate-{band}",))
    return arms


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file (rltt's one JSONL reader); none when it does not exist."""
    from rltt.data.gsm8k import read_jsonl as lines

    return [record for _, _, record in lines(path)] if path.is_file() else []


def band_results(out: Path, arms: dict[str, Arm], scale: Scale) -> dict:
    d = out / "band"
    res = {"bands": {}, "pool": {}}
    records = read_jsonl(d / "pool.curated.jsonl")
    for preset in POOL_PRESETS:
        rates = [r["solve_rate"] for r in records if r["id"].startswith(preset + "-")]
        res["pool"][preset] = {"prompts": len(rates), "mean_solve_rate": mean(rates)}
    res["pool_rates"] = [r["solve_rate"] for r in records]
    for band, (lo, hi) in BANDS.items():
        kept = read_jsonl(d / f"{band}.jsonl")
        runs = [rl_summary(a.run_dir) for a in done_arms(arms, f"band-{band}-s")]
        res["bands"][band] = {
            "window": [lo, hi], "prompts": len(kept), "curated_solve_rate": mean([r["solve_rate"] for r in kept]),
            "by_preset": {p: sum(r["id"].startswith(p + "-") for r in kept) for p in POOL_PRESETS},
            "runs": runs, **aggregate(runs, scale.n_eval)}
    b = res["bands"]
    res["mixed_vs_high"] = diff_verdict(b["mixed"], b["high"], "mixed", "high")
    res["mixed_vs_low"] = diff_verdict(b["mixed"], b["low"], "mixed", "low")
    return res
