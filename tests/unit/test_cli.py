"""The ``ds-async-ckpt`` entry point itself (:mod:`deepspeed_async_ckpt.tools.cli`): how it
exits when its reader goes away. The subcommands are tested where their subjects are:
``plan`` in test_plan.py, ``list`` and ``verify`` in test_cli_verify_list.py."""

import os
import subprocess
import sys

from deepspeed_async_ckpt.tools import cli


def _save_dir_listing_past_a_pipe_buffer(root) -> str:
    """A save dir whose ``list`` table is far longer than a pipe holds (64 KiB on Linux), so
    the command is still writing when its reader closes."""
    save_dir = root / "ckpt"
    for i in range(4000):
        (save_dir / f"not_a_checkpoint_of_this_engine_{i:06d}").mkdir(parents=True)
    return str(save_dir)


def test_list_piped_into_a_reader_that_stops_early_exits_quietly(tmp_path, repo_env):
    """``ds-async-ckpt list ckpt | head -4``: no BrokenPipeError traceback, no "Exception
    ignored" at exit; the exit code is the shell's for a command killed by SIGPIPE."""
    save_dir = _save_dir_listing_past_a_pipe_buffer(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "deepspeed_async_ckpt.tools.cli", "list", save_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=repo_env)
    head = [proc.stdout.readline() for _ in range(4)]
    proc.stdout.close()  # what `head` does after its fourth line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == cli.EXIT_BROKEN_PIPE == 141, err
    assert head[0].startswith(b"checkpoint") and all(head), head
    assert err == "", err


def test_a_reader_gone_before_the_first_write_is_the_same(tmp_path, repo_env):
    """The pipe closed before the command writes anything (a reader that exited at once)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "deepspeed_async_ckpt.tools.cli", "list", str(tmp_path)],
                              stdout=write_end, stderr=subprocess.PIPE, env=repo_env, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == b"", proc.stderr


def test_main_called_in_process_returns_the_code_and_keeps_its_stdout(monkeypatch, capsys):
    """A caller's own stdout (here pytest's capture, without a file descriptor) is left alone."""
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["plan", "--params", "7e9", "--write-gbps", "10", "--mtbf-hours", "50000"]) == 141
