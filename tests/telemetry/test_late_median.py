"""`late_median`: the one helper the checks use for a metric's late-window median."""

import numpy as np

from rltt.telemetry import diagnoses as dx
from rltt.telemetry import schema
from rltt.telemetry.series import RunData


def test_late_median_is_the_median_of_the_late_window():
    values = [float(v) for v in range(1, 41)]  # steps 1..40, value = step
    run = RunData.from_records([{"step": s, schema.KL_REF: v} for s, v in zip(range(1, 41), values)])
    late = dx.late_median(run, schema.KL_REF)
    steps, window = dx.late_window(np.arange(1, 41), np.array(values))
    assert late.median == float(np.median(window)) and late.span == (int(steps[0]), 40)
    assert late.early == float(np.median(values[:max(dx.MIN_POINTS, 10)]))
    assert late.evidence(">", 1.0) == dx.Evidence(schema.KL_REF, late.span, "median", late.median, ">", 1.0)
    assert dx.late_median(run, schema.KL_REF, min_points=41) is None
    assert dx.late_median(run, schema.REWARD_MEAN) is None  # not logged
