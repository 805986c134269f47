"""The memory plan of a LoRA run (``learner.lora``): the adapters' parameter count by hand, no
reference copy, optimizer / master / gradient state of the adapters only; the LoRA recipes' stated
`rltt plan` figures are the plan's own, at Ouro-1.4B's and Ouro-2.6B's shapes."""

from pathlib import Path

import pytest

from rltt.orchestration.train_recipe import load_train_recipe
from rltt.planning import plan_run
from rltt.planning.footprint import GIB
from tests.planning.helpers import OURO_1_4B, OURO_2_6B, TINY_LOOPED
from tests.planning.test_recipe_claims import FIGURE_WORDS, FIGURES, claims, comment_blocks, plan_figures

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
#: LoRA recipe -> the model shape its claims are about
LORA_RECIPES = {"gsm8k-lora.yaml": OURO_1_4B, "gsm8k-lora-2.6b.yaml": OURO_2_6B}


def _recipe(name, *overrides):
    return load_train_recipe(RECIPES / name, ["model.path=quickstart", *overrides])


def test_adapter_count_by_hand():
    d, f, layers, r = 2048, 5632, 24, 16
    per_layer = r * ((d + d) * 4 + (d + f) * 2 + (f + d))  # q, k, v, o (Hkv·D = d) and gate, up, down
    plan = plan_run(_recipe("gsm8k-lora.yaml"), OURO_1_4B, 24 * GIB, device="cuda")
    assert plan.trained_parameters == layers * per_layer == 15_138_816
    assert plan.parameters == 1_434_652_673 + plan.trained_parameters
    per_loop = plan_run(_recipe("gsm8k-lora.yaml", "learner.lora.per_loop=true"), OURO_1_4B, 24 * GIB, device="cuda")
    assert per_loop.trained_parameters == 4 * plan.trained_parameters  # T = 4 adapters per target


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_lora_counts_the_adapters_state_only(backend):
    over = [f"learner.backend={backend}", "learner.zero_stage=2"]
    lora = plan_run(_recipe("gsm8k-lora.yaml", *over), OURO_1_4B, 80 * GIB, device="cuda")
    full = plan_run(_recipe("gsm8k-lora.yaml", *over, "learner.lora=null"), OURO_1_4B, 80 * GIB, device="cuda")
    A, c = lora.trained_parameters, lora.components
    assert lora.components["reference"] == 0 < full.components["reference"]
    assert c["weights"] == 2 * lora.parameters
    assert c["optimizer"] == 8 * A and c["master_weights"] == 4 * A
    assert c["gradients"] < full.components["gradients"] / 50
    assert any("LoRA" in note and "no reference copy" in note for note in lora.notes)
    assert lora.phases["learner"] < 0.5 * full.phases["learner"]


def test_rltt_plan_says_it_is_a_lora_run(capsys):
    from rltt.cli.main import main

    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY_LOOPED))
        code = main(["plan", str(RECIPES / "quickstart-lora.yaml"), f"model.path={tmp}", "--gpu-memory", "8"])
    out = capsys.readouterr().out
    assert code == 0 and "LoRA (learner.lora)" in out and "no reference copy" in out and "trained" in out


@pytest.mark.parametrize("name", sorted(LORA_RECIPES))
def test_the_lora_recipes_plan_claims_hold(name):
    found = claims(name)
    assert found, f"{name} states no `rltt plan` claim"
    text = " ".join(comment_blocks((RECIPES / name).read_text()))
    assert len(FIGURE_WORDS.findall(text)) == sum(len(FIGURE_WORDS.findall(m["figures"])) for m in found)
    verdicts = []
    for m in found:
        assert m["name"] == name, m.group(0)
        plan = plan_run(_recipe(name, *m["overrides"].split()), LORA_RECIPES[name], int(float(m["gib"]) * GIB),
                        device="cuda")
        actual = plan_figures(plan)
        stated = {key: rx.search(m["figures"]).groups() for key, rx in FIGURES.items() if rx.search(m["figures"])}
        assert stated == {key: actual[key] for key in stated}, (name, m.group(0), actual)
        verdicts.append((m["overrides"].strip(), plan.fits))
    assert ("", True) in verdicts  # the recipe as shipped fits its card


def test_vllm_holds_the_served_adapter_and_its_slots_or_the_merged_base():
    """On the CPU vLLM's share is its KV space and what it holds: the base, plus (adapters served)
    the loaded adapter and the adapter slot of its LoRA layers — every projection of every layer at
    the padded rank (16 holds rank 16) — or the base alone (merged)."""
    d, f, layers, r = 2048, 5632, 24, 16
    over = ("rollout.engine=vllm", "rollout.schedule=dense")
    served = plan_run(_recipe("gsm8k-lora.yaml", *over), OURO_1_4B, 80 * GIB, device="cpu")
    merged = plan_run(_recipe("gsm8k-lora.yaml", *over, "rollout.vllm.lora=merged"), OURO_1_4B, 80 * GIB, device="cpu")
    full = plan_run(_recipe("gsm8k-lora.yaml", *over, "learner.lora=null"), OURO_1_4B, 80 * GIB, device="cpu")
    slots = layers * r * ((d + d) * 4 + (d + f) * 3)  # all seven projections, targeted or not
    elem = 2  # bf16
    assert merged.components["vllm"] == full.components["vllm"]
    assert served.components["vllm"] - merged.components["vllm"] == elem * (served.trained_parameters + slots)
    with pytest.raises(Exception, match="learner.lora.rank"):  # vLLM has no slots above rank 512
        _recipe("gsm8k-lora.yaml", *over, "learner.lora.rank=1024")
