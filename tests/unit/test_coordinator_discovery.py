"""How a rank finds and joins its coordinators: names resolved to every address, one pending
HELLO per address, outputs routed back to the coordinator whose request it was."""

from __future__ import annotations

import logging
import queue
import socket
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from corefleet.engine.engine_core.io_threads import STATS_NOW, InputThread, OutputItem
from corefleet.engine.engine_core.links import OutputRouter
from corefleet.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    HandshakeMessage,
    Hello,
    Init,
    ReadyResponse,
    Refused,
    RequestType,
    SamplingParams,
    UtilityCall,
)
from corefleet.engine.request import Request
from corefleet.engine.transport.dialer import HandshakeDialer, wait_for_first_init
from corefleet.engine.transport.discovery import CoordinatorResolver, parse_coordinators
from corefleet.engine.transport.handshake import EngineStartupError, own_hello
from corefleet.engine.transport.serial import MsgpackEncoder
from corefleet.engine.transport.sockets import bound_address, make_socket

# ---- --coordinator's value ---------------------------------------------------------------


def test_several_entries_become_zmq_addresses_in_order_without_duplicates() -> None:
    spec = "a.example:5570, 10.0.0.2:5570,ipc:///tmp/c.sock,a.example:5570"
    assert parse_coordinators(spec) == (
        "tcp://a.example:5570",
        "tcp://10.0.0.2:5570",
        "ipc:///tmp/c.sock",
    )


@pytest.mark.parametrize("spec", ["", " ", "a:1,", ",a:1", "a:1,,b:2", "a", "a:x"])
def test_a_malformed_list_is_refused_naming_it(spec: str) -> None:
    with pytest.raises(ValueError, match="--coordinator"):
        parse_coordinators(spec)


def test_a_name_resolves_to_every_address_of_the_real_resolver() -> None:
    # localhost through the real getaddrinfo: every address it gives, each once, with the port
    # (IPv6 in brackets, as ZMQ wants it).
    expected = {
        f"tcp://[{info[4][0]}]:5570" if ":" in info[4][0] else f"tcp://{info[4][0]}:5570"
        for info in socket.getaddrinfo("localhost", 5570, type=socket.SOCK_STREAM)
    }
    assert set(CoordinatorResolver("localhost:5570").resolve()) == expected


def test_a_headless_name_yields_one_address_per_coordinator_and_follows_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: dict[str, list[str]] = {"coords": ["10.0.0.1", "10.0.0.2", "fd00::3"]}

    def lookup(host: str, port: int) -> list:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        # getaddrinfo's shape: (family, type, proto, canonname, sockaddr), one per address
        # and socket type; the same address may come more than once.
        return [
            (
                socket.AF_INET6 if ":" in ip else socket.AF_INET,
                socket.SOCK_STREAM,
                6,
                "",
                (ip, port),
            )
            for ip in answers[host] * 2
        ]

    resolver = CoordinatorResolver("coords:5570,10.9.9.9:5570,missing:5570", lookup)
    with caplog.at_level(logging.INFO, "corefleet.engine.transport.discovery"):
        first = resolver.resolve()
        again = resolver.resolve()  # nothing changed: nothing logged
    assert (
        first
        == again
        == [
            "tcp://10.0.0.1:5570",
            "tcp://10.0.0.2:5570",
            "tcp://[fd00::3]:5570",
            "tcp://10.9.9.9:5570",
        ]
    )
    unresolved = [r for r in caplog.records if "missing" in r.getMessage()]
    assert len(unresolved) == 1 and "Name or service not known" in unresolved[0].getMessage()
    answers["coords"] = ["10.0.0.2", "10.0.0.4"]  # a coordinator replaced by another
    assert resolver.resolve()[:2] == ["tcp://10.0.0.2:5570", "tcp://10.0.0.4:5570"]


# ---- the pending HELLOs --------------------------------------------------------------------


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _coordinator(ctx: zmq.Context) -> zmq.Socket:
    return make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)


def _answer(server: zmq.Socket, message: Init | Refused, timeout_ms: int = 30_000) -> Hello:
    assert server.poll(timeout_ms), "no HELLO arrived"
    identity, payload = server.recv_multipart()
    hello = msgspec.msgpack.decode(payload, type=HandshakeMessage)
    assert isinstance(hello, Hello)
    server.send_multipart([identity, msgspec.msgpack.encode(message)])
    return hello


def _poll_until(dialer: HandshakeDialer, count: int) -> list:
    replies: list = []
    deadline = time.monotonic() + 30
    while len(replies) < count and time.monotonic() < deadline:
        replies += dialer.poll(100)
    return replies


def test_hello_goes_to_every_coordinator_and_each_init_comes_back_with_its_socket(
    ctx: zmq.Context,
) -> None:
    servers = [_coordinator(ctx) for _ in range(3)]
    dialer = HandshakeDialer(ctx, own_hello(4, "hash", "pod-a"), None)
    try:
        dialer.dial(bound_address(s) for s in servers)
        for i, server in enumerate(servers[:2]):
            hello = _answer(server, Init(f"tcp://in-{i}", f"tcp://out-{i}", engine_index=4))
            assert (hello.rank, hello.pod_name) == (4, "pod-a")
        replies = _poll_until(dialer, 2)
        assert {r.address: r.message.input_address for r in replies} == {
            bound_address(servers[0]): "tcp://in-0",
            bound_address(servers[1]): "tcp://in-1",
        }
        assert all(r.sock is not None for r in replies)
        assert dialer.pending == [bound_address(servers[2])]  # still waiting for the third
        for reply in replies:
            reply.sock.close(linger=0)
    finally:
        dialer.close()
        for server in servers:
            server.close(linger=0)


def test_an_address_no_longer_listed_stops_being_dialled_and_close_leaves_nothing_open() -> None:
    ctx = zmq.Context()
    silent = [_coordinator(ctx) for _ in range(2)]
    addresses = [bound_address(s) for s in silent]
    dialer = HandshakeDialer(ctx, own_hello(0, "hash", None), None)
    dialer.dial(addresses)
    dialer.dial(addresses[1:])
    assert dialer.pending == addresses[1:]
    dialer.close()
    assert dialer.pending == []
    for server in silent:
        server.close(linger=0)
    ctx.term()  # would block if the dialer had left a socket (or a monitor) open


def test_the_start_waits_for_a_coordinator_that_comes_up_later(ctx: zmq.Context) -> None:
    with socket.socket() as probe:  # a port nobody listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    dialer = HandshakeDialer(ctx, own_hello(1, "hash", None), None)
    dialer.dial([address])
    assert dialer.poll(300) == []  # nobody there: the HELLO waits in ZMQ's queue
    server = make_socket(ctx, zmq.ROUTER, address, bind=True)
    try:
        _answer(server, Init("tcp://in", "tcp://out", engine_index=1))
        replies = wait_for_first_init(dialer, lambda: [address], timeout_s=30)
        assert [r.address for r in replies] == [address]
        replies[0].sock.close(linger=0)
    finally:
        dialer.close()
        server.close(linger=0)


def test_a_refusal_at_start_fails_the_rank_naming_the_coordinator_and_reason(
    ctx: zmq.Context,
) -> None:
    server = _coordinator(ctx)
    dialer = HandshakeDialer(ctx, own_hello(2, "hash", None), None)
    try:
        dialer.dial([bound_address(server)])
        _answer(server, Refused("rank 2 is held by pod 'other'"))
        with pytest.raises(EngineStartupError, match=r"rank 2 refused by .*held by pod 'other'"):
            wait_for_first_init(dialer, lambda: [bound_address(server)], timeout_s=30)
    finally:
        dialer.close()
        server.close(linger=0)


def test_no_coordinator_within_the_timeout_fails_the_start(ctx: zmq.Context) -> None:
    dialer = HandshakeDialer(ctx, own_hello(3, "hash", None), None)
    with pytest.raises(EngineStartupError, match="rank 3: no INIT from any coordinator"):
        wait_for_first_init(dialer, lambda: [], timeout_s=0.3)
    dialer.close()


# ---- whose request, whose output -------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.input_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.aborts_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.output_queue = OutputRouter()

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        return Request.from_engine_core_request(request, None, None)


def test_requests_and_calls_carry_their_link_whatever_the_sender_wrote(ctx: zmq.Context) -> None:
    sink, encode = _Sink(), MsgpackEncoder().encode
    ready = ReadyResponse(0, 256, 10, 16, 144, 320, "m")
    thread = InputThread(ctx, "tcp://127.0.0.1:1", b"\x00\x00", None, ready, sink, client_index=7)
    forged = EngineCoreRequest("a", [5, 6], SamplingParams(max_tokens=3), client_index=2)
    thread.dispatch([RequestType.ADD.value, *encode(forged)])
    thread.dispatch([RequestType.UTILITY.value, *encode(UtilityCall(3, 1, "echo", []))])
    (_, request), (_, call) = sink.input_queue.get_nowait(), sink.input_queue.get_nowait()
    assert request.client_index == 7 and call.client_index == 7


def test_outputs_go_to_their_own_link_and_markers_to_every_link() -> None:
    router = OutputRouter()
    links: dict[int, queue.SimpleQueue[OutputItem]] = {
        0: queue.SimpleQueue(),
        1: queue.SimpleQueue(),
    }
    for index, link_queue in links.items():
        router.add(index, link_queue)
    first, second = EngineCoreOutputs(engine_index=9), EngineCoreOutputs(engine_index=8)
    router.put_nowait((1, first))
    router.put_nowait((0, second))
    router.put_nowait(STATS_NOW)
    router.remove(1)
    router.put_nowait((1, EngineCoreOutputs()))  # its coordinator is gone: dropped
    router.put_nowait(None)
    got = {
        i: [link_queue.get_nowait() for _ in range(link_queue.qsize())]
        for i, link_queue in links.items()
    }
    assert got == {0: [(0, second), STATS_NOW, None], 1: [(1, first), STATS_NOW]}
