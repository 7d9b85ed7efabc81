"""The control plane's ports are never ones the kernel hands to outgoing connections.

A port from the ephemeral range, probed free and then bound by a component a moment later, can
be taken in between as the source port of an outgoing connection: CI saw etcd and kube-apiserver
fail with "bind: address already in use" that way.
"""

from __future__ import annotations

import socket

import processes
import pytest


def test_a_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    low, _ = processes._ephemeral_range()
    ports = {processes.free_port() for _ in range(50)}
    assert all(processes.PORT_FLOOR <= port < low for port in ports)
    assert len(ports) > 1  # drawn at random, not a fixed port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def _only_the_two_ports_below_the_range(monkeypatch) -> int:
    """Narrow the draw to the two ports below the ephemeral range, none handed out yet; returns
    the range's lowest port."""
    low, _ = processes._ephemeral_range()
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the whole range, not a slice
    monkeypatch.setattr(processes, "PORT_SPAN", 2)
    monkeypatch.setattr(processes, "PORT_FLOOR", low - 2)
    monkeypatch.setattr(processes, "_handed_out", set())
    return low


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch) -> None:
    # Narrow the draw to two ports and hold one: the draw gives the other, then nothing.
    low = _only_the_two_ports_below_the_range(monkeypatch)
    with socket.socket() as held:
        held.bind(("127.0.0.1", low - 2))
        held.listen()
        assert processes.free_port() == low - 1
        with pytest.raises(RuntimeError, match="no free port"):
            processes.free_port()


def test_two_ports_asked_for_before_either_is_bound_differ(monkeypatch) -> None:
    # etcd's client and peer ports are both drawn before etcd binds either.
    low = _only_the_two_ports_below_the_range(monkeypatch)
    assert {processes.free_port(), processes.free_port()} == {low - 2, low - 1}


def test_xdist_workers_draw_from_disjoint_slices(monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(range(*processes._port_slice()))
    assert slices[0] and slices[1] and not set(slices[0]) & set(slices[1])
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setattr(processes, "_handed_out", set())
    assert all(processes.free_port() in slices[1] for _ in range(20))
