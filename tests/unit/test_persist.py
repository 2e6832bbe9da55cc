"""Persisting host copies (``deepspeed_async_ckpt.persist``): torch.save archives, packed
files, checksums, shares of one file written by several ranks."""

import contextlib
import os
import threading

import pytest
import torch
import xxhash

from deepspeed_async_ckpt.commit import META_DIR, Pointer, read_manifest, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import (AsyncCheckpointError, CommitError, IntegrityError, PersistError,
                                         SnapshotError)
from deepspeed_async_ckpt.storage import LocalStorage

from _compare import assert_same

from fakes import FailingStorage
from helpers import make, sample_state, save_one, torch_save_reference


def test_a_torch_whose_zip_writer_takes_no_alignment_is_refused_at_construction(monkeypatch):
    """setup.py said torch>=2.4, but the zip writer's storage-alignment argument this engine
    passes is newer: on such a torch every save failed with a TypeError from the writer thread.
    It is refused when the checkpointer is made, naming torch."""
    class OldWriter:  # torch._C.PyTorchFileWriter before its storage_alignment argument
        def __init__(self, f, compute_crc32=True):
            pass

    monkeypatch.setattr(torch._C, "PyTorchFileWriter", OldWriter)
    with pytest.raises(PersistError, match=r"torch .* too old .*install torch 2\.7 or later"):
        make()


@pytest.mark.parametrize("zip_crc32", [True, False])
def test_zip_crc32_option_files_load_and_verify(tmp_path, zip_crc32):
    import zipfile

    state = sample_state()
    ck = make(zip_crc32=zip_crc32)
    save_one(ck, str(tmp_path), state)
    ck.fence()
    ck.wait()
    ck.close()
    path = tmp_path / "t1" / "model.pt"
    assert_same(torch.load(path, weights_only=True), torch.load(torch_save_reference(tmp_path, state), weights_only=True))
    verify_checkpoint(str(tmp_path / "t1"))  # the manifest checksum covers every byte either way
    bad = zipfile.ZipFile(path).testzip()  # first record whose stored CRC does not match
    assert (bad is None) == zip_crc32


def test_packed_file_is_checksummed_per_archive_and_a_partial_load_checks_only_what_it_reads(tmp_path):
    """Each archive of a packed file (with the padding before it) has its own checksum, the
    segments covering the file end to end: a load that reads some archives (megatron-core's
    without the optimizer state) hashes only those, and a flipped byte elsewhere is found by
    the full check, naming its range. With one checksum for the whole packed file such a load
    would hash every optimizer byte too."""
    from deepspeed_async_ckpt.commit import verify as commit_mod

    torch.manual_seed(2)
    parts = [(str(k), torch.randn(2000 + 500 * k)) for k in range(4)]
    ck = make()
    d = tmp_path / "c"
    ck.begin(str(d), tag="c")
    ck.save_packed(str(d / "__0_0.distcp"), parts)
    ck.end()
    ck.wait()
    ck.close()
    entry = read_manifest(str(d))["files"]["__0_0.distcp"]
    segments, spans = entry["segments"], [entry["parts"][name] for name, _ in parts]
    assert [s[0] for s in segments] == [0] + [o + n for o, n, _ in segments[:-1]]  # end to end
    assert segments[-1][0] + segments[-1][1] == entry["bytes"] == os.path.getsize(d / "__0_0.distcp")
    assert all(s[0] <= o and o + n == s[0] + s[1] for s, (o, n) in zip(segments, spans))
    data = (d / "__0_0.distcp").read_bytes()
    assert segments[1][2] == xxhash.xxh3_128_hexdigest(data[segments[1][0]:segments[1][0] + segments[1][1]])
    with open(d / "__0_0.distcp", "r+b") as f:  # a flipped byte in archive "3"
        f.seek(spans[3][0] + spans[3][1] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    hashed, hash_ranges = [], commit_mod.hash_ranges
    commit_mod.hash_ranges = lambda path, alg, ranges: hashed.extend(ranges) or hash_ranges(path, alg, ranges)
    try:
        reads = {"__0_0.distcp": [(spans[0][0] + 10, 100), tuple(spans[2])]}  # in archives 0 and 2
        verify_checkpoint(str(d), reads=reads.get)
        assert hashed == [tuple(segments[0][:2]), tuple(segments[2][:2])]
        with pytest.raises(IntegrityError, match=f"bytes {segments[3][0]}-{entry['bytes']}.*corrupted"):
            verify_checkpoint(str(d))
        with pytest.raises(IntegrityError, match="corrupted"):
            verify_checkpoint(str(d), reads=lambda rel: [tuple(spans[3])])
        # a manifest of an earlier version (one checksum per packed file) is checked whole
        manifest = read_manifest(str(d))
        del manifest["files"]["__0_0.distcp"]["segments"]
        manifest["files"]["__0_0.distcp"]["xxh128"] = xxhash.xxh3_128_hexdigest(data)
        hashed.clear()
        with pytest.raises(IntegrityError, match="corrupted"):  # the flip in archive 3, found
            verify_checkpoint(str(d), manifest=manifest, reads=reads.get)
        assert hashed == [(0, None)]
    finally:
        commit_mod.hash_ranges = hash_ranges


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_disk_full_inside_a_packed_file_releases_every_buffer_and_commits_nothing(tmp_path, mode):
    """A write failing in the second of four archives of a packed file: the save fails naming
    the file, its temporary file is gone, every host buffer of the remaining archives is back
    in the pool, and the next save (with space again) commits."""
    storage = FailingStorage(budget=100_000)  # each archive holds 64 KiB of tensor data
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=0.01),
                           storage=storage)
    parts = [(str(k), torch.full((16384,), float(k))) for k in range(4)]
    d = str(tmp_path / "bad")
    ck.begin(d, tag="bad", pointer=Pointer(str(tmp_path / "latest"), "bad"))
    try:  # sync mode raises in save_packed, async mode at the wait
        ck.save_packed(os.path.join(d, "__0_0.distcp"), parts)
        ck.end()
        ck.fence()
        ck.wait()
    except PersistError as exc:
        error = exc
    else:
        raise AssertionError("the save should have failed")
    if ck.is_open:  # as the adapters do when a save raised inside it
        ck.end(commit=False)
    assert "No space left" in str(error) and "__0_0.distcp" in str(error)
    assert not os.listdir(d) or os.listdir(d) == [META_DIR]  # no file, no temporary file
    assert not (tmp_path / "latest").exists()
    assert all(block.idle for block in ck.pool._blocks) and not ck.pool._live
    storage.budget = 10**9
    ck.begin(str(tmp_path / "good"), tag="good", pointer=Pointer(str(tmp_path / "latest"), "good"))
    ck.save_packed(str(tmp_path / "good" / "__0_0.distcp"), parts)
    ck.end()
    ck.fence()
    ck.wait()
    ck.close()
    assert (tmp_path / "latest").read_text() == "good"
    verify_checkpoint(str(tmp_path / "good"))


def test_packed_file_holds_one_torch_save_archive_per_part_at_page_offsets(tmp_path):
    """``save_packed``: several archives in one file, each on a page, found by the manifest's
    offset and length, each loading (from a view of just its bytes) to what ``torch.save``
    writes; the same bytes in sync and async mode."""
    import io

    torch.manual_seed(1)
    parts = [("0", torch.randn(300, 7)), ("1", {"obj": [1, 2], "t": torch.randn(5).to(torch.bfloat16)}),
             ("2", torch.empty(0)), ("3", torch.randn(64, 32).t()), ("4", torch.arange(10))]
    files = {}
    for mode in ("async", "sync"):
        ck = make(mode)
        d = tmp_path / mode
        ck.begin(str(d / "c"), tag="c")
        staged = ck.save_packed(str(d / "c" / "__0_0.distcp"), parts)
        ck.end()
        ck.fence()
        ck.wait()
        ck.close()
        assert staged[0] == 300 * 7 * 4 and staged[2] == 0
        verify_checkpoint(str(d / "c"))
        entry = read_manifest(str(d / "c"))["files"]["__0_0.distcp"]
        data = (d / "c" / "__0_0.distcp").read_bytes()
        assert entry["bytes"] == len(data)
        spans = [entry["parts"][name] for name, _ in parts]
        assert [off % 4096 for off, _ in spans] == [0] * len(parts)
        assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # in order, disjoint
        assert spans[-1][0] + spans[-1][1] == len(data)
        for (name, value), (off, length) in zip(parts, spans):
            assert_same(torch.load(io.BytesIO(data[off:off + length]), weights_only=False), value, name)
        files[mode] = data
    assert files["async"] == files["sync"]


def test_split_items_balances_contiguous_runs_and_never_cuts_at_empty_records():
    from deepspeed_async_ckpt.persist import split_items

    assert split_items([10] * 8, 2) == (4,)
    assert split_items([10] * 9, 3) == (3, 6)
    assert split_items([100, 1, 1, 100], 2) == (2,)  # 101 and 101 bytes
    assert split_items([1, 0, 0, 1], 2) == (3,)  # not at the records of 0 bytes
    assert split_items([5, 5], 4) == (1,)  # fewer shares than replicas: as many as items allow
    assert split_items([7], 3) == ()
    assert split_items([], 2) == ()


def test_commit_refuses_a_file_whose_shares_leave_a_gap_and_keeps_the_pointer(tmp_path):
    from deepspeed_async_ckpt.commit import commit, write_rank_record
    from deepspeed_async_ckpt.persist import FileEntry

    storage = LocalStorage()
    d = str(tmp_path / "t2")
    (tmp_path / "latest").write_text("t1")
    path, tmp = os.path.join(d, "model.pt"), os.path.join(d, "model.pt.tmp.s")  # save id "s"
    os.makedirs(d)
    open(tmp, "wb").close()
    # ranks 0 and 2 wrote their shares; rank 1's share (bytes 4096-8192) is not in its record
    shares = {0: (0, 4096), 1: None, 2: (8192, 100)}
    for rank, segment in shares.items():
        files = [] if segment is None else [FileEntry(path, 8292, "ab", segment=segment, tmp=tmp)]
        write_rank_record(storage, d, rank=rank, save_id="s", checksum="xxh128", files=files)
    with pytest.raises(CommitError, match=r"model.pt has no share for bytes 4096-8192"):
        commit(storage, d, tag="t2", save_id="s", world_size=3, checksum="xxh128", timeout_s=5,
               pointer=Pointer(str(tmp_path / "latest"), "t2"))
    assert (tmp_path / "latest").read_text() == "t1"
    assert not os.path.exists(path) and not (tmp_path / "t2" / META_DIR / "manifest.json").exists()
    assert not os.path.exists(tmp)  # the shares' temporary file went with the commit


@pytest.mark.parametrize("same", [False, True], ids=["different-bytes", "same-bytes"])
def test_two_ranks_writing_one_file_whole_commit_only_if_they_wrote_the_same_bytes(tmp_path, same):
    """Two ranks saving the same path whole (a file name without the rank in it, where each
    rank meant its own) fail the commit with a ``CommitError`` naming the file and both ranks,
    the pointer unmoved. Keeping the last rank's record, whatever file the last rename left
    on disk, would move ``latest`` to a checkpoint no load accepts (here the file on disk is
    rank 0's, the manifest would hold rank 1's checksum). The same bytes from both (replicas
    writing one file whole) commit."""
    exchange = lambda value, error, key="": (("same-id", False), {})  # noqa: E731  (both ranks' begin)
    rank0 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, commit_timeout_s=30), rank=0,
                              world_size=2, exchange=exchange)
    rank1 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True), rank=1, world_size=2, exchange=exchange)
    (tmp_path / "latest").write_text("t0")
    d = str(tmp_path / "t1")
    rank1.begin(d, tag="t1")
    rank1.save({"w": torch.ones(1000)}, os.path.join(d, "model.pt"))
    rank1.end().wait_persisted(30)  # rank 1's file first, then rank 0's over it
    handle = rank0.begin(d, tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    rank0.save({"w": torch.ones(1000) if same else torch.zeros(1000)}, os.path.join(d, "model.pt"))
    rank0.end()
    assert handle.wait_committed(60)
    for ck in (rank0, rank1):
        with contextlib.suppress(AsyncCheckpointError):
            ck.close()
    if same:
        assert handle.error is None and (tmp_path / "latest").read_text() == "t1"
        verify_checkpoint(d)
    else:
        assert isinstance(handle.error, CommitError), handle.error
        assert "ranks 0 and 1 both wrote model.pt, with different contents" in str(handle.error)
        assert (tmp_path / "latest").read_text() == "t0"


class _Holder:
    """A tensor inside an object that is no dict, list or tuple: copied at save (eager), since
    the snapshot cannot tell whether the loop changes it."""

    def __init__(self, t):
        self.t = t


def test_an_eager_copy_failing_in_a_later_part_of_a_packed_file_keeps_no_pool_buffer(tmp_path):
    """``save_packed``: the first part's lazy tensors were queued for the copier, then the
    eager copy of a later part's tensor raised (a meta tensor here; host memory exhausted
    alike). The file was never handed to a writer, but those tensors still went to the copier
    at ``end``, into pool buffers nothing ever released: the next save needing that room
    waited for ever at the fence (and ``wait`` and ``close`` with it). The error now names the
    file and the record."""
    ck = make(gb=300 * 1024 / 1024**3)  # room for one of the tensors below
    d = str(tmp_path / "bad")
    ck.begin(d, tag="bad")
    with pytest.raises(SnapshotError, match=r"__0_0\.distcp: tensor record .*meta"):
        ck.save_packed(os.path.join(d, "__0_0.distcp"),
                       [("a", {"w": torch.ones(50 * 1024)}),  # 200 KiB, lazy
                        ("b", {"h": _Holder(torch.empty(4, device="meta"))})])
    ck.end(commit=False)  # as the adapters do when a save raised inside it
    ck.fence()
    ck.wait()
    assert not ck.pool._live, "pool buffers of the failed save were never released"
    done = []

    def next_save():
        save_one(ck, str(tmp_path), {"w": torch.full((50 * 1024,), 2.0)}, tag="good", eager=())
        ck.fence()
        ck.wait()
        done.append(True)

    saving = threading.Thread(target=next_save, daemon=True)
    saving.start()
    saving.join(30)
    assert done, "the next save hung at the fence: its buffer never came back to the pool"
    ck.close()
    verify_checkpoint(str(tmp_path / "good"))


def test_a_large_record_is_hashed_and_written_in_few_parts(tmp_path, monkeypatch):
    """Each part a writer thread hashes and each write the I/O thread makes takes the GIL back
    from the training thread once: a 128 MiB record is hashed in 2 parts and written in at
    most 5 system calls (8 MiB parts made 16 and 16), and its bytes are intact."""
    from deepspeed_async_ckpt.persist import checksum

    updates, writes, real_pwritev = [], [], os.pwritev
    real_new = checksum.new_hasher

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def update(self, data):
            updates.append(len(data))
            self.inner.update(data)

        def hexdigest(self):
            return self.inner.hexdigest()

    monkeypatch.setattr(checksum, "new_hasher", lambda algorithm: Counting(real_new(algorithm)))
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: writes.append(off) or real_pwritev(fd, bufs, off))
    big = torch.arange(32 * 1024 * 1024, dtype=torch.float32)  # 128 MiB
    ck = make(gb=0.3)
    save_one(ck, str(tmp_path), {"big": big}, eager=())
    ck.wait()
    ck.close()
    assert sum(1 for n in updates if n >= 32 << 20) == 2, updates
    if writes:  # direct I/O where the filesystem has it
        assert len(writes) <= 5, len(writes)
    assert torch.equal(torch.load(tmp_path / "t1" / "model.pt", weights_only=True)["big"], big)


def test_a_failed_writes_temporary_is_removed_through_the_storage_and_its_error_stays_the_writes(tmp_path):
    """A file whose write fails (a full disk) has its temporary removed through the storage
    (the worker process runs the same ``write_file``); a storage that cannot remove it (an
    error of its own kind) leaves it, and the save fails with the write's error, not the
    removal's."""
    class FullAndStuck(FailingStorage):
        def __init__(self):
            super().__init__(budget=1000)
            self.removing = []

        def remove_tree(self, path):
            self.removing.append(path)
            raise RuntimeError("503 Slow Down")

    storage = FullAndStuck()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage)
    d = tmp_path / "t"
    ck.begin(str(d), tag="t", pointer=Pointer(str(tmp_path / "latest"), "t"))
    ck.save({"w": torch.randn(16384)}, str(d / "model.pt"))
    ck.end()
    with pytest.raises(PersistError, match="writing .*model.pt failed: .*No space left") as raised:
        ck.wait()
    ck.close()
    assert "503" not in str(raised.value)
    left = [n for n in os.listdir(d) if n.startswith("model.pt.tmp.")]
    assert len(left) == 1 and storage.removing == [str(d / left[0])]
    assert not (tmp_path / "latest").exists()
