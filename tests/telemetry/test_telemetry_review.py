import logging
import re

import pytest

from rltt.cli.main import main
from rltt.errors import RlttError
from rltt.telemetry.run_review import format_summary, maybe_review, review
from tests.telemetry.telemetry_synth import healthy_records, mutate, write_run


def collapsed_records():
    return mutate(healthy_records(seed=1), 20, exit__p_1=0.96, exit__p_2=0.02, exit__p_3=0.01,
                  exit__p_4=0.01, exit__mean_step=1.07)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    healthy = write_run(base / "healthy", healthy_records())
    # a run still writing: the last line is incomplete
    bad = write_run(base / "collapsed", collapsed_records(), tail='{"step": 61, "reward/me')
    return healthy, bad


@pytest.fixture(scope="module")
def compared(runs):
    healthy, bad = runs
    return review(bad, compare=healthy)


def test_review_writes_reports_and_plots(compared, runs):
    _, bad = runs
    report = compared
    assert report.out_dir == bad / "review"
    assert report.markdown_path.is_file() and report.html_path.is_file()
    expected = {"reward", "kl", "loss", "grad_norm", "grad_layers", "exit", "entropy", "compute",
                "mismatch", "lengths", "timings"}
    assert set(report.plots) == expected
    for path in report.plots.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = report.markdown_path.read_text()
    assert "exit_gate_collapse" in md and "](plots/exit.png)" in md
    assert "last line incomplete" in md


def test_html_is_self_contained(compared):
    page = compared.html_path.read_text()
    refs = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']*)', page, flags=re.I)
    assert refs, "plots should be embedded"
    assert all(ref.startswith("data:image/png;base64,") for ref in refs)
    assert len(refs) == len(compared.plots)
    assert "<link" not in page and "<script" not in page and "url(" not in page
    assert "Exit gate collapsed onto loop 1" in page


def test_compare_overlays_and_summarises_the_other_run(compared, runs):
    healthy, _ = runs
    assert compared.compare is not None and compared.compare.path == healthy
    assert compared.compare_diagnoses == []
    assert [d.id for d in compared.diagnoses] == ["exit_gate_collapse"]
    md = compared.markdown_path.read_text()
    assert "compared with" in md and "last [healthy]" in md
    summary = format_summary(compared)
    assert "compare:" in summary and "exit_gate_collapse" in summary


def test_healthy_review_without_plots_and_custom_out(runs, tmp_path):
    healthy, _ = runs
    report = review(healthy, out_dir=tmp_path / "out", plots=False)
    assert report.healthy and report.worst is None
    assert report.plots == {}
    assert (tmp_path / "out" / "report.html").is_file()
    assert "healthy: no diagnosis fired" in format_summary(report)


def test_review_errors_name_the_path(tmp_path):
    with pytest.raises(RlttError, match=re.escape(str(tmp_path / "missing"))):
        review(tmp_path / "missing")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(RlttError, match="metrics.jsonl"):
        review(tmp_path / "empty_dir")
    (tmp_path / "empty_dir" / "metrics.jsonl").write_text("")
    with pytest.raises(RlttError, match="no metric records"):
        review(tmp_path / "empty_dir")


def test_maybe_review_schedule_and_never_raises(runs, tmp_path, caplog):
    healthy, bad = runs
    assert maybe_review(healthy, step=7, every=5, plots=False) is None
    assert maybe_review(healthy, step=10, every=0, plots=False) is None
    assert maybe_review(healthy, step=10, every=5, out_dir=tmp_path / "a", plots=False).healthy
    assert maybe_review(healthy, step=7, every=0, final=True, out_dir=tmp_path / "b",
                        plots=False) is not None
    with caplog.at_level(logging.WARNING):
        assert maybe_review(tmp_path / "nope", step=5, every=5) is None
        report = maybe_review(bad, step=60, every=5, out_dir=tmp_path / "c", plots=False)
    assert report is not None
    assert "failed" in caplog.text and "Exit gate collapsed" in caplog.text


def test_cli_missing_run_dir_is_a_one_line_error(tmp_path, capsys):
    assert main(["review", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("rltt review: error:") and str(tmp_path / "nope") in err
    (tmp_path / "run").mkdir()
    assert main(["review", str(tmp_path / "run")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_cli_review_compare_and_fail_on(runs, tmp_path, capsys):
    healthy, bad = runs
    out = tmp_path / "cli"
    assert main(["review", str(bad), "--compare", str(healthy), "--out", str(out),
                 "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "exit_gate_collapse" in printed and str(out / "report.html") in printed
    assert (out / "report.md").is_file()
    assert main(["review", str(bad), "--out", str(out), "--no-plots",
                 "--fail-on", "critical"]) == 1
    assert main(["review", str(healthy), "--out", str(out), "--no-plots",
                 "--fail-on", "warning"]) == 0
    capsys.readouterr()
    assert main(["review", str(bad), "--compare", str(tmp_path / "other")]) == 2
    assert str(tmp_path / "other") in capsys.readouterr().err
