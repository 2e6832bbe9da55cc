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
