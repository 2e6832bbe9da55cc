"""The GPU checks in one call: what runs on a lent single-GPU machine, prepared here.

A lent GPU machine (see docs/gpu_results.md) has CUDA, PyTorch, xxhash, nvidia-ml-py and pytest,
but not DeepSpeed or its pydantic and hjson, nothing can be fetched there, and it is lent for
15 minutes of device time in all, its start included. So the wheels it lacks are made
here, and everything there is one command:

    python scripts/gpu_check.py wheels            # here (reaches PyPI): .whl/, git-ignored
    # then, with the device tool: run(command="python3 scripts/gpu_check.py run --out $OUT",
    #                                 carry=[".whl"], timeout_s=480)

``run`` installs ``.whl/`` and this checkout, then runs, each with its own time limit and log:
1. ``env``: the GPU (``nvidia-smi``), torch, CUDA and DeepSpeed versions;
2. ``pytest``: the CUDA tests (``-m gpu`` in ``tests/unit/test_cuda.py``: pinned pool, copy stream,
   fence; the multi-rank DeepSpeed tests over NCCL need a GPU per rank: ``make test-gpu`` on a
   machine with several);
3. ``gpu_report``: ``scripts/bench_checkpoint.py --gpu-report`` (pinned D2H bandwidth, this
   engine's snapshot bandwidth and stall with compute longer than the copy, NVML samples);
4. ``demo``: the main job on the GPU (``scripts/demo.py --nproc 1``: DeepSpeed ZeRO-1 over
   NCCL, async checkpoints, SIGKILL, resume, then the training time lost per checkpoint against
   ``TorchCheckpointEngine``);
5. ``host_tests``: the core's unit tests (:data:`HOST_TESTS`, host tensors) with CUDA present,
   where the engine pins its pool and runs a copy stream: faults of those paths show only
   there, not in the CPU-only CI. Without a GPU it is not run (CI runs those tests), and the
   summary says so.
``lost`` (a call of its own: ``python3 scripts/gpu_check.py lost --out $OUT``, 8.5-9.5 minutes
with the install) installs the same way and runs ``scripts/bench_gpu_lost.py``: the training
time a checkpoint costs GPT-2 24 x 1024 (bf16, ZeRO-1, fused AdamW, 4.97 GB per checkpoint),
real saves against shams in ABBA order, per engine (``TorchCheckpointEngine``, DeepSpeed's
decoupled engine or its error, this engine with threads and with a worker process), into
``$OUT/lost.json`` and ``$OUT/lost.log``.

It writes ``summary.json`` and one log per step under ``--out`` (seven files: the device tool
brings back eight at most) and prints a line per step and the summary; it exits 1 if a step
failed. Where no GPU is
visible (here) the CUDA tests skip, ``--gpu-report`` says so and the demo runs on the CPU:
``tests/integration/test_bench_smoke.py`` runs it that way, so the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WHEELS = os.path.join(REPO, ".whl")
sys.path.insert(0, REPO)  # this checkout's package, before an installed one
from deepspeed_async_ckpt.bench.logs import pytest_summary, tail_line  # noqa: E402
from deepspeed_async_ckpt.tools.launch import scratch_dir  # noqa: E402

DEVICE_PYTHON = "3.12"
"""The lent machines' Python (docs: the device tool's KINDS.md): binary wheels are for it."""
MISSING_THERE = ("hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
                 "typing-extensions")
"""What DeepSpeed needs that the lent machines' image lacks (typing-extensions: pydantic needs
a recent one), at the versions installed here, which CI tests against."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CUDA_TESTS = ("tests/unit/test_cuda.py",)
"""The ``gpu``-marked tests (each skips with its reason where no GPU is visible)."""
HOST_TESTS = tuple(f"tests/unit/test_{name}.py" for name in (
    "checkpointer_roundtrip", "snapshot_stager", "snapshot_pool", "storage_direct", "storage_local",
    "persist", "commit_sequence", "commit_replace", "retention", "verify", "cli_verify_list",
    "core_lifecycle", "core_failures", "core_session", "deepspeed_engine", "pacing"))
"""The core's unit tests on host tensors, run again with CUDA present (the pool pinned, a copy
stream running)."""


def wheels(out: str, python_version: str) -> int:
    """Download the wheels of :data:`MISSING_THERE` for ``python_version`` and build
    DeepSpeed's (it ships only a source archive) into ``out``, replacing what was there."""
    from importlib.metadata import version

    if os.path.isdir(out) and all(n.endswith(".whl") for n in os.listdir(out)):
        shutil.rmtree(out)  # an earlier run's wheels: replaced
    out = scratch_dir(out)  # anything else: refused unless these scripts made it
    pins = [f"{name}=={version(name)}" for name in MISSING_THERE]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms,
                    "-d", out, *pins], check=True)
    # DS_BUILD_OPS=0: no compiled ops, a pure-Python wheel; its JIT ops are not used here
    # (torch's Adam), and DS_ACCELERATOR picks the accelerator at run time
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", out, f"deepspeed=={version('deepspeed')}"],
                   check=True, env=dict(os.environ, DS_BUILD_OPS="0"))
    names = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, n)) for n in names)
    print("\n".join(names))
    print(f"{len(names)} wheels, {size / 2**20:.1f} MiB in {out} (the device tool carries 64 MiB)")
    return 0


def install(wheel_dir: str, site_dir: str) -> dict:
    """Install the wheels and this checkout into ``site_dir`` and return the environment
    that puts it first on the path, with its ``.pth`` files read (this package's auto-activation
    hook is one): a ``sitecustomize`` there adds it as a site directory."""
    found = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-build-isolation", "--no-compile", "--upgrade", "--target", site_dir,
                    *found, REPO], check=True)
    with open(os.path.join(site_dir, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write("import os, site\nsite.addsitedir(os.path.dirname(os.path.abspath(__file__)))\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [site_dir, REPO, os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1")


def step(name: str, cmd: list[str], env: dict, out: str, timeout: float, deadline: float) -> dict:
    """Run one check with its output in ``<out>/<name>.log``, for ``timeout`` seconds at most
    and not past ``deadline`` (``time.monotonic()``); never raises."""
    t0 = time.monotonic()
    timeout = max(1.0, min(timeout, deadline - t0))
    log = os.path.join(out, f"{name}.log")
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            code = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"step": name, "exit": code, "seconds": round(time.monotonic() - t0, 1)}
    print(f"{name:<11} {'ok' if code == 0 else 'FAILED (' + str(code) + ')':<14} "
          f"{result['seconds']:>6.1f} s  {log}", flush=True)
    return result


def run(out: str, wheel_dir: str, quick: bool = False, budget_s: float = 420) -> int:
    """Install, run the four steps within ``budget_s`` seconds in all (each has its own limit
    too), write ``summary.json``; ``quick``: a small demo (the smoke test's). The installed
    packages and the demo's checkpoints are removed at the end."""
    deadline = time.monotonic() + budget_s
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        env = install(wheel_dir, os.path.join(scratch, "site"))
        gpus, results = checks(out, env, os.path.join(scratch, "demo"), quick, deadline)
    summary = {"gpus": gpus, "steps": results,
               "pytest": pytest_summary(os.path.join(out, "pytest.log")),
               "demo": tail_line(os.path.join(out, "demo.log"), "Training time lost per checkpoint"),
               "host_tests": pytest_summary(os.path.join(out, "host_tests.log")) or results[-1].get("skipped")}
    report = os.path.join(out, "gpu_report.json")
    if os.path.exists(report):
        with open(report, encoding="utf-8") as f:
            gpu = json.load(f).get("gpu", {})
        summary["gpu_report"] = {k: gpu.get(k) for k in ("available", "reason", "device", "pinned_d2h_gbps",
                                                         "snapshot_fraction_of_pinned", "compute_s",
                                                         "persist_gbps", "persist_fraction_of_storage")}
        if gpu.get("saves"):
            summary["gpu_report"]["steady_save"] = gpu["saves"][-1]
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=1))
    return 0 if all(r["exit"] == 0 for r in results) else 1


def checks(out: str, env: dict, demo_dir: str, quick: bool, deadline: float) -> tuple[int, list[dict]]:
    """The five steps, with ``env`` from :func:`install`: the GPUs seen and each step's result."""
    import torch  # the interpreter's own torch (the wheels bring none)

    gpus = torch.cuda.device_count()
    env = dict(env, DS_ACCELERATOR="cuda" if gpus else "cpu")
    py = sys.executable
    info = ("import json, torch, deepspeed, deepspeed_async_ckpt; print(json.dumps({"
            "'torch': torch.__version__, 'cuda': torch.version.cuda, 'gpus': [torch.cuda.get_device_name(i)"
            " for i in range(torch.cuda.device_count())], 'deepspeed': deepspeed.__version__, "
            "'engine': deepspeed_async_ckpt.__file__}))")
    # on a GPU a 1.07 GB checkpoint (67M parameters, 16 bytes each under ZeRO-1) every 200
    # steps of ~8 ms on an H100: 1.6 s apart, longer than it takes to persist (~0.9 s there).
    # Every 5 steps (the CPU demo's), each save waited for the previous one to be written
    gpu_demo = ["--hidden", "4096", "--layers", "4", "--steps", "800", "--save-every", "200", "--kill-at", "600"]
    demo_args = (["--steps", "8", "--save-every", "2", "--kill-at", "4", "--hidden", "256", "--layers", "2"]
                 if quick else gpu_demo if gpus else [])
    results = [
        step("env", ["bash", "-c", f"nvidia-smi -L; {py} -c \"{info}\""], env, out, 60, deadline),
        step("pytest", [py, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "-m", "gpu",
                        *CUDA_TESTS], env, out, 150, deadline),
        step("gpu_report", [py, "scripts/bench_checkpoint.py", "--gpu-report",
                            "--out", os.path.join(out, "gpu_report.json")], env, out, 150, deadline),
        step("demo", [py, "scripts/demo.py", "--nproc", "1", *demo_args, "--workdir", demo_dir],
             env, out, 240, deadline),
    ]
    # after the rest: what the GPU is lent for comes back even if this runs out of time
    if gpus:
        results.append(step("host_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                                           "not slow and not gpu", "--timeout", "60", *HOST_TESTS],
                            env, out, 150, deadline))
    else:
        results.append({"step": "host_tests", "exit": 0, "seconds": 0.0,
                        "skipped": "not run without a GPU: the CPU suite runs these tests"})
        print(f"{'host_tests':<11} {results[-1]['skipped']}", flush=True)
    return gpus, results


def lost(out: str, wheel_dir: str, budget_s: float, tiny: bool = False) -> int:
    """Install, then the A/B lost-time measurement on the GPU within ``budget_s`` seconds
    (``tiny``: its smallest form, on the CPU if there is no GPU)."""
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        env = install(wheel_dir, os.path.join(scratch, "site"))
        import torch

        env = dict(env, DS_ACCELERATOR="cuda" if torch.cuda.is_available() else "cpu")
        cmd = [sys.executable, "scripts/bench_gpu_lost.py", "--out", os.path.join(out, "lost.json"),
               "--budget-s", str(budget_s), "--work-dir", os.path.join(scratch, "work")] + (["--tiny"] if tiny else [])
        # the model's start comes before the budget and an engine may end one ABBA block past it
        result = step("lost", cmd, env, out, budget_s + 150, time.monotonic() + budget_s + 150)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"steps": [result], "table": tail_line(os.path.join(out, "lost.log"), "| ")}, f, indent=1)
    return 0 if result["exit"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels", help="here: build .whl/ for the GPU machine")
    w.add_argument("--out", default=WHEELS)
    w.add_argument("--python-version", default=DEVICE_PYTHON)
    r = sub.add_parser("run", help="there: install .whl/ and run the GPU checks")
    r.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench_out", "gpu_check"))
    r.add_argument("--wheels", default=WHEELS)
    r.add_argument("--quick", action="store_true", help="a small demo (8 steps, hidden 256)")
    r.add_argument("--budget-s", type=float, default=420,
                   help="seconds for all the steps together (the install comes before)")
    lo = sub.add_parser("lost", help="there: install .whl/ and measure the time a checkpoint costs training")
    lo.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench_out", "gpu_check"))
    lo.add_argument("--wheels", default=WHEELS)
    lo.add_argument("--budget-s", type=float, default=390, help="seconds for the measurement (the install and "
                    "the model's start come on top: about 1.5 minutes)")
    lo.add_argument("--tiny", action="store_true", help="the smallest model (the smoke test's)")
    a = p.parse_args(argv)
    if a.command == "lost":
        return lost(a.out, a.wheels, a.budget_s, a.tiny)
    if a.command == "wheels":
        return wheels(a.out, a.python_version)
    return run(a.out, a.wheels, a.quick, a.budget_s)


if __name__ == "__main__":
    sys.exit(main())
