"""``scripts/launch.py``: rank 0's store port, the scripts' scratch directories and counts."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO  # noqa: E402

from deepspeed_async_ckpt.tools import launch  # noqa: E402


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    high = launch._ephemeral_low()
    ports = {launch.free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn, not one fixed port another run may hold
    for port in ports:
        assert max(1024, high - 12000) <= port < high, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_in_use(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = itertools.chain([taken, taken], itertools.count(20000))  # then the first free one
        monkeypatch.setattr(launch.random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        assert launch.free_port() != taken


def test_free_port_lets_the_kernel_choose_without_room_below_the_range(monkeypatch):
    monkeypatch.setattr(launch, "_ephemeral_low", lambda: 1024)
    port = launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ------------------------------------------------------------------------- scratch directories
def _someones_checkpoints(root) -> str:
    os.makedirs(os.path.join(root, "ckpt", "global_step100"))
    with open(os.path.join(root, "ckpt", "latest"), "w") as f:
        f.write("global_step100")
    return str(root)


def test_scratch_dir_refuses_a_directory_it_did_not_make(tmp_path):
    root = _someones_checkpoints(tmp_path / "precious")
    with pytest.raises(SystemExit, match="precious is not empty and was not made by these scripts"):
        launch.scratch_dir(root)
    assert sorted(os.listdir(os.path.join(root, "ckpt"))) == ["global_step100", "latest"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="not a directory"):
        launch.scratch_dir(str(tmp_path / "file"))


def test_scratch_dir_empties_its_own_directory_and_takes_a_new_or_empty_one(tmp_path):
    made = launch.scratch_dir(str(tmp_path / "new" / "work"))
    (tmp_path / "new" / "work" / "left.bin").write_text("from the last run")
    assert launch.scratch_dir(made) == made
    assert os.listdir(made) == [launch.SCRATCH_MARK]
    (tmp_path / "empty").mkdir()
    assert os.listdir(launch.scratch_dir(str(tmp_path / "empty"))) == [launch.SCRATCH_MARK]


@pytest.mark.parametrize("script, args", [
    ("demo.py", ["--workdir", "{root}"]),
    ("bench_checkpoint.py", ["--quick", "--work-dir", "{root}", "--out", "{root}/out.json"]),
    ("bench_load.py", ["--work-dir", "{root}"]),
])
def test_scripts_leave_a_directory_they_did_not_make(tmp_path, script, args):
    """Each script's work directory is emptied first: given a user's save directory by mistake,
    it refuses before starting anything, and the checkpoints are still there."""
    root = _someones_checkpoints(tmp_path / "precious")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", script),
                           *(a.format(root=root) for a in args)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode != 0
    assert "was not made by these scripts" in proc.stderr, proc.stderr[-2000:]
    assert sorted(os.listdir(root)) == ["ckpt"]
    assert sorted(os.listdir(os.path.join(root, "ckpt"))) == ["global_step100", "latest"]


@pytest.mark.parametrize("args, flag", [
    (["--nproc", "0", "x.py"], "--nproc"), (["--timeout", "nan", "x.py"], "--timeout"),
])
def test_launch_refuses_a_count_below_one(args, flag):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "launch.py"), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"argument {flag}: invalid" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, flag", [
    (["--save-every", "0"], "--save-every"), (["--save-every", "-3"], "--save-every"),
    (["--steps", "0"], "--steps"), (["--kill-at-step", "-1"], "--kill-at-step"),
    (["--zero-stage", "4"], "--zero-stage"),
])
def test_ds_train_refuses_bad_counts_naming_the_flag(tmp_path, args, flag):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "ds_train.py"), "--config",
                           "unused.json", "--save-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"argument {flag}: invalid" in proc.stderr, proc.stderr


def test_demo_refuses_a_kill_step_it_cannot_resume_from(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "demo.py"), "--workdir",
                           str(tmp_path / "w"), "--save-every", "5", "--kill-at", "7"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--kill-at 7 must be a multiple of --save-every 5" in proc.stderr
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------- ranks from a warm interpreter
RANK_SCRIPT = r'''
import atexit, json, os, sys, threading, time, warnings
import torch

def late():
    time.sleep(0.2)
    print("thread joined", flush=True)

threading.Thread(target=late).start()  # non-daemon: joined before the exit handlers
atexit.register(print, "atexit ran")
with warnings.catch_warnings(record=True) as caught:
    warnings.warn("shown unless PYTHONWARNINGS=ignore")
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "rank": os.environ["RANK"],
                  "path0": sys.path[0], "threads": torch.get_num_threads(), "warned": len(caught),
                  "name": __name__, "marker": os.environ.get("MARKER")}), flush=True)
how = ["return", "exit", "raise", "kill"][int(os.environ["RANK"])]
if how == "exit":
    sys.exit(3)
if how == "raise":
    raise RuntimeError("raised in the rank")
if how == "kill":
    os.kill(os.getpid(), 9)
'''


def _four_ranks(tmp_path, preload):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, MARKER="m", PYTHONWARNINGS="ignore", PYTHONPATH=REPO,
               **{launch.warm_start.PRELOAD: preload})
    prefix = str(tmp_path / ("forked" if preload else "fresh"))
    ranks = launch.spawn(str(script), ["a", "b c"], 4, env, log_prefix=prefix, cwd=str(tmp_path))
    try:  # every rank to its end (launch() would stop the others after the first failure)
        codes = [rank.wait(timeout=120) for rank in ranks]
    finally:
        launch.stop(ranks)
    return codes, [open(f"{prefix}.rank{r}.log").read() for r in range(4)]


def test_a_rank_forked_from_the_warm_interpreter_runs_and_exits_as_a_fresh_one(tmp_path):
    """The same script launched fresh and forked (ranks returning, exiting with 3, raising,
    killed): the same exit codes, argv, environment, working directory, sys.path[0], thread
    count, warnings filter, exit handlers after the threads, and output."""
    fresh, fresh_logs = _four_ranks(tmp_path, "")
    forked, forked_logs = _four_ranks(tmp_path, "torch,deepspeed,megatron.core")
    assert fresh == forked == [0, 3, 1, -9]
    for rank, (a, b) in enumerate(zip(fresh_logs, forked_logs)):
        first = [json.loads(log.splitlines()[0]) for log in (a, b)]
        assert first[0] == first[1] == {"argv": ["a", "b c"], "cwd": str(tmp_path), "rank": str(rank),
                                         "path0": str(tmp_path), "threads": 1, "warned": 0,
                                         "name": "__main__", "marker": "m"}, (a, b)
        for log in (a, b):
            if rank == 3:  # nothing after the kill
                assert "atexit ran" not in log, log
            else:
                assert log.index("thread joined") < log.index("atexit ran"), log
            if rank == 2:
                assert "RuntimeError: raised in the rank" in log, log
