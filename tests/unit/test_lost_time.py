"""The lost-time arithmetic of the benchmark and the demo (``deepspeed_async_ckpt.bench.lost_time``
and ``.figures``), on synthetic step times: what a save costs training is its call plus the extra
time of every step until the next save, against the median step with no checkpoint in flight."""


import statistics

import pytest

from deepspeed_async_ckpt.bench.figures import lost_figures
from deepspeed_async_ckpt.bench.lost_time import baseline_step, lost_time, lost_times, ratio, summary


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
    lost = lost_figures([r0, r1])
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
    assert lost_times(events, 4) == {4: pytest.approx(0.01 + 0.02 + 0.05)}


# --------------------------------------------------------------------------- the A/B figure
import random  # noqa: E402

from deepspeed_async_ckpt.bench.lost_time import ab_summary, abba, difference, event_loss, split_aa, t975  # noqa: E402


def _run(events: int, loss_s: float, *, drift_per_step: float = 0.0, noise: float = 0.0,
         interval: int = 50, window: int = 40, base: int = 10, seed: int = 0):
    """A synthetic run: 20 ms steps drifting by ``drift_per_step`` a step, Gaussian ``noise``,
    and each real save spreading ``loss_s`` over the 10 steps after it (none for a sham)."""
    rng = random.Random(seed)
    labels = abba(events)
    steps, at = [], []
    for i in range(base + events * interval):
        steps.append(0.020 + drift_per_step * i + rng.gauss(0, noise))
    for e, kind in enumerate(labels):
        start = base + e * interval
        at.append(start)
        if kind == "R":
            for j in range(10):
                steps[start + j] += loss_s / 10
    losses = [event_loss(steps[s - base:s], steps[s:s + window])[0] for s in at]
    return labels, losses


def test_abba_orders_real_and_sham_saves_so_a_linear_drift_adds_alike_to_both():
    assert "".join(abba(8)) == "RSSRRSSR"
    # a drift of 1 ms an event: in every four, the Rs and the Ss sum to the same
    pos_r = [i for i, k in enumerate(abba(8)) if k == "R"]
    pos_s = [i for i, k in enumerate(abba(8)) if k == "S"]
    assert sum(pos_r) == sum(pos_s)
    with pytest.raises(ValueError):
        abba(0)


def test_an_event_is_its_call_and_the_extra_time_of_the_window_against_the_steps_just_before():
    loss, b = event_loss([0.02, 0.02, 0.9, 0.02], [0.025, 0.02, 0.021], call_s=0.004, tail_s=0.001)
    assert b == 0.02  # the median: the hiccup before it does not move it
    assert loss == pytest.approx(0.004 + 0.005 + 0.001 + 0.001)


def test_t_quantile_matches_the_table():
    for df, exact in ((3, 3.182), (5, 2.571), (10, 2.228), (30, 2.042), (1e9, 1.960)):
        assert t975(df) == pytest.approx(exact, rel=2e-3)


def test_difference_gives_welch_interval_and_nothing_for_too_few_values():
    d = difference([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert d["diff_s"] == pytest.approx(2.0)
    # all spread is a's: se = 1/sqrt(3), df = 2
    assert d["half_width_s"] == pytest.approx(4.303 / 3 ** 0.5, rel=1e-2)
    assert difference([1.0], [2.0, 3.0])["diff_s"] is None


def test_a_known_loss_is_recovered_within_its_interval_and_the_aa_floor_straddles_zero():
    labels, losses = _run(40, 0.050, noise=0.002, interval=80, base=40)
    fig = ab_summary(labels, losses, interval_s=1.0)
    d = fig["real_minus_sham"]
    assert fig["events"] == 40 and d["n_a"] == d["n_b"] == 20
    assert d["lo_s"] <= 0.050 <= d["hi_s"]
    # 2 ms of noise a step: about 13 ms of each event's 40 steps, 16 ms of 40 x its baseline
    # (the baseline's error counts once per step of the window); over 20 events a group
    assert d["half_width_s"] < 0.020
    aa = fig["sham_a_minus_sham_b"]
    assert aa["lo_s"] <= 0 <= aa["hi_s"] and aa["n_a"] == aa["n_b"] == 10
    assert fig["fraction_of_interval"] == pytest.approx(d["diff_s"])


def test_a_drift_larger_than_the_loss_cancels():
    # 20 us a step: each 40-step window runs 32 ms behind the 40 steps before it, 3x the
    # injected 10 ms, on a real save and a sham alike
    labels, losses = _run(40, 0.010, drift_per_step=20e-6, noise=0.0003, interval=80, base=40)
    d = ab_summary(labels, losses)["real_minus_sham"]
    assert d["lo_s"] <= 0.010 <= d["hi_s"] and d["half_width_s"] < 0.004
    # the shams alone show the drift (each 40-step window against the 10 steps before it) ...
    assert statistics.fmean(v for k, v in zip(labels, losses) if k == "S") > 0.025
    # ... and no loss shows when there is none
    labels, losses = _run(40, 0.0, drift_per_step=20e-6, noise=0.0003, interval=80, base=40, seed=1)
    d = ab_summary(labels, losses)["real_minus_sham"]
    assert d["lo_s"] <= 0.0 <= d["hi_s"]


def test_shams_split_in_abba_order_into_two_halves():
    assert split_aa([1, 2, 3, 4, 5, 6, 7, 8]) == ([1, 4, 5, 8], [2, 3, 6, 7])
    with pytest.raises(ValueError):
        ab_summary(["R"], [0.1, 0.2])
