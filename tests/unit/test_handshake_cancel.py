"""``connect_handshake``'s ``should_stop``: a rank waiting for INIT can be told to give up."""

from __future__ import annotations

import pytest
import zmq

from corefleet.engine.transport.handshake import (
    HandshakeCancelled,
    connect_handshake,
    own_hello,
)
from corefleet.engine.transport.sockets import bound_address, make_socket


def test_should_stop_ends_the_wait_for_init_and_closes_the_socket() -> None:
    ctx = zmq.Context()
    server = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)
    try:
        # Stop once the HELLO has arrived: the rank is then waiting for an INIT that never comes.
        def hello_arrived() -> bool:
            return bool(server.poll(0))

        with pytest.raises(HandshakeCancelled, match="rank 0"):
            connect_handshake(
                ctx,
                bound_address(server),
                own_hello(0, "hash", None),
                None,
                timeout_s=120.0,
                should_stop=hello_arrived,
            )
    finally:
        server.close(linger=0)
        # Would block if connect_handshake had left its socket (or monitor) open.
        ctx.term()
