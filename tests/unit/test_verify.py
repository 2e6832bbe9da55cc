"""Verifying a checkpoint (``deepspeed_async_ckpt.commit.verify``) and the all-ranks check
before a load."""

import hashlib
import os
import zlib

import pytest
import xxhash

from deepspeed_async_ckpt.commit import META_DIR, Pointer, read_manifest, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.agreement import KEY_DIFFERS
from deepspeed_async_ckpt.errors import Failure, IntegrityError

from _compare import assert_same

from helpers import make, sample_state, save_one


@pytest.mark.parametrize("checksum", ["xxh128", "crc32", "sha256"])
def test_corrupted_byte_is_detected_naming_the_file(tmp_path, checksum):
    ck = make(checksum=checksum)
    save_one(ck, str(tmp_path), sample_state())
    ck.wait()
    path = tmp_path / "t1" / "model.pt"
    manifest = read_manifest(str(tmp_path / "t1"))
    assert manifest["checksum"] == checksum
    # The manifest holds the digest any standard tool computes over the whole file
    # (xxh128sum, crc32, sha256sum).
    whole = path.read_bytes()
    expected = {"xxh128": lambda b: xxhash.xxh3_128(b).hexdigest(),
                "crc32": lambda b: f"{zlib.crc32(b):08x}",
                "sha256": lambda b: hashlib.sha256(b).hexdigest()}[checksum](whole)
    assert manifest["files"]["model.pt"][checksum] == expected
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model.pt.*corrupted"):
        ck.load(str(path))
    ck.close()


def test_verification_follows_the_manifest_not_the_config(tmp_path):
    # A checkpoint written with crc32 (the default before xxh128) loads under today's config;
    # a manifest naming a checksum this version does not know is refused, naming it.
    old = make(checksum="crc32")
    save_one(old, str(tmp_path), sample_state())
    old.close()
    ck = make()
    assert ck.config.checksum == "xxh128"
    loaded = ck.load(str(tmp_path / "t1" / "model.pt"))
    assert_same(loaded["module"], sample_state()["module"])
    meta = tmp_path / "t1" / META_DIR / "manifest.json"
    meta.write_text(meta.read_text().replace('"checksum": "crc32"', '"checksum": "blake9"'))
    with pytest.raises(IntegrityError, match="'blake9'"):
        ck.load(str(tmp_path / "t1" / "model.pt"))
    ck.close()


def test_verify_all_ranks_always_reaches_the_exchange_and_load_then_skips_the_files(tmp_path):
    """Whatever goes wrong on a rank (a missing file here), it still takes part in the exchange
    (or the other ranks would hang in it) and raises naming the file; once a checkpoint
    verified, load() does not hash its files again, until the checkpoint is saved anew."""
    import deepspeed_async_ckpt.commit.verify as commit_module

    calls = []

    def exchange(value, error, key=""):
        calls.append(error)
        return value, {}

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), exchange=exchange)
    save_one(ck, str(tmp_path), sample_state())
    ck.wait()
    hashed = []
    real_hash_ranges = commit_module.hash_ranges
    commit_module.hash_ranges = lambda path, *args: hashed.append(path) or real_hash_ranges(path, *args)
    try:
        calls.clear()
        ck.verify_all_ranks(str(tmp_path / "t1"))
        assert calls == [None] and len(hashed) == 1
        ck.load(str(tmp_path / "t1" / "model.pt"))
        assert len(hashed) == 1  # verified above: not hashed again
        save_one(ck, str(tmp_path), sample_state())  # the same directory, saved anew
        ck.wait()
        ck.load(str(tmp_path / "t1" / "model.pt"))
        assert len(hashed) == 2
        os.rename(tmp_path / "t1" / "model.pt", tmp_path / "moved.pt")
        calls.clear()
        with pytest.raises(IntegrityError, match="refused on every rank.*model.pt.*cannot be read"):
            ck.verify_all_ranks(str(tmp_path / "t1"))
        assert len(calls) == 1 and calls[0].kind == "IntegrityError" and "model.pt" in calls[0].message
    finally:
        commit_module.hash_ranges = real_hash_ranges
    ck.close()


def test_a_rank_with_nothing_to_load_still_takes_part_in_the_check(tmp_path):
    """DeepSpeed's ``load_checkpoint`` reads ``latest`` on each rank: a rank that finds none
    still joins the collective check, with an empty key, so the exchange sees the keys differ
    and every rank raises. Skipping it would leave a rank that read ``latest`` just after
    another job's first commit waiting in the check for good."""
    keys = []

    def exchange(value, error, key=""):
        keys.append(key)
        return value, ({1: Failure(KEY_DIFFERS, f"works in {str(tmp_path / 't1')!r}, rank 0 in ''")}
                       if len(keys) > 1 else {})

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), exchange=exchange)
    ck.verify_all_ranks(None, action="load_checkpoint")  # every rank found none: nothing happens
    with pytest.raises(IntegrityError, match="load_checkpoint refused on every rank, because of rank"):
        ck.verify_all_ranks(None, action="load_checkpoint")  # another rank found one
    assert keys == ["", ""]
    ck.close()


def test_verify_all_ranks_for_a_partial_load_checks_only_its_files_and_load_checks_the_rest(tmp_path):
    """A load that reads only some files (DeepSpeed's ``load_optimizer_states=False`` under
    ZeRO) hashes only those; a file left out is still checked if it is loaded after all."""
    from deepspeed_async_ckpt.commit import verify as commit_mod

    ck, d = make(), str(tmp_path / "t1")
    ck.begin(d, tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    ck.save(sample_state(), os.path.join(d, "model_states.pt"))
    ck.save(sample_state(), os.path.join(d, "zero_pp_rank_0_optim_states.pt"))
    ck.end()
    ck.wait()
    optim = os.path.join(d, "zero_pp_rank_0_optim_states.pt")
    with open(optim, "r+b") as f:  # a flipped byte where only the optimizer's load would look
        f.seek(os.path.getsize(optim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    hashed, hash_ranges = [], commit_mod.hash_ranges
    commit_mod.hash_ranges = lambda path, *a: hashed.append(os.path.basename(path)) or hash_ranges(path, *a)
    try:
        ck.verify_all_ranks(d, include=lambda rel: not rel.endswith("optim_states.pt"))
    finally:
        commit_mod.hash_ranges = hash_ranges
    assert hashed == ["model_states.pt"]
    assert ck.load(os.path.join(d, "model_states.pt"))["global_steps"] == 5
    with pytest.raises(IntegrityError, match="zero_pp_rank_0_optim_states.pt"):
        ck.load(optim)
    with pytest.raises(IntegrityError, match="refused on every rank"):
        ck.verify_all_ranks(d)  # the full check finds it
    ck.close()


def test_a_damaged_file_three_directories_down_fails_verification(tmp_path):
    """A file saved in a subdirectory of the checkpoint is listed in its manifest; damaged, it
    must fail verification and loading, however deep it lies. Three directories down, the
    checkpoint was not found (two parents were looked at), the file taken for a stranger's and
    loaded unchecked."""
    root = str(tmp_path)
    d = os.path.join(root, "t")
    ck = make(mode="sync")
    ck.begin(d, tag="t", pointer=Pointer(os.path.join(root, "latest"), "t"))
    path = os.path.join(d, "model", "layers", "0", "weights.pt")
    ck.save(sample_state(), path)
    ck.end()
    ck.wait()
    assert "model/layers/0/weights.pt" in read_manifest(d)["files"]
    with open(path, "r+b") as f:  # flip a byte, size unchanged
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(IntegrityError):
        verify_checkpoint(d)
    with pytest.raises(IntegrityError):
        ck.load(path)
    ck.close()


def test_a_failed_verification_undoes_an_earlier_pass(tmp_path):
    """verify_all_ranks passed, a file was damaged afterwards, and a second verify_all_ranks
    refused the checkpoint: the first pass still counted, so a direct load() of the damaged
    file skipped its check and loaded it."""
    ck = make()
    save_one(ck, str(tmp_path), sample_state())
    ck.wait()
    d, path = str(tmp_path / "t1"), str(tmp_path / "t1" / "model.pt")
    ck.verify_all_ranks(d)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(IntegrityError, match="corrupted"):
        ck.verify_all_ranks(d)
    with pytest.raises(IntegrityError, match="corrupted"):
        ck.load(path)
    ck.close()
