import numpy as np
import pytest
from tests.telemetry.telemetry_synth import quickstart_records

from rltt.telemetry import plots
from rltt.telemetry.series import RunData


def test_smooth_is_a_centred_rolling_mean_truncated_at_the_ends():
    values = np.array([1.0, 2.0, 6.0, 3.0, 8.0, 4.0])
    out = plots.smooth(values, window=3)
    expected = [np.mean(values[max(0, i - 1):i + 2]) for i in range(len(values))]
    np.testing.assert_allclose(out, expected)
    np.testing.assert_allclose(plots.smooth(values, window=1), values)
    geometric = plots.smooth(np.array([1.0, 100.0, 1.0]), window=3, log=True)
    np.testing.assert_allclose(geometric, [10.0, 100 ** (1 / 3), 10.0])
    assert plots.smoothing_window(250) == 13 and plots.smoothing_window(20) == 3
    # a centred mean does not lag a trend
    ramp = np.arange(50.0)
    np.testing.assert_allclose(plots.smooth(ramp, window=5)[2:-2], ramp[2:-2])


def _lines_by_gid(ax):
    return {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}


@pytest.mark.parametrize("logy", [False, True])
def test_line_plots_draw_the_smoothed_curve_over_the_faint_raw_one(logy):
    run = RunData.from_records(quickstart_records(seed=1))
    fig, axes = plots._figure(1, 1)
    key = "grad_norm/total"
    assert plots._lines(axes[0], [run], [key], logy=logy)
    lines = _lines_by_gid(axes[0])
    raw, smoothed = lines[f"raw:{key}"], lines[f"smooth:{key}"]
    steps, values = run.series(key)
    np.testing.assert_array_equal(raw.get_xdata(), steps)
    np.testing.assert_array_equal(raw.get_ydata(), values)
    np.testing.assert_allclose(smoothed.get_ydata(), plots.smooth(values, log=logy))
    assert not np.allclose(smoothed.get_ydata(), values)  # it really is smoothed
    assert raw.get_alpha() == plots.RAW_ALPHA and smoothed.get_alpha() in (None, 1.0)
    assert smoothed.get_label() == key and raw.get_label().startswith("_")  # legend: the curve
    # drawn on top of the raw line
    order = axes[0].get_lines()
    assert order.index(smoothed) > order.index(raw)


def test_short_series_are_drawn_raw_with_markers():
    run = RunData.from_records(quickstart_records(seed=1))
    fig, axes = plots._figure(1, 1)
    assert plots._lines(axes[0], [run], ["eval/solve_rate"])  # step 0 and every 50 steps
    lines = _lines_by_gid(axes[0])
    assert set(lines) == {"raw:eval/solve_rate"}
    assert lines["raw:eval/solve_rate"].get_marker() == "."
    assert lines["raw:eval/solve_rate"].get_label() == "eval/solve_rate"


def test_reward_figure_shows_the_held_out_solve_rate():
    run = RunData.from_records(quickstart_records(seed=2))
    fig = plots.plot_reward([run])
    gids = {line.get_gid() for ax in fig.axes for line in ax.get_lines()}
    assert {"smooth:reward/mean", "smooth:solve_rate", "raw:eval/solve_rate"} <= gids
