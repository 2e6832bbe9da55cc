"""Messages between a rank and the keeper come back as the same typed values, nested ones
included; anything else is refused, not guessed at."""

import pytest

from deepspeed_async_ckpt.memory import messages as m


@pytest.mark.parametrize("message", [
    m.Hello(12, 2, None, 900.0),
    m.Reserve("global_step10", "s1", 1, (0, 1), (m.FileSpace("a.pt", 10), m.FileSpace("b.pt", 0))),
    m.Report("global_step10", "s1", 1, "xxh128", (m.FileDigest("a.pt", 9, "ab"),)),
    m.Commit("global_step10"), m.Commit("global_step10", "s1"),
    m.Commit("global_step10", "s1", {"save_id": "s1", "files": {"a.pt": {"nbytes": 9}}}), m.Abandon("x", "s"),
    m.Newest(), m.Status(), m.Shutdown(), m.Done(), m.NoSlot(),
    m.Reserved((m.FilePlace("a.pt", "dsack.0.x.1.0", 10),)),
    m.SlotView("g", "s", "xxh128", (m.RankFiles(0, (m.StoredFile("a.pt", "dsack.0.x.1.0", 3, "cd"),)),)),
    m.Newest(lend=True),
    m.SlotView("g", "s", "xxh128", (), {"save_id": "s"}),
    m.KeeperState(5, 100, None, 2, 1, (m.SlotState("g", "s", "open", (1,)),)),
    m.Busy("why"), m.Refused("why"), m.Welcome(3, "/tmp/log"),
])
def test_every_message_round_trips_as_its_own_type(message):
    line = m.encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert m.decode(line) == message


@pytest.mark.parametrize("line", [b'{"type": "Launch"}', b'[1]', b'{"type": "Commit", "name": "g", "colour": 1}',
                                  b'not json', b'{"type": "Commit"}',
                                  b'{"type": "Reserve", "name": "g", "save_id": "s", "rank": 0, "node_ranks": [0], '
                                  b'"files": [1]}'])
def test_unknown_messages_are_refused(line):
    with pytest.raises(ValueError):
        m.decode(line)
