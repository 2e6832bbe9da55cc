"""The lost-time arithmetic of the benchmark and the demo (``scripts/lost_time.py``), on
synthetic step times: what a save costs training is its call plus the extra time of every step
until the next save, against the median step with no checkpoint in flight."""


import pytest

from conftest import REPO  # noqa: F401 (puts scripts/ on sys.path)
import bench_checkpoint  # noqa: E402
import demo  # noqa: E402
from lost_time import baseline_step, lost_time, ratio, summary  # noqa: E402


def test_lost_time_is_the_call_plus_every_slower_step_until_the_next_save():
    base = 0.100
    # a 10 ms call, a 30 ms fence wait inside the first step, then two steps 5 ms slower
    assert lost_time(0.010, [0.130, 0.105, 0.105, 0.100], base) == pytest.approx(0.050)
    # a step faster than the baseline (noise) counts against the loss: it averages out
    assert lost_time(0.010, [0.095, 0.100], base) == pytest.approx(0.005)
    # a wait for the save once its steps are done is lost too
    assert lost_time(0.010, [0.100], base, tail_s=0.2) == pytest.approx(0.210)


def test_the_baseline_is_the_median_quiet_step_so_one_hiccup_does_not_move_it():
    assert baseline_step([0.1, 0.1, 0.1, 0.9, 0.1]) == 0.1
    with pytest.raises(ValueError):
        baseline_step([])


def test_summary_reports_median_worst_and_their_ratio_and_the_ratio_to_another_engine():
    s = summary([0.02, 0.03, 0.01, 0.08])
    assert s == {"saves": 4, "median_s": pytest.approx(0.025), "worst_s": 0.08,
                 "worst_over_median": pytest.approx(3.2)}
    assert ratio(summary([0.25]), s) == pytest.approx(10.0)
    assert ratio(summary([0.25]), summary([-0.001])) is None  # lost in the noise: no ratio
    assert summary([])["median_s"] is None


def _cadence(before, after, saves):
    quiet = {"user_s": 1.0, "sys_s": 0.1, "minflt": 100}
    return {"cadence": {"before": before, "after": after, "quiet_usage": [quiet, quiet],
                        "saves": [{"save_s": c, "wait_s": w, "steps_s": st,
                                   "usage": {"user_s": 1.5, "sys_s": 0.1, "minflt": 300}}
                                  for c, w, st in saves]}}


def test_benchmark_takes_each_save_from_its_slowest_rank_against_that_ranks_baseline():
    r0 = _cadence([0.1] * 3, [0.1] * 3, [(0.01, 0.0, [0.12, 0.1, 0.1]), (0.01, 0.0, [0.1, 0.1, 0.1])])
    r1 = _cadence([0.2] * 3, [0.2] * 3, [(0.01, 0.0, [0.2, 0.2, 0.2]), (0.02, 0.0, [0.25, 0.2, 0.2])])
    r1["cadence"]["saves"][-1]["tail_s"] = 0.03
    lost = bench_checkpoint.lost_figures([r0, r1])
    assert lost["per_save_s"] == pytest.approx([0.03, 0.10])
    assert lost["median_s"] == pytest.approx(0.065) and lost["worst_s"] == pytest.approx(0.10)
    assert lost["baseline_step_s"] == 0.2
    assert lost["extra_cpu_s"] == pytest.approx(1.0) and lost["extra_minflt"] == 400  # two ranks


def test_demo_counts_the_steps_up_to_the_next_save_against_the_steps_before_the_first():
    events = [{"event": "step", "rank": 0, "step": n, "step_s": s}
              for n, s in zip(range(1, 11), [0.9, 0.1, 0.1, 0.1, 0.12, 0.15, 0.1, 0.1, 0.1, 0.11])]
    events += [{"event": "step", "rank": 1, "step": 7, "step_s": 5.0}]  # rank 0's only
    events += [{"event": "checkpoint", "rank": 0, "step": 4, "save_s": 0.01},
               {"event": "checkpoint", "rank": 0, "step": 8, "save_s": 0.02}]
    # baseline: steps 2-4 (0.1); save at 4: steps 5-8; the save at 8 lacks step 11 and 12
    assert demo.lost_times(events, 4) == {4: pytest.approx(0.01 + 0.02 + 0.05)}
