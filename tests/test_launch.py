"""``scripts/launch.py``'s choice of rank 0's store port."""

from __future__ import annotations

import itertools
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import launch  # noqa: E402


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
