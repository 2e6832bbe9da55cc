"""Training time lost per checkpoint: the one figure a user feels.

A save costs training more than its call: the wait at the next optimizer step (the fence),
and every step after it that runs slower while the save's copies, checksums and writes share
the machine with training. Per save, from the step times of one run::

    lost = save call + sum over the steps until the next save of (step - baseline step)

The fence wait is inside the step that waits, so it is counted once, through that step. The
baseline step is the median step of the same run while no checkpoint is in flight (windows
before the first save and after the last one completed): the same process, model and heap, so
what differs is the checkpoint alone. A save whose background work outlasts its interval
makes the next save wait or overlap it; ``tail_s`` counts such a wait, where measured.
Seconds throughout.

That baseline drifts, between processes and over minutes, by more than a checkpoint costs a
well-behaved engine (docs/benchmarks.md has the figures). The A/B figure
(:func:`ab_summary`, used by ``bench_standin.py`` and ``gpu_check.py``) resolves far less:

- events every I steps, in ABBA order (:func:`abba`): R S S R R S S R ..., "R" a real save and
  "S" a sham: the same trigger and call site and the same bookkeeping (timers, the wait for
  the previous event's work), with the save itself left out, so nothing is copied or written;
- each event's loss (:func:`event_loss`): its call + sum over a fixed window of W steps after
  it of (step - b) + any wait for it before the next event, b the median of the B steps just
  before it; slow drift moves b with the steps, so it cancels event by event;
- the cost of a checkpoint: mean(R) - mean(S), with a 95% interval (Welch's t, :func:`difference`),
  over >= 20 events; the noise floor: the same figure for two halves of the shams taken in
  ABBA order (A/A), which should straddle zero with about that interval's width.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Sequence


def baseline_step(steps: Iterable[float]) -> float:
    """The median of ``steps`` (seconds): robust to the odd slow step of a noisy machine."""
    steps = list(steps)
    if not steps:
        raise ValueError("no step without a checkpoint in flight: no baseline")
    return statistics.median(steps)


def lost_time(save_s: float, steps_after: Sequence[float], base_step_s: float, tail_s: float = 0.0) -> float:
    """Seconds of training one save cost: its call, the extra time of each step after it until
    the next save (negative where a step ran faster than the baseline: noise, kept so that
    it averages out), and any wait for it at the next save (``tail_s``)."""
    return save_s + sum(s - base_step_s for s in steps_after) + tail_s


def summary(lost: Sequence[float]) -> dict:
    """Median and worst of per-save lost times, and how many times the median the worst is."""
    if not lost:
        return {"saves": 0, "median_s": None, "worst_s": None, "worst_over_median": None}
    med, worst = statistics.median(lost), max(lost)
    return {"saves": len(lost), "median_s": med, "worst_s": worst,
            "worst_over_median": worst / med if med > 0 else None}


def ratio(theirs: dict, ours: dict) -> float | None:
    """How many times this engine's median lost time the other engine's is (None where
    this engine's median is not above zero: lost in the noise)."""
    if not theirs.get("median_s") or not ours.get("median_s") or ours["median_s"] <= 0:
        return None
    return theirs["median_s"] / ours["median_s"]


# --------------------------------------------------------------------------- A/B within a run
# The figure above compares the steps after a save with a baseline taken minutes away, and a
# step drifts by more than a checkpoint costs over minutes and between processes. The A/B
# figure below makes the comparison in time and in kind: real saves ("R") and sham saves
# ("S": the same trigger, call site and bookkeeping, nothing saved) alternate in ABBA order at
# one interval; each event is measured against the median of the steps just before it; the
# cost of a checkpoint is mean(real) - mean(sham), with a 95% interval, beside the same
# figure for shams against shams (A/A: the noise floor of the run).


def abba(events: int) -> list[str]:
    """``events`` labels in ABBA order: R S S R R S S R ...: a linear drift adds as much to
    the Rs as to the Ss of every four events, so it cancels from the difference."""
    if events < 1:
        raise ValueError(f"events={events}: at least 1")
    return ["RSSR"[i % 4] for i in range(events)]


def event_loss(steps_before: Sequence[float], steps_after: Sequence[float], call_s: float = 0.0,
               tail_s: float = 0.0) -> tuple[float, float]:
    """One event's loss and its baseline, seconds: ``call_s`` + sum of (step - b) over
    ``steps_after`` + ``tail_s`` (a wait for the event's work before the next event), b the
    median of ``steps_before`` (the steps just before the event)."""
    b = baseline_step(steps_before)
    return lost_time(call_s, steps_after, b, tail_s), b


_Z975 = 1.959963984540054  # NormalDist().inv_cdf(0.975)


def t975(df: float) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (Cornish-Fisher
    expansion about the normal: within 0.2% of the exact value from df = 3 up)."""
    z = _Z975
    if df <= 0:
        raise ValueError(f"df={df}: must be > 0")
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """mean(a) - mean(b) with its 95% interval (Welch's t: the two groups' spreads may differ),
    seconds. ``half_width_s`` is the interval's half width; None throughout with fewer than two
    values in a group."""
    a, b = list(a), list(b)
    out = {"n_a": len(a), "n_b": len(b), "mean_a_s": statistics.fmean(a) if a else None,
           "mean_b_s": statistics.fmean(b) if b else None, "diff_s": None, "half_width_s": None,
           "lo_s": None, "hi_s": None}
    if len(a) < 2 or len(b) < 2:
        return out
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = (va + vb) ** 0.5
    df = (va + vb) ** 2 / ((va ** 2 / (len(a) - 1)) + (vb ** 2 / (len(b) - 1))) if se > 0 else 1e9
    diff = out["mean_a_s"] - out["mean_b_s"]
    half = t975(max(df, 1.0)) * se
    out.update(diff_s=diff, half_width_s=half, lo_s=diff - half, hi_s=diff + half, df=df)
    return out


def split_aa(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Shams split into two groups in ABBA order (1 2 2 1 ...), for the A/A figure: two groups
    of the same treatment, spread over the run as the real and sham events are."""
    order = ["1221"[i % 4] for i in range(len(values))]
    return ([v for v, o in zip(values, order) if o == "1"], [v for v, o in zip(values, order) if o == "2"])


def ab_summary(labels: Sequence[str], losses: Sequence[float], interval_s: float | None = None) -> dict:
    """The A/B figure of a run: per event label ("R" real, "S" sham) and loss (seconds), the
    cost of a real save (``real_minus_sham``) and the noise floor (``sham_a_minus_sham_b``),
    each with its 95% interval; with ``interval_s`` (seconds between events) also the cost as
    a fraction of it."""
    if len(labels) != len(losses):
        raise ValueError(f"{len(labels)} labels for {len(losses)} losses")
    real = [v for k, v in zip(labels, losses) if k == "R"]
    sham = [v for k, v in zip(labels, losses) if k == "S"]
    out = {"events": len(labels), "real_minus_sham": difference(real, sham),
           "sham_a_minus_sham_b": difference(*split_aa(sham))}
    if interval_s:
        d = out["real_minus_sham"]
        out["fraction_of_interval"] = None if d["diff_s"] is None else d["diff_s"] / interval_s
        out["fraction_of_interval_hi"] = None if d["hi_s"] is None else d["hi_s"] / interval_s
    return out


def lost_times(events, save_every):
    """Training time each save of one run cost on rank 0 (:func:`lost_time`), by the step it
    was made after: its call plus the extra time of the ``save_every`` steps up to the next
    save. Baseline: the median step before the run's first save, its first step left out
    (start-up). Saves without ``save_every`` steps after them (the last, a killed one) are
    left out."""
    steps = {e["step"]: e["step_s"] for e in events if e["event"] == "step" and e["rank"] == 0}
    saves = {e["step"]: e["save_s"] for e in events if e["event"] == "checkpoint" and e["rank"] == 0}
    if not steps or not saves:
        return {}
    first_step, first_save = min(steps), min(saves)
    base = baseline_step(s for n, s in steps.items() if first_step < n <= first_save)
    out = {}
    for at, save_s in saves.items():
        after = [steps.get(at + j) for j in range(1, save_every + 1)]
        if None not in after:
            out[at] = lost_time(save_s, after, base)
    return out
