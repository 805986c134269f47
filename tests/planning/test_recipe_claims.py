"""The GPU recipes' comments state their memory plans as commands a user can paste, and every such
figure is the plan's own: a claim reads

    `rltt plan recipes/NAME.yaml --gpu-memory G [key=value ...]`: R rows per chunk × C chunks,
    rollout phase X GiB, learner phase Y GiB, activations Z GiB, fits | does not fit

(any subset of the figures, over one or more comment lines). A plan figure in a comment (a GiB
figure with decimals, rows per chunk, chunks) outside such a claim fails the test, so a comment
cannot drift from the plan again."""

import re
from pathlib import Path

import pytest

from rltt.orchestration.train_recipe import load_train_recipe
from rltt.planning import plan_run
from rltt.planning.footprint import GIB
from tests.planning.helpers import OURO_1_4B

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
GPU_RECIPES = ("gsm8k.yaml", "gsm8k-thinking.yaml", "rltt-math.yaml", "gsm8k-tools.yaml")

CLAIM = re.compile(r"`rltt plan recipes/(?P<name>[\w.-]+\.yaml) --gpu-memory (?P<gib>[\d.]+)(?P<overrides>(?: [\w.]+=\S+?)*)`"
                   r"(?P<figures>.*?)(?=`rltt plan |$)")
FIGURES = {
    "chunk": re.compile(r"(\d+) rows per chunk × (\d+) chunks"),
    "rollout": re.compile(r"rollout phase ([\d.]+) GiB"),
    "learner": re.compile(r"learner phase ([\d.]+) GiB"),
    "activations": re.compile(r"activations ([\d.]+) GiB"),
    "verdict": re.compile(r"\b(does not fit|fits)\b"),
}
FIGURE_WORDS = re.compile(r"\d+\.\d+ GiB|\d+ rows per chunk|\d+ chunks")  # a device size ("79 GiB") is not one


def comment_blocks(text: str) -> list[str]:
    """The recipe's comments, one string per run of comment lines (trailing comments alone)."""
    blocks, current = [], []
    for line in text.splitlines():
        body = line.strip()
        if body.startswith("#"):
            current.append(body.lstrip("#").strip())
            continue
        if current:
            blocks.append(" ".join(current))
            current = []
        if "#" in line and not body.startswith(("-", '"')) and "\"" not in line:
            blocks.append(line.split("#", 1)[1].strip())
    if current:
        blocks.append(" ".join(current))
    return blocks


def plan_figures(plan) -> dict[str, tuple[str, ...]]:
    """What a plan says, in the claims' words (`FIGURES`' keys): rows per chunk and chunks, phase and
    activation GiB to one decimal, the verdict."""
    return {
        "chunk": (str(plan.rollout_rows_per_chunk), str(plan.chunks_per_step)),
        "rollout": (f"{plan.phases['rollout'] / GIB:.1f}",),
        "learner": (f"{plan.phases['learner'] / GIB:.1f}",),
        "activations": (f"{plan.components['activations'] / GIB:.1f}",),
        "verdict": ("fits" if plan.fits else "does not fit",),
    }


def claims(name: str) -> list[re.Match]:
    return [m for block in comment_blocks((RECIPES / name).read_text()) for m in CLAIM.finditer(block)]


def test_the_claim_reader_reads_what_it_should():
    block = comment_blocks("# a\n# `rltt plan recipes/x.yaml --gpu-memory 79 a.b=8`: 56 rows per chunk × 10 chunks,\n"
                           "# learner phase 58.8 GiB; fits\nkey: 1  # trailing 3.5 GiB\n")
    (claim,) = [m for b in block for m in CLAIM.finditer(b)]
    assert (claim["name"], claim["gib"], claim["overrides"].split()) == ("x.yaml", "79", ["a.b=8"])
    assert FIGURES["chunk"].search(claim["figures"]).groups() == ("56", "10")
    assert FIGURES["learner"].search(claim["figures"]).group(1) == "58.8"
    assert block[-1] == "trailing 3.5 GiB" and FIGURE_WORDS.findall(block[-1]) == ["3.5 GiB"]


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_every_plan_figure_in_a_gpu_recipe_is_a_claim_the_plan_makes_true(name):
    found = claims(name)
    assert found, f"{name} states no `rltt plan` claim"
    text = " ".join(comment_blocks((RECIPES / name).read_text()))
    in_claims = sum(len(FIGURE_WORDS.findall(m["figures"])) for m in found)
    assert len(FIGURE_WORDS.findall(text)) == in_claims, f"{name}: a GiB / rows-per-chunk figure outside a claim"
    for m in found:
        assert m["name"] == name, m.group(0)
        recipe = load_train_recipe(RECIPES / name, ["model.path=quickstart", *m["overrides"].split()])
        plan = plan_run(recipe, OURO_1_4B, int(float(m["gib"]) * GIB), device="cuda")
        actual = plan_figures(plan)
        stated = {key: rx.search(m["figures"]).groups() for key, rx in FIGURES.items() if rx.search(m["figures"])}
        assert stated, f"{name}: a claim without figures: {m.group(0)}"
        assert stated == {key: actual[key] for key in stated}, (name, m.group(0), actual)
