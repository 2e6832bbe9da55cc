"""What machine a benchmark ran on: CPUs, memory, versions."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess


def machine_info() -> dict:
    import deepspeed
    import torch

    top = subprocess.run(["top", "-bn1"], capture_output=True, text=True).stdout.splitlines()[:12] \
        if shutil.which("top") else []
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    def read(path: str) -> str | None:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return None

    # Kernel memory management dominates page-fault cost on this kind of VM: record its setup.
    kernel = {"release": platform.release(),
              "transparent_hugepage": read("/sys/kernel/mm/transparent_hugepage/enabled"),
              "damon_kdamond_0": read("/sys/kernel/mm/damon/admin/kdamonds/0/state"),
              "damon_scheme_0_action": read("/sys/kernel/mm/damon/admin/kdamonds/0/contexts/0/schemes/0/action"),
              "swap_total_kb": next((ln.split()[1] for ln in (read("/proc/meminfo") or "").splitlines()
                                     if ln.startswith("SwapTotal")), None)}
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "kernel": kernel,
            "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "cuda": torch.cuda.is_available(), "loadavg": os.getloadavg(), "top": top}
