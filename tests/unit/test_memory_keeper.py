"""The keeper process with real processes: ranks forked from the test in a process group of
their own, as a launcher's, SIGKILLed together; the keeper survives them and serves a fresh
process bitwise; a killed keeper is seen gone and its successor removes what it left; a
corrupted byte is found and named; each save directory has its own keeper; the keeper exits
without leaving a segment in /dev/shm (shutdown, idle, SIGTERM); no keeper outlives a test."""

import json
import os
import random
import signal
import socket
import threading
import time

import pytest

import deepspeed_async_ckpt.persist.checksum  # noqa: F401  (imported once here, not in every forked rank)
from deepspeed_async_ckpt.errors import IntegrityError
from deepspeed_async_ckpt.memory import keeper as keeper_module
from deepspeed_async_ckpt.memory import segment
from deepspeed_async_ckpt.memory.address import KeeperAddress
from deepspeed_async_ckpt.memory.client import KeeperClient, KeeperError, KeeperUnavailable
from deepspeed_async_ckpt.memory.config import MemoryConfig

from _memory import keeper_pids

MB = 1 << 20
CONFIG = MemoryConfig(enabled=True, keep_last=2, idle_timeout_s=30)


def proc_stat(pid: int) -> tuple[str, int, int, int]:
    """(state, ppid, process group, session) of ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def alive(pid: int) -> bool:
    try:
        return proc_stat(pid)[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout_s} s: {predicate}")
        time.sleep(0.02)


@pytest.fixture
def save_dir(tmp_path, monkeypatch):
    """A save directory; its keepers are killed and their segments removed at teardown. The
    keepers' logs go to the test's own runtime directory."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    path = tmp_path / "ckpt"
    path.mkdir()
    yield str(path)
    left = keeper_pids(str(path))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not keeper_pids(str(path)))
    for name in KeeperAddress.of(str(path)).segments_on_node():
        segment.unlink(name)


class Ranks:
    """Processes forked from the test, each running one function, in one process group of
    their own (as a launcher's ranks). Each reports its function's result (JSON) and then
    waits to be killed."""

    def __init__(self, *fns, barrier: bool = False) -> None:
        self.pids: list[int] = []
        read, write = os.pipe()
        go_read, go_write = os.pipe()
        for fn in fns:
            pid = os.fork()
            if pid == 0:  # the rank
                code = 0
                try:
                    os.close(read)
                    null = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(null, 1)
                    os.dup2(null, 2)
                    os.setpgid(0, self.pids[0] if self.pids else 0)
                    if barrier:
                        os.read(go_read, 1)
                    line = json.dumps({"ok": fn()})
                except BaseException as exc:
                    line, code = json.dumps({"error": f"{type(exc).__name__}: {exc}"}), 1
                os.write(write, line.encode() + b"\n")
                if code == 0:
                    signal.pause()
                os._exit(code)
            try:
                os.setpgid(pid, self.pids[0] if self.pids else pid)
            except (PermissionError, ProcessLookupError):
                pass  # the rank set it already
            self.pids.append(pid)
        os.close(write)
        os.close(go_read)
        if barrier:
            os.write(go_write, b"x" * len(fns))
        os.close(go_write)
        self.pgid, self.killed = self.pids[0], False
        results = []
        with os.fdopen(read, "rb") as f:
            for _ in fns:
                line = f.readline()
                results.append(json.loads(line) if line else {"error": "a rank died"})
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            self.kill()
            raise AssertionError(f"a rank failed: {errors}")
        self.results = [r["ok"] for r in results]

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole group, as a launcher or scheduler tearing the job down does."""
        if not self.killed:
            self.killed = True
            os.killpg(self.pgid, signal.SIGKILL)
            for pid in self.pids:
                os.waitpid(pid, 0)


def payload(rank: int) -> dict[str, bytes]:
    rng = random.Random(rank)
    return {f"mp_rank_{rank:02d}_model_states.pt": rng.randbytes(3 * MB + 1234 * rank + 7),
            f"rank_{rank}_optim.pt": rng.randbytes(5000)}


def write_rank(save_dir, rank, name="step1", save_id="sid1", node_ranks=(0, 1), config=CONFIG):
    client = KeeperClient.connect(save_dir, config)
    files = payload(rank)
    res = client.reserve(name, save_id, rank, node_ranks, {n: len(b) for n, b in files.items()})
    for n, b in files.items():
        res.write(n, b)
    return {"keeper": client.keeper_pid, "state": res.report().state}


def test_two_ranks_copy_commit_and_a_fresh_process_reads_back_bitwise_after_every_rank_is_killed(save_dir):
    with Ranks(lambda: write_rank(save_dir, 0), lambda: write_rank(save_dir, 1)) as ranks:
        _killed_after_commit(save_dir, ranks)


def _killed_after_commit(save_dir, ranks):
    (keeper,) = {r["keeper"] for r in ranks.results}
    assert sorted(r["state"] for r in ranks.results) == ["copied", "open"]  # the second report completes it
    job = KeeperClient.connect(save_dir, CONFIG, start=False)
    assert job.commit("step1", "sid1").state == "committed"
    job.close()

    ranks.kill()
    assert alive(keeper) and keeper_pids(save_dir) == [keeper]
    _, ppid, pgid, sid = proc_stat(keeper)
    assert ppid not in ranks.pids and pgid != ranks.pgid and sid not in (ranks.pgid, os.getsid(0))

    def read_back():
        copy = KeeperClient.find(save_dir).newest()
        return {"slot": [copy.name, copy.save_id],
                "equal": all(bytes(copy.read(r, n)) == b for r in (0, 1) for n, b in payload(r).items())}

    with Ranks(read_back) as reader:
        assert reader.results == [{"slot": ["step1", "sid1"], "equal": True}]


def test_ranks_racing_to_start_the_keeper_get_one(save_dir):
    with Ranks(*[lambda: KeeperClient.connect(save_dir, CONFIG).keeper_pid] * 3, barrier=True) as ranks:
        assert len(set(ranks.results)) == 1
        wait_for(lambda: keeper_pids(save_dir) == ranks.results[:1])  # the others exit once they lost the bind
        with open(f"/proc/{ranks.results[0]}/maps", "rb") as maps:
            assert b"libtorch" not in maps.read()  # the keeper stays small: no torch, no engine


def test_a_request_the_keeper_does_not_understand_is_refused_and_it_serves_on(save_dir):
    client = KeeperClient.connect(save_dir, CONFIG)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(KeeperAddress.of(save_dir).socket_name)
    raw.sendall(b'{"type": "Launch"}\n{"type": "Welcome", "pid": 1, "log_path": "x"}\n')
    replies = raw.makefile("rb")
    first, second = replies.readline(), replies.readline()
    assert b"Refused" in first and b"not a request the keeper understands" in first
    assert b"Refused" in second
    with pytest.raises((BrokenPipeError, ConnectionResetError)):  # a line without end, over the bound:
        raw.sendall(b"x" * (keeper_module._MAX_LINE + (1 << 20)))  # the keeper closes that connection
    raw.close()
    assert client.status().clients == 1
    client.shutdown()


def test_a_killed_keeper_is_seen_gone_and_the_next_one_removes_its_segments(save_dir):
    address = KeeperAddress.of(save_dir)
    client = KeeperClient.connect(save_dir, CONFIG)
    write_rank(save_dir, 0, node_ranks=(0,))
    client.commit("step1")
    left = address.segments_on_node()
    assert len(left) == len(payload(0))  # a segment per file
    os.kill(client.keeper_pid, signal.SIGKILL)
    wait_for(lambda: not alive(client.keeper_pid))
    with pytest.raises(KeeperUnavailable, match=f"memory keeper of {save_dir} .* is gone .*its log: "):
        client.newest()
    assert KeeperClient.find(save_dir) is None
    assert address.segments_on_node() == left  # what a SIGKILL leaves ...

    successor = KeeperClient.connect(save_dir, CONFIG)
    assert successor.keeper_pid != client.keeper_pid
    assert address.segments_on_node() == [] and successor.newest() is None  # ... the next keeper removes
    with open(address.log_path) as log:
        assert f"removed {len(left)} stale segment(s): {', '.join(left)}" in log.read()
    successor.shutdown()


def test_a_corrupted_byte_in_memory_is_found_naming_the_file_and_the_slot(save_dir):
    client = KeeperClient.connect(save_dir, CONFIG)
    write_rank(save_dir, 0, node_ranks=(0,))
    client.commit("step1", "sid1")
    copy = client.newest()
    name, data = list(payload(0).items())[0]
    seg = copy.ranks[0].files[0].segment
    os.chmod(segment.path_of(seg), 0o600)  # reported: the keeper made it read-only
    with open(segment.path_of(seg), "r+b") as f:
        f.seek(len(data) // 2)
        f.write(bytes([f.read(1)[0] ^ 1]))
    with pytest.raises(IntegrityError) as err:
        copy.read(0, name)
    assert (f"{name} of rank 0 in memory checkpoint step1 (save sid1, segment {seg}): xxh128 " in str(err.value)
            and str(err.value).endswith("corrupted"))
    other, other_data = list(payload(0).items())[1]
    view = copy.read(0, other)
    assert bytes(view) == other_data
    view.release()
    copy.close()
    client.shutdown()


def test_two_save_directories_get_two_keepers_and_a_link_finds_the_same_one(save_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (tmp_path / "link").symlink_to(save_dir)
    try:
        a, b = KeeperClient.connect(save_dir, CONFIG), KeeperClient.connect(str(other), CONFIG)
        assert a.keeper_pid != b.keeper_pid
        assert KeeperClient.connect(str(tmp_path / "link"), CONFIG).keeper_pid == a.keeper_pid
        write_rank(save_dir, 0, node_ranks=(0,))
        a.commit("step1")
        assert a.newest().name == "step1" and b.newest() is None
        a.shutdown()
        b.shutdown()
    finally:
        for pid in keeper_pids(str(other)):
            os.kill(pid, signal.SIGKILL)


def test_keep_last_frees_slots_and_max_gb_refuses_naming_the_setting(save_dir):
    config = MemoryConfig(enabled=True, keep_last=2, max_gb=3 * MB / 2**30, idle_timeout_s=30)
    client = KeeperClient.connect(save_dir, config)
    address = KeeperAddress.of(save_dir)
    for step in range(3):
        res = client.reserve(f"step{step}", f"sid{step}", 0, (0,), {"a.pt": MB})
        res.write("a.pt", bytes([step]) * MB)
        res.report()
        client.commit(f"step{step}")
        assert len(address.segments_on_node()) == min(step + 1, 3)  # keep_last + the next save's spare
    assert [s.name for s in client.status().slots] == ["step1", "step2"]
    with pytest.raises(KeeperError) as err:
        client.reserve("step3", "sid3", 0, (0,), {"a.pt": 2 * MB})
    assert ("async_checkpoint.memory.max_gb is 0.00292969 (3145728 bytes): rank 0 for step3 (save sid3) asked "
            f"{2 * MB} bytes while the keeper holds {2 * MB} bytes") in str(err.value)
    assert bytes(client.newest().read(0, "a.pt")) == bytes([2]) * MB
    client.shutdown()


def test_a_rank_killed_mid_copy_frees_its_slot_and_the_next_save_goes_on(save_dir):
    held = []  # the rank's connection stays open until the rank dies

    def reserve_only():
        client = KeeperClient.connect(save_dir, CONFIG)
        held.append(client.reserve("step1", "sid1", 0, (0, 1), {"a.pt": MB}))
        return client.keeper_pid

    with Ranks(reserve_only) as rank:
        other = KeeperClient.connect(save_dir, CONFIG, start=False)
        with pytest.raises(KeeperError, match=r"step1 \(save sid1\) is open, ranks \[0, 1\] still copying"):
            other.reserve("step2", "sid2", 0, (0,), {"a.pt": MB}, wait_s=0.1)
        rank.kill()
    wait_for(lambda: other.status().slots == ())
    assert KeeperAddress.of(save_dir).segments_on_node() == []
    other.reserve("step2", "sid2", 0, (0,), {"a.pt": MB}).report()
    assert other.commit("step2").state == "committed"
    other.shutdown()


@pytest.mark.parametrize("how", ["shutdown", "idle", "sigterm"])
def test_the_keeper_exits_leaving_no_segment(save_dir, how):
    address = KeeperAddress.of(save_dir)
    client = KeeperClient.connect(save_dir, MemoryConfig(enabled=True, keep_last=2, idle_timeout_s=0.5))
    for step in range(3):
        client.reserve(f"step{step}", f"sid{step}", 0, (0,), {"a.pt": MB}).report()
        client.commit(f"step{step}")
    assert len(address.segments_on_node()) == 3
    pid = client.keeper_pid
    if how == "shutdown":
        client.shutdown()
    elif how == "idle":
        client.close()
    else:
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not alive(pid))
    assert address.segments_on_node() == [] and KeeperClient.find(save_dir) is None


def test_a_failed_save_is_not_committed_and_abandoning_it_frees_its_memory(save_dir):
    client = KeeperClient.connect(save_dir, CONFIG)
    res = client.reserve("step1", "sid1", 0, (0, 1), {"a.pt": MB})
    res.write("a.pt", b"x" * 10)
    with pytest.raises(KeeperError, match=r"step1 \(save sid1\) cannot be committed: ranks \[0, 1\] of the node"):
        client.commit("step1", "sid1")
    res.close()
    client.abandon("step1", "sid1")
    assert client.status().slots == () and KeeperAddress.of(save_dir).segments_on_node() == []
    client.reserve("step2", "sid2", 0, (0,), {"a.pt": MB}, wait_s=0).report()
    assert client.commit("step2").state == "committed" and client.newest().name == "step2"
    client.shutdown()


def test_a_rank_connecting_while_the_keeper_exits_starts_the_next_one(save_dir):
    first = KeeperClient.connect(save_dir, CONFIG)
    pid = first.keeper_pid
    first.close()
    os.kill(pid, signal.SIGSTOP)
    connected = []
    rank = threading.Thread(target=lambda: connected.append(KeeperClient.connect(save_dir, CONFIG)))
    rank.start()
    time.sleep(0.3)  # its connection waits in the stopped keeper's backlog
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGCONT)
    rank.join(30)
    assert connected and connected[0].keeper_pid != pid and not alive(pid)
    assert keeper_pids(save_dir) == [connected[0].keeper_pid]
    connected[0].shutdown()
