"""bench/rollout.py's RESULTS.md writer: `--write` replaces only this script's text and keeps the subsections."""

import re

import torch

from tests.bench.helpers import ROOT, load_bench


def _load():
    return load_bench("rollout")


def _results(bench, lead: str) -> str:
    return (f"# Benchmark results\n\n## Other (bench/other.py)\n\nkeep other\n\n{bench.SECTION}\n\n{lead}\n\n"
            f"### Earlier run\n\nkeep earlier\n\n{bench.VLLM_SECTION}\n\nkeep vllm\n\n## Next (bench/next.py)\n\nkeep next\n")


def test_write_replaces_the_lead_and_keeps_the_subsections(tmp_path):
    bench = _load()
    path = tmp_path / "RESULTS.md"
    path.write_text(_results(bench, "old table\n\n" + bench.NOTES))
    bench.write_section(path, "new table", notes=bench.NOTES)
    text = path.read_text()
    assert "old table" not in text and "new table" in text
    for kept in ("keep other", "### Earlier run", "keep earlier", bench.VLLM_SECTION, "keep vllm", "keep next"):
        assert text.count(kept) == 1, kept
    assert text.count(bench.NOTES.strip()) == 1
    assert text.index("new table") < text.index("Reading the figures") < text.index("### Earlier run")


def test_append_goes_before_the_notes(tmp_path):
    bench = _load()
    path = tmp_path / "RESULTS.md"
    path.write_text(_results(bench, "first table"))
    bench.write_section(path, "first table", notes=bench.NOTES)
    bench.write_section(path, "second table", append=True, notes=bench.NOTES)
    text = path.read_text()
    assert text.count(bench.NOTES.strip()) == 1
    assert text.index("first table") < text.index("second table") < text.index("Reading the figures") \
        < text.index("### Earlier run")


def test_vllm_writes_its_subsection(tmp_path):
    bench = _load()
    path = tmp_path / "RESULTS.md"
    path.write_text(_results(bench, "native table"))
    bench.write_section(path, "vllm table", heading=bench.VLLM_SECTION)
    text = path.read_text()
    assert "native table" in text and "keep earlier" in text and "keep vllm" not in text
    assert text.index(bench.VLLM_SECTION) < text.index("vllm table") < text.index("## Next")
    # a subsection that is not there yet goes at the end of the rollout section
    path.write_text(f"# Benchmark results\n\n{bench.SECTION}\n\nnative table\n\n## Next (bench/next.py)\n\nkeep next\n")
    bench.write_section(path, "vllm table", heading=bench.VLLM_SECTION)
    text = path.read_text()
    assert text.index("native table") < text.index(bench.VLLM_SECTION) < text.index("vllm table") \
        < text.index("## Next")


def test_write_on_the_real_results_keeps_every_other_part(tmp_path):
    bench = _load()
    real = (ROOT / "bench" / "RESULTS.md").read_text()
    path = tmp_path / "RESULTS.md"
    path.write_text(real)
    bench.write_section(path, "Command: `python bench/rollout.py`\n\nnew table", notes=bench.NOTES)
    text = path.read_text()
    start = real.index(bench.SECTION)
    lead_end = re.compile(r"^##+ ", re.M).search(real, start + len(bench.SECTION)).start()
    assert text == real[:start] + bench.SECTION + "\n\nCommand: `python bench/rollout.py`\n\nnew table\n\n" \
        + bench.NOTES.strip() + "\n\n" + real[lead_end:]
    assert bench.VLLM_SECTION in text


def test_buckets_mode_compares_the_bucketed_passes_bit_for_bit(tmp_path, monkeypatch, capsys):
    """``--buckets`` at the smallest shapes: both engines in one process, every output checked equal, the
    table written to its own subsection."""
    bench = _load()
    results = tmp_path / "RESULTS.md"
    results.write_text(_results(bench, "native table"))
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "rollout.py"))
    bench.main(["--buckets", "--host-work", "--batch-sizes", "1,5", "--new-tokens", "3", "--prompt-len", "4",
                "--hidden", "32", "--layers", "1", "--vocab", "64", "--repeats", "1", "--write"])
    out = capsys.readouterr().out
    assert out.count("bitwise equal: True") == 4 and "bitwise equal: False" not in out
    rows = re.findall(r"^\| (\d+) \(\d+ × 1\) \| (dense|deferred) \|.*\| (yes|no) \|$", out, re.M)
    # the throughput table, then the host-work table (the emulated capture's outputs checked too)
    assert [(b, s, same) for b, s, same in rows] == 2 * [("1", "dense", "yes"), ("1", "deferred", "yes"),
                                                         ("5", "dense", "yes"), ("5", "deferred", "yes")]
    text = results.read_text()
    assert bench.BUCKET_SECTION in text and "native table" in text and "keep vllm" in text


def test_kernel_seconds_splits_gemms_from_attention():
    """The GEMM floor counts GEMM operators and attention kernels apart, and nothing else."""
    bench = _load()
    a, q = torch.randn(64, 64), torch.randn(2, 2, 8, 16)
    gemm, attention = bench.kernel_seconds(lambda: [a @ a for _ in range(4)])
    assert gemm > 0 and attention == 0
    gemm, attention = bench.kernel_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert attention > 0
    assert bench.kernel_seconds(lambda: [a + a for _ in range(4)]) == (0, 0)
    floor = bench.gemm_floor(lambda: a @ a, lambda: [a @ a for _ in range(8)], 0.5, 2.0)["floor"]
    assert floor["gemm_bound"] == 2.0 / floor["dense_gemm"]
    assert floor["kernel_bound"] == 2.0 / (floor["dense_gemm"] + floor["dense_attn"]) and floor["dense_attn"] == 0


def test_gemm_floor_mode_writes_its_bound(tmp_path, monkeypatch, capsys):
    """``--gemm-floor`` at the smallest shapes: the bound is generate()'s time over dense's GEMM time, written
    to its own subsection."""
    bench = _load()
    results = tmp_path / "RESULTS.md"
    results.write_text(_results(bench, "native table"))
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "rollout.py"))
    bench.main(["--gemm-floor", "--batch-sizes", "2", "--new-tokens", "3", "--prompt-len", "4", "--hidden", "32",
                "--layers", "1", "--vocab", "64", "--repeats", "1", "--temperature", "1.0", "--write"])
    out = capsys.readouterr().out
    row = re.search(r"^\| 2 \| ([\d.]+) \| ([\d.]+) \| [\d.]+× \| ([\d.]+) \(\d+%\) \| [\d.]+ \(\d+%\) \| [\d.]+ "
                    r"\| \*\*([\d.]+)×\*\* \| ([\d.]+)× \|$", out, re.M)
    assert row, out
    text = results.read_text()
    assert bench.FLOOR_SECTION in text and "native table" in text and "keep vllm" in text
    assert "*GEMM bound*" in text


def test_passes_mode_counts_the_slowest_row(tmp_path, monkeypatch, capsys):
    """``--passes``: a deferred batch's serial passes are its slowest row's Σ t* (nothing else at one row per
    prompt); a row's own passes per token are its E[t*]; written to its own subsection."""
    bench = _load()
    results = tmp_path / "RESULTS.md"
    results.write_text(_results(bench, "native table"))
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "rollout.py"))
    bench.main(["--passes", "--batch-sizes", "1,8", "--passes-tokens", "6", "--prompt-len", "4", "--hidden", "32",
                "--layers", "1", "--vocab", "64", "--write"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| 6 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| \*\*([\d.]+)×\*\* \|$",
                      out, re.M)
    assert [r[0] for r in rows] == ["1", "8"], out
    for batch, mean_exit, row_ppt, slowest, other, serial, over in rows:
        assert row_ppt == mean_exit and slowest == serial and float(other) == 0
        assert float(serial) >= float(mean_exit)
    assert float(rows[0][5]) == float(rows[0][1])  # one row: the batch is its row
    text = results.read_text()
    assert bench.PASSES_SECTION in text and "native table" in text and "keep vllm" in text


def test_roofline_columns_for_a_named_device(capsys):
    """``--roofline NAME``: each dense and deferred tok/s with its bound on that device and the fraction reached
    (here on CPU, so the fractions are tiny: the arithmetic, not a GPU's figure)."""
    bench = _load()
    rows, md = bench.run(bench.main.__globals__["argparse"].Namespace(
        batch_sizes=[2], new_tokens=3, prompt_len=4, hidden=32, layers=1, loops=4, vocab=64, mean_exit=2.5, group=1,
        repeats=1, temperature=0.0, threads=1, clock="cpu", gemm_floor=False, host_work=False, device="cpu",
        roofline="H100 SXM"))
    row = rows[0]
    assert "Roofline: H100 SXM" in md and 0 < row["dense_fraction"] < 1 and 0 < row["deferred_fraction"] < 1
    assert row["dense_bound"] > 0 and row["deferred_serial"] <= row["dense_serial"] <= 4
