"""Shares: a file that several ranks hold alike (DeepSpeed's model states, on every
data-parallel replica), written by all of them at once, each a :class:`Share` of its records.

:func:`split_items` cuts a plan's records into runs of about equal bytes;
:func:`~.writer.write_file` writes one share of them, and the commit renames the file once
every share is durable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Share:
    """One rank's part of a file that ``len(cuts) + 1`` ranks write together, each planning
    the same archive: share ``index`` holds the records from ``cuts[index - 1]`` (0 for the
    first) up to ``cuts[index]`` (the end for the last), as item indices of the plan. In bytes,
    a share runs from the start of its first record's data (0 for the first share, which thus
    also writes the headers and the pickle) to the start of the next share's (the end of the
    file for the last, which writes the zip directory): every boundary is on a page, so each
    rank writes whole pages of its own, directly."""

    index: int
    cuts: tuple[int, ...]
    tmp: str

    def items(self, n_items: int) -> range:
        """Indices of the plan's items (of ``n_items``) that this share writes."""
        bounds = (0, *self.cuts, n_items)
        return range(bounds[self.index], bounds[self.index + 1])


def split_items(sizes: Sequence[int], shares: int) -> tuple[int, ...]:
    """Cuts (see :class:`Share`) for at most ``shares`` contiguous runs of items of about equal
    bytes: an item starts a new share when its middle lies past the next ``1/shares`` of the
    total. Items of 0 bytes never start one (their data has no offset of its own). Fewer runs
    come back when there are too few items to go round."""
    total = sum(sizes)
    cuts: list[int] = []
    before = 0
    for j, n in enumerate(sizes):
        if j and n and len(cuts) < shares - 1 and before + n / 2 > total * (len(cuts) + 1) / shares:
            cuts.append(j)
        before += n
    return tuple(cuts)
