"""What a benchmark rank used: CPU time and page faults, the seconds spent in a call it
times, and how many bytes a state or a directory holds."""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Callable

import torch


def timed(fn: Callable[..., Any], add: Callable[[float], Any],
          started: Callable[[float], Any] | None = None) -> Callable[..., Any]:
    """``fn``, wrapped: each call's seconds (``time.perf_counter``) go to ``add`` once it
    returns or raises, and its start to ``started`` (if given). What a benchmark wraps around
    an engine's wait (the fence at the optimizer step, a commit) to count what it costs."""

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        if started is not None:
            started(start)
        try:
            return fn(*args, **kwargs)
        finally:
            add(time.perf_counter() - start)

    return call


def usage() -> dict:
    """CPU seconds and page faults of this process, all threads (copier and writers included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": ru.ru_utime, "sys_s": ru.ru_stime, "minflt": ru.ru_minflt, "majflt": ru.ru_majflt}


def usage_delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor reachable through dicts, lists and tuples (each counted once)."""
    seen, total, stack = set(), 0, [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total
