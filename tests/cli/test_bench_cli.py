"""`rltt bench` finds the scripts in bench/ and reports an unknown name in one line."""

from rltt.cli import bench
from rltt.cli.main import main


def test_bench_lists_the_scripts_and_rejects_unknown_names(capsys):
    assert {"logprobs", "rollout", "stability", "trl_compare"} <= set(bench.available())
    assert main(["bench", "no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "no_such_bench" in err and "rollout" in err and len(err.strip().splitlines()) == 1


def test_bench_runs_a_script_with_its_arguments(capsys):
    assert main(["bench", "logprobs", "--help"]) == 0
