"""bench/env_overhead.py: the smoke mode checks each tool against the in-process result and prints
every row of its table and the overhead lines (the environments' turns in-process and isolated too)."""

from tests.bench.helpers import load_bench


def test_env_overhead_prints_every_row(capsys):
    bench = load_bench("env_overhead")
    bench.main(["--calls", "2"])
    out = capsys.readouterr().out
    for row in ("python tool (sandboxed)", "python in-process (exec)", "bare interpreter start",
                "calculator tool", "calculator in-process (eval)", "annotations turn in-process",
                "annotations turn isolated", "tools turn in-process", "tools turn isolated"):
        assert f"| {row}" in out
    assert "python tool: isolation overhead" in out and "calculator: overhead" in out
    assert "annotations environment: isolation overhead" in out and "tools environment: isolation overhead" in out
