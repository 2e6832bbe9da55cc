"""The ``verify`` and ``list`` commands (``deepspeed_async_ckpt.tools``): reports, exit codes
and messages for damaged, unreadable and partial checkpoints."""

import json
import os
import shutil

import pytest
import torch

from deepspeed_async_ckpt.commit import META_DIR, read_manifest, verify_checkpoint
from deepspeed_async_ckpt.errors import IntegrityError

from helpers import cli_main, deny_access, make, sample_state, save_one


def test_verify_cli_follows_pointer_and_reports_corruption(tmp_path, capsys):
    from deepspeed_async_ckpt.tools.cli import main

    ck = make()
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    assert main(["verify", str(tmp_path)]) == 0
    assert "OK:" in capsys.readouterr().out
    path = tmp_path / "t1" / "model.pt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "t1")]) == 1
    assert "model.pt" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "nope")]) == 2
    # another engine's checkpoint (DeepSpeed's own, megatron-core's): nothing to verify against,
    # said as such (it was "CORRUPT: ... never committed ... it is partial", exit 1)
    other = tmp_path / "torch_engine" / "global_step1"
    other.mkdir(parents=True)
    torch.save({"x": 1}, other / "mp_rank_00_model_states.pt")
    (tmp_path / "torch_engine" / "latest").write_text("global_step1")
    assert main(["verify", str(tmp_path / "torch_engine")]) == 2
    err = capsys.readouterr().err
    assert "was not written by this engine (no .async_ckpt/)" in err and "CORRUPT" not in err, err
    # this engine's save cut short: partial, exit 1
    (tmp_path / "cut" / META_DIR).mkdir(parents=True)
    assert main(["verify", str(tmp_path / "cut")]) == 1
    assert "never committed" in capsys.readouterr().err


def test_verify_cli_names_files_it_did_not_check_and_a_save_dir_without_its_pointer(tmp_path, capsys):
    """`verify` said OK about a checkpoint holding files no manifest lists (a stray copy,
    unchecked), "OK ... none verified" when only sizes were, and "not written by this engine"
    about a save directory whose `latest` was deleted, though `list` showed its checkpoints."""
    from deepspeed_async_ckpt.tools.cli import main

    ck = make(checksum="none")
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    shutil.copy(tmp_path / "t1" / "model.pt", tmp_path / "t1" / "stray.pt")
    (tmp_path / "t1" / "sub").mkdir()
    (tmp_path / "t1" / "sub" / "notes.txt").write_text("the user's")
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sizes verified (checksum none: no checksums recorded)" in out, out
    assert "2 file(s) there not in the manifest, not verified" in out and "stray.pt, sub/notes.txt" in out, out
    (tmp_path / "latest").unlink()
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a save directory without a pointer" in err and "t1" in err, err


def _edit_json(text: str, *, segments=None, **fields) -> str:
    """A manifest's text with top-level ``fields`` set and, given, model.pt's ``segments``."""
    manifest = dict(json.loads(text), **fields)
    if segments is not None:
        manifest["files"]["model.pt"]["segments"] = segments
    return json.dumps(manifest)


@pytest.mark.parametrize("damage,problem", [
    (lambda text: text[:len(text) // 2], "Unterminated|Expecting"),  # a truncated copy
    (lambda text: "[]", "a list, not an object"),
    (lambda text: text.replace('"files"', '"filez"'), "'files' missing"),
    (lambda text: text.replace('"bytes"', '"size"'), "file 'model.pt' has no size"),
    (lambda text: text.replace('"model.pt"', '"../../x"'), "outside the checkpoint"),
    (lambda text: "\udcff", "codec can.t decode"),  # not UTF-8
    (lambda text: _edit_json(text, committed_at=float("nan")), "'committed_at' nan is not a time"),
    (lambda text: _edit_json(text, committed_at=1e300), "'committed_at' 1e.300 is not a time"),
    (lambda text: _edit_json(text, segments=[[0, 3]]), "file 'model.pt' has malformed segments"),
    (lambda text: _edit_json(text, segments="zz"), "file 'model.pt' has malformed segments"),
    (None, "Is a directory"),
])
def test_a_damaged_manifest_is_an_integrity_error_naming_it(tmp_path, capsys, damage, problem):
    """A damaged manifest (truncated, not an object, fields missing or malformed, a commit
    time that is no time, a file's malformed segments, a directory) is an IntegrityError
    naming it from a load, ``verify`` and ``list``: never a bare JSONDecodeError, KeyError or
    TypeError, nor a traceback."""
    from deepspeed_async_ckpt.tools.cli import main

    ck = make()
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    manifest = tmp_path / "t1" / META_DIR / "manifest.json"
    if damage is None:
        manifest.unlink()
        manifest.mkdir()
    else:
        manifest.write_text(damage(manifest.read_text()), errors="surrogateescape")
    with pytest.raises(IntegrityError, match=f"t1'.*manifest {manifest} is damaged: .*({problem})"):
        read_manifest(str(tmp_path / "t1"))
    loader = make()
    with pytest.raises(IntegrityError, match="is damaged"):
        loader.verify_all_ranks(str(tmp_path / "t1"))
    with pytest.raises(IntegrityError, match="is damaged"):
        loader.load(str(tmp_path / "t1" / "model.pt"))
    loader.close()
    assert main(["verify", str(tmp_path)]) == 1
    assert "CORRUPT:" in capsys.readouterr().err
    assert main(["list", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == "t1" and rows[0]["state"] == "damaged", rows


def test_an_unreadable_pointer_is_a_cli_error(tmp_path, capsys):
    from deepspeed_async_ckpt.tools.cli import main

    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe")
    for command in ("verify", "list"):
        assert main([command, str(tmp_path)]) == 2
        assert "cannot read the pointer" in capsys.readouterr().err


@pytest.mark.parametrize("pointer", ["latest", "latest_checkpointed_iteration.txt"])
def test_an_empty_pointer_is_named_as_empty(tmp_path, capsys, pointer):
    """It named the save directory itself, reported as "not written by this engine"."""
    from deepspeed_async_ckpt.tools.cli import main

    (tmp_path / pointer).write_text(" \n")
    for command in ("verify", "list"):
        assert main([command, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"the pointer {str(tmp_path / pointer)!r} is empty" in err, err


def test_list_cli_shows_committed_newest_first_partial_and_other(tmp_path, capsys):
    import json

    from deepspeed_async_ckpt.tools.cli import main

    ck = make()
    for tag in ("s1", "s2"):
        save_one(ck, str(tmp_path), sample_state(), tag=tag)
        ck.wait()
    ck.close()
    (tmp_path / "crashed" / META_DIR).mkdir(parents=True)
    (tmp_path / "crashed" / META_DIR / "rank_00001.x.json").write_text("{}")
    (tmp_path / "crashed" / META_DIR / "rank_00002.x.failed").write_text("disk full")
    (tmp_path / "crashed" / META_DIR / "rank_00003.x.json.tmp.4d2").write_text("{")  # counted no more
    (tmp_path / "torch_engine").mkdir()
    assert main(["list", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["state"], r["pointer"]) for r in rows] == [
        ("s2", "committed", True), ("s1", "committed", False), ("crashed", "partial", False),
        ("torch_engine", "other", False)]
    manifest = read_manifest(str(tmp_path / "s2"))
    assert rows[0]["bytes"] == sum(e["bytes"] for e in manifest["files"].values()) > 0
    assert rows[0]["files"] == 1 and rows[0]["world_size"] == 1 and rows[2]["rank_records"] == 1
    assert main(["list", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["checkpoint", "state", "committed", "(UTC)", "files", "bytes", "ranks"]
    assert lines[1].startswith("s2 ") and lines[1].endswith("<- pointer")
    assert "1 rank record(s), 1 rank(s) failed" in lines[3]
    assert main(["list", str(tmp_path / "nope")]) == 2


def test_verify_a_path_under_a_file_is_a_cli_error(tmp_path, capsys):
    """`verify ckpt/latest/x` (a file in the middle of the path) raised NotADirectoryError."""
    (tmp_path / "latest").write_text("global_step1")
    assert cli_main(["verify", str(tmp_path / "latest" / "global_step1")]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err


def test_verify_with_an_unreadable_manifest_exits_with_a_message(tmp_path, capsys, monkeypatch):
    """A manifest the user may not read (another user's checkpoint) gave a PermissionError
    traceback from `verify` (exit 1 from Python, as for a corrupt checkpoint)."""
    import deepspeed_async_ckpt.commit.manifest as commit

    ck = make()
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    deny_access(monkeypatch, commit, "open", lambda path: path.endswith("manifest.json"))
    assert cli_main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read checkpoint") and "Permission denied" in err, err


def test_verify_with_a_data_file_the_user_may_not_read_is_not_called_corrupt(tmp_path, capsys, monkeypatch):
    """An intact checkpoint with a file another user owns (mode 0600) was reported "CORRUPT",
    exit 1, which a cleanup script takes for damage; as with an
    unreadable manifest, it is an error about reading it, exit 2. A missing file stays CORRUPT."""
    from deepspeed_async_ckpt.persist import checksum

    ck = make()
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    with monkeypatch.context() as m:
        deny_access(m, checksum, "open", lambda path: path.endswith("model.pt"))
        assert cli_main(["verify", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot read checkpoint") and "Permission denied" in err, err
        assert "CORRUPT" not in err, err
    os.remove(tmp_path / "t1" / "model.pt")
    assert cli_main(["verify", str(tmp_path)]) == 1
    assert "CORRUPT" in capsys.readouterr().err


def test_verify_of_a_checkpoint_the_user_may_not_enter_says_so(tmp_path, capsys, monkeypatch):
    """A checkpoint directory the user may not enter (another user's, mode 0700) was reported
    as "not written by this engine": looking for its .async_ckpt/ failed, and any failure
    counted as absence."""
    ck = make()
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    deny_access(monkeypatch, os, "stat", lambda path: path.startswith(str(tmp_path / "t1") + os.sep))
    assert cli_main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read checkpoint") and "Permission denied" in err, err
    assert "not written by this engine" not in err, err
    assert cli_main(["list", "--json", str(tmp_path)]) == 0  # listed as unreadable, not "other"
    (row,) = json.loads(capsys.readouterr().out)
    assert row["state"] == "damaged" and "Permission denied" in row["problem"], row


def test_list_with_an_unreadable_directory_exits_with_a_message(tmp_path, capsys, monkeypatch):
    """`list` on a save directory, or a partial checkpoint's .async_ckpt/, that the user may
    not list raised PermissionError out of main()."""
    ck = make()
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    (tmp_path / "t2" / META_DIR).mkdir(parents=True)  # partial
    deny_access(monkeypatch, os, "listdir", lambda path: path == str(tmp_path / "t2" / META_DIR))
    assert cli_main(["list", "--json", str(tmp_path)]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["t1"]["state"] == "committed" and rows["t2"]["state"] == "damaged", rows
    deny_access(monkeypatch, os, "listdir", lambda path: path == str(tmp_path))
    assert cli_main(["list", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot list the save directory") and "Permission denied" in err, err


@pytest.mark.parametrize("damage,problem", [
    (lambda m: m["files"]["model.pt"].pop("xxh128"), "has no xxh128 checksum"),
    (lambda m: m.update(format="deepspeed_async_ckpt/2"), "newer than this version"),
    (lambda m: m.update(format="someone_else/1"), "is not this engine's"),
    (lambda m: m.update(checksum="blake9"), "unknown to this version"),
])
def test_a_manifest_this_version_cannot_check_is_named_not_the_intact_file(tmp_path, capsys, damage, problem):
    """A file entry without a checksum made the intact file "CORRUPT ... does not match
    manifest None" while `list` said committed; a manifest of a newer format (or another
    algorithm) would have done the same. The manifest is
    named as what cannot be read, everywhere."""
    ck = make("sync")
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    path = tmp_path / "t1" / META_DIR / "manifest.json"
    manifest = json.loads(path.read_text())
    damage(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match=f"its manifest .* {problem}"):
        verify_checkpoint(str(tmp_path / "t1"))
    assert cli_main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "manifest" in err and problem in err and "model.pt" not in err.split("manifest")[0], err
    assert cli_main(["list", "--json", str(tmp_path)]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["state"] == "damaged" and problem in row["problem"], row


def _node_copy(root, files: dict[str, bytes], elsewhere: dict[str, bytes]):
    """Node 1's copy of a node-local checkpoint (its ``files`` there, ``elsewhere`` only on
    node 0, ``model.pt`` on both), with the manifest listing both nodes."""
    import xxhash

    def entry(data):
        return {"bytes": len(data), "xxh128": xxhash.xxh3_128_hexdigest(data)}

    d = root / "t"
    (d / META_DIR).mkdir(parents=True)
    for rel, data in files.items():
        (d / rel).write_bytes(data)
    manifest = {"format": "deepspeed_async_ckpt/1", "tag": "t", "save_id": "s", "world_size": 4,
                "checksum": "xxh128", "committed_at": 1.0,
                "files": {rel: entry(data) for rel, data in {**elsewhere, **files}.items()},
                "nodes": {"0": sorted(["model.pt", *elsewhere]), "1": sorted(files)}}
    (d / META_DIR / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_verify_of_a_node_local_copy_checks_the_files_its_node_holds(tmp_path, capsys):
    """Run on node 1's disk, verify checks node 1's files (found by which node's files are
    there, or named with --node), not node 0's, which are not there to check."""
    d = _node_copy(tmp_path, {"model.pt": b"m", "zero_2.pt": b"z2", "zero_3.pt": b"z3"},
                   {"zero_0.pt": b"z0", "zero_1.pt": b"z1"})
    assert cli_main(["verify", str(d)]) == 0
    assert "node 1's copy: 3 of the 5 files, 5 bytes" in capsys.readouterr().out
    assert cli_main(["verify", "--node", "0", str(d)]) == 1
    err = capsys.readouterr().err
    assert "CORRUPT" in err and "zero_0.pt: listed in the manifest" in err, err
    assert cli_main(["verify", "--node", "7", str(d)]) == 2
    assert "--node 7: the manifest of" in capsys.readouterr().err
    os.remove(d / "zero_2.pt")  # node 1's copy damaged: still node 1's (2 of its 3 files there)
    assert cli_main(["verify", str(d)]) == 1
    assert "zero_2.pt: listed in the manifest" in capsys.readouterr().err
