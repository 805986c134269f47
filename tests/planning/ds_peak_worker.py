"""One bf16 DeepSpeed learner (CPU, one rank) at ZeRO ``argv[1]``: what its second update allocated
and had not freed at its peak, beside the plan's terms, as JSON into ``argv[3]`` (``argv[2]``: a work
directory). Run by tests/planning/test_deepspeed_peak.py."""

import json
import sys
from pathlib import Path

import torch
import yaml

from rltt.model import LoopConfig, LoopedForCausalLM
from rltt.orchestration.components import make_learner
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.planning import plan_run
from tests.planning.helpers import config_folder
from tests.planning.test_learner_peak import batch, created_peak

FIELDS = dict(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
              num_loops=4, norm_placement="ouro", max_position_embeddings=256)


def main(stage: int, work: Path, out: Path) -> None:
    folder = config_folder(work, {"model_type": "rltt_looped", **FIELDS})
    prompts, group, prompt_len, completion = 1, 8, 32, 32  # 2 micro-batches of 4 rows per update
    (work / "recipe.yaml").write_text(yaml.safe_dump({
        "model": {"path": str(folder), "dtype": "bf16", "device": "cpu"},
        "data": {"source": "synthetic:quickstart", "max_prompt_tokens": prompt_len},
        "rollout": {"prompts_per_step": prompts, "group_size": group, "max_new_tokens": completion},
        "algorithm": {"track_kl": False},
        "learner": {"backend": "deepspeed", "zero_stage": stage, "dtype": "bf16", "micro_batch_size": 4},
        "logging": {"run_dir": str(work / "run")},
    }))
    recipe = load_train_recipe(work / "recipe.yaml", [])
    plan = plan_run(recipe, {"model_type": "rltt_looped", **FIELDS}, 8 << 30, device="cpu")
    torch.manual_seed(0)
    model = LoopedForCausalLM(LoopConfig(**FIELDS)).to(torch.bfloat16)
    holder = {}
    init_peak = created_peak(lambda: holder.setdefault("learner", make_learner(recipe, model, run_dir=work / "run")))
    learner = holder["learner"]
    data = batch(FIELDS["vocab_size"], prompts, group, prompt_len, completion)
    learner.update(data)  # the first update creates AdamW's moments (resident in the plan)
    peak = created_peak(lambda: learner.update(data))
    config = json.loads((work / "run" / "deepspeed_config.json").read_text())
    out.write_text(json.dumps({"stage": stage, "parameters": plan.parameters, "components": plan.components,
                               "learner_phase": plan.phases["learner"], "update_peak": peak, "init_peak": init_peak,
                               "zero_optimization": config["zero_optimization"]}))


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
