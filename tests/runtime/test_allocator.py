"""`rltt.runtime.allocator`: rltt's CUDA processes get expandable segments unless the user chose."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltt.runtime.allocator import DEFAULT, ENV, configure, expandable

ROOT = Path(__file__).resolve().parents[2]
# a fresh process: run the CLI (no sub-command: help), then report the variable and whether torch
# was imported before the CLI set it (torch reads it when CUDA initialises, never before import)
PROBE = """
import os, sys
from rltt.cli.main import main
assert "torch" not in sys.modules
main([])
print("SETTING=" + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "<unset>"))
"""


def run_probe(extra_env: dict[str, str | None]) -> str:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update({k: v for k, v in extra_env.items() if v is not None})
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.rsplit("SETTING=", 1)[1].strip()


def test_the_cli_sets_expandable_segments_in_a_fresh_process_where_unset():
    assert run_probe({}) == DEFAULT


@pytest.mark.parametrize("user", ["expandable_segments:False", "garbage_collection_threshold:0.6,max_split_size_mb:512"])
def test_a_users_own_setting_is_kept(user):
    assert run_probe({ENV: user}) == user


def test_configure_fills_only_an_unset_or_empty_variable():
    env = {}
    assert configure(env) == DEFAULT and env[ENV] == DEFAULT
    env = {ENV: "  "}
    assert configure(env) == DEFAULT
    env = {ENV: "expandable_segments:False"}
    assert configure(env) == "expandable_segments:False"


def test_expandable_reads_the_last_option():
    assert expandable(DEFAULT)
    assert not expandable(None) and not expandable("") and not expandable("expandable_segments:False")
    assert expandable("max_split_size_mb:512, expandable_segments:True")
    assert not expandable("expandable_segments:True,expandable_segments:False")


def test_ray_actors_inherit_the_setting(monkeypatch):
    pytest.importorskip("ray")
    from rltt.orchestration.ray.cluster import actor_env

    monkeypatch.setenv(ENV, "expandable_segments:False")
    assert actor_env()[ENV] == "expandable_segments:False"
