"""Stage 3 of 3, commit: per-rank records -> manifest -> pointer, then retention; and the
load-time verification of what was committed.

Layout inside a checkpoint directory (``<save_dir>/<tag>`` for DeepSpeed, ``iter_NNNNNNN`` for
Megatron)::

    .async_ckpt/rank_00003.<save_id>.json   each rank, once all its files are durable
    .async_ckpt/manifest.json               rank 0, once every rank's record exists: the commit

Only after ``manifest.json`` is durable does rank 0 replace the pointer, so a crash at any
moment leaves the pointer on the previous, complete checkpoint. The modules, in the order a
save meets them:

- :mod:`.layout`: on-disk names and the rules a checkpoint's name must meet
- :mod:`.claims`: one process saves into a save directory at a time (rank 0)
- :mod:`.records`: each rank's record of its durable files, or of its failure (every rank),
  and :class:`RecordExchange`, how the records reach rank 0
- :mod:`.nodes`, :mod:`.exchange`: node-local storage: which node a rank is on, and the
  records through the process group's store instead of the directory (every rank)
- :mod:`.protocol`: the commit itself (rank 0; with node-local storage, each node's leader too)
- :mod:`.finalize`: a framework's finalize steps, run by the commit (rank 0)
- :mod:`.manifest`: reading and checking a manifest; late files (any rank)
- :mod:`.replace`: re-saving a checkpoint in place, and recovering from a crash (rank 0)
- :mod:`.policy`, :mod:`.retire`: which old checkpoints to remove, and removing them (rank 0)
- :mod:`.verify`: checking files against the manifest before a load (every rank)
"""

from __future__ import annotations

from .atomic import write_text_atomic
from .claims import claim_save_dir, forget_claims_in_child, release_save_dir
from .finalize import FinalizeContext, FinalizeStep
from .layout import (LATE_FILES, LOCK_FILE, MANIFEST, MAX_NAME_BYTES, META_DIR, REMOVING_PREFIX,
                     STAGING_PREFIX, Pointer, check_checkpoint_dir, check_name, find_checkpoint_dir,
                     make_checkpoint_dir, staging_dir)
from .manifest import is_finalized, read_manifest, record_late_files
from .policy import CheckpointInfo, KeepAny, KeepEvery, KeepIf, KeepLast, RetentionPolicy
from .sequence import commit, commit_on_node, poll_delay
from .records import RecordExchange, write_rank_failure, write_rank_record
from .replace import finish_replacements, remove_stale_temporaries, remove_trash, replace_checkpoint
from .retire import (abandoned_checkpoints, committed_checkpoints, linked_checkpoints,
                     retire_checkpoints, scan_checkpoints)
from .verify import verify_checkpoint, verify_file

__all__ = [
    "CheckpointInfo", "FinalizeContext", "FinalizeStep", "KeepAny", "KeepEvery", "KeepIf",
    "KeepLast", "LATE_FILES", "LOCK_FILE",
    "MANIFEST", "MAX_NAME_BYTES", "META_DIR", "Pointer", "REMOVING_PREFIX", "RecordExchange",
    "RetentionPolicy",
    "STAGING_PREFIX", "abandoned_checkpoints", "check_checkpoint_dir",
    "check_name", "claim_save_dir", "commit", "commit_on_node", "committed_checkpoints", "find_checkpoint_dir",
    "finish_replacements", "forget_claims_in_child", "is_finalized", "linked_checkpoints",
    "make_checkpoint_dir", "poll_delay", "read_manifest", "record_late_files", "release_save_dir",
    "remove_stale_temporaries", "remove_trash", "replace_checkpoint", "retire_checkpoints",
    "scan_checkpoints", "staging_dir", "verify_checkpoint", "verify_file", "write_rank_failure",
    "write_rank_record", "write_text_atomic",
]
