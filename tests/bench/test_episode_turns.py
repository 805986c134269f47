"""bench/rollout.py --episodes (bench/episode_turns.py): a tiny run prints both ways' rows, and the
two ways run the same serial passes and the same episodes while the continued rows compute fewer
entries (the figures bench/RESULTS.md records come from this code)."""

import re

from tests.bench.helpers import load_bench


def test_episodes_flag_compares_continued_and_resubmitted_turns(capsys):
    bench = load_bench("rollout")
    bench.main(["--episodes", "--hidden", "32", "--layers", "1", "--vocab", "256", "--rows", "4", "--group", "2",
                "--repeats", "1", "--prompt-len", "8", "--turn-tokens", "8", "--answer", "4", "--turns", "3",
                "--episode-tokens", "48", "--stop-ids", "32"])
    out = capsys.readouterr().out
    assert "the same episodes both ways: yes" in out
    rows = {m[0]: (float(m[1]), float(m[2])) for m in
            re.findall(r"^\| (continued|re-submitted) \| ([\d.]+) \| ([\d.]+) \|", out, flags=re.M)}
    assert set(rows) == {"continued", "re-submitted"}
    assert rows["continued"][0] == rows["re-submitted"][0]  # passes per token
    assert rows["continued"][1] < rows["re-submitted"][1]  # entries per token
