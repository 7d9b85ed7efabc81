"""The engine's socket threads, driven directly: what gets queued, dropped, merged and sent."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import pytest
import zmq

from corefleet.engine.engine_core.io_threads import InputThread, OutputItem, OutputThread
from corefleet.engine.engine_core.links import EVERY_COORDINATOR, OutputRouter
from corefleet.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    ReadyResponse,
    RequestType,
    SamplingParams,
    StartDPWave,
    UtilityCall,
    UtilityOutput,
)
from corefleet.engine.request import Request
from corefleet.engine.transport.serial import MsgpackDecoder, MsgpackEncoder
from corefleet.engine.transport.sockets import bound_address, make_socket


class Sink:
    """The queues of an engine, and a preprocess step that refuses prompts with token 0."""

    def __init__(self) -> None:
        self.input_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.aborts_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.output_queue: queue.SimpleQueue = queue.SimpleQueue()

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        if 0 in request.prompt_token_ids:
            raise ValueError("token 0 is not allowed here")
        return Request.from_engine_core_request(request, None, None)


def _drain(q: queue.SimpleQueue) -> list:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _input_thread(ctx: zmq.Context, sink: Sink, client_index: int = 0) -> InputThread:
    ready = ReadyResponse(0, 256, 10, 16, 144, 320, "m")
    return InputThread(ctx, "tcp://127.0.0.1:1", b"\x00\x00", None, ready, sink, client_index)


def test_input_thread_routes_each_request_type(ctx: zmq.Context) -> None:
    sink, encode = Sink(), MsgpackEncoder().encode
    thread = _input_thread(ctx, sink)
    add = EngineCoreRequest("a", [5, 6], SamplingParams(max_tokens=3))
    thread.dispatch([RequestType.ADD.value, *encode(add)])
    thread.dispatch([RequestType.ABORT.value, *encode(["x", "y"])])
    thread.dispatch([RequestType.UTILITY.value, *encode(UtilityCall(0, 7, "echo", [1]))])
    thread.dispatch([RequestType.START_DP_WAVE.value, *encode(StartDPWave(4, exclude_rank=1))])
    items = _drain(sink.input_queue)
    kinds = [kind for kind, _ in items]
    assert kinds == [
        RequestType.ADD,
        RequestType.ABORT,
        RequestType.UTILITY,
        RequestType.START_DP_WAVE,
    ]
    assert items[-1][1] == StartDPWave(4, exclude_rank=1)
    assert _drain(sink.aborts_queue) == [["x", "y"]]  # aborts also jump the queue
    assert thread.drops.total == 0


def test_input_thread_drops_malformed_frames_and_internal_types(ctx: zmq.Context) -> None:
    sink, encode = Sink(), MsgpackEncoder().encode
    thread = _input_thread(ctx, sink)
    frames = [
        [b"\x00"],  # no payload
        [b"\x07", b"\x90"],  # unknown type byte
        # Bytes once used for the engine's own queue markers: no client frame can be one.
        [b"\x04", b""],
        [b"\x05", b"\xc0"],
        [RequestType.ADD.value, b"\xff\xfe"],  # garbage msgpack
        [RequestType.ADD.value, *encode(["not", "a", "request"])],  # wrong fields
        [RequestType.ABORT.value, *encode({"a": 1})],
        # START_DP_WAVE: no wave, a wave that is no number, out of range (it travels in int64
        # tensors), an exclusion past the last rank, garbage.
        [RequestType.START_DP_WAVE.value, *encode([])],
        [RequestType.START_DP_WAVE.value, *encode(["3"])],
        [RequestType.START_DP_WAVE.value, *encode([-1])],
        [RequestType.START_DP_WAVE.value, *encode([2**64 - 1])],
        [RequestType.START_DP_WAVE.value, *encode([1, 1 << 16])],
        [RequestType.START_DP_WAVE.value, b"\xc1"],
    ]
    for message in frames:
        thread.dispatch(message)
    assert thread.drops.total == len(frames)
    assert sink.input_queue.empty() and sink.output_queue.empty()


def test_input_thread_fails_a_bad_add_alone(ctx: zmq.Context) -> None:
    sink, encode = Sink(), MsgpackEncoder().encode
    thread = _input_thread(ctx, sink, client_index=3)  # the error goes back on link 3
    bad = EngineCoreRequest("bad", [0, 5], SamplingParams())
    thread.dispatch([RequestType.ADD.value, *encode(bad)])
    ((client_index, outputs),) = _drain(sink.output_queue)
    assert client_index == 3
    (output,) = outputs.outputs
    assert output.request_id == "bad" and output.finish_reason is FinishReason.ERROR
    assert "token 0" in str(output.stop_reason)
    assert sink.input_queue.empty()


def test_output_thread_merges_a_backlog_in_order_and_stops(ctx: zmq.Context) -> None:
    pull = make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
    output_queue: queue.SimpleQueue[OutputItem] = queue.SimpleQueue()

    def step(i: int) -> OutputItem:
        return (0, EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}", [i])]))

    # Queued before the thread starts: a backlog of steps, a utility reply, more steps, stop.
    for i in range(5):
        output_queue.put(step(i))
    output_queue.put((0, EngineCoreOutputs(utility_output=UtilityOutput(9, result="done"))))
    for i in range(5, 8):
        output_queue.put(step(i))
    output_queue.put(None)
    thread = OutputThread(
        ctx, bound_address(pull), None, output_queue, lambda: EngineStats(rank=4), 2
    )
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive()

    decoder = MsgpackDecoder(EngineCoreOutputs)
    messages = []
    while pull.poll(1000):
        messages.append(decoder.decode(pull.recv_multipart(copy=False)))
    pull.close(linger=0)
    assert all(m.engine_index == 2 for m in messages)
    assert messages[0].engine_stats is not None and messages[0].engine_stats.rank == 4
    order = [o.request_id for m in messages for o in m.outputs]
    assert order == [f"r{i}" for i in range(8)]
    utility_at = next(i for i, m in enumerate(messages) if m.utility_output is not None)
    before = [o.request_id for m in messages[:utility_at] for o in m.outputs]
    assert before == [f"r{i}" for i in range(5)]
    assert len(messages) == 3  # steps 0-4 merged, the reply, steps 5-7 merged


def test_a_notice_for_every_coordinator_reaches_each_link_as_its_own_copy() -> None:
    router = OutputRouter()
    queues: list[queue.SimpleQueue[OutputItem]] = [queue.SimpleQueue() for _ in range(2)]
    for index, link_queue in enumerate(queues):
        router.add(index, link_queue)
    notice = EngineCoreOutputs(wave_complete=3)
    router.put_nowait((EVERY_COORDINATOR, notice))
    (first,), (second,) = (_drain(q) for q in queues)
    assert (first[0], second[0]) == (0, 1)
    assert first[1].wave_complete == second[1].wave_complete == 3
    # Each output thread stamps its own stats and merges its own outputs into its copy.
    assert first[1] is not second[1] and first[1].outputs is not second[1].outputs


def test_output_thread_never_merges_a_wave_notice_away(ctx: zmq.Context) -> None:
    pull = make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
    output_queue: queue.SimpleQueue[OutputItem] = queue.SimpleQueue()
    output_queue.put((0, EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1])])))
    output_queue.put((0, EngineCoreOutputs(start_wave=2)))
    output_queue.put((0, EngineCoreOutputs(outputs=[EngineCoreOutput("r", [2])])))
    output_queue.put((0, EngineCoreOutputs(wave_complete=2)))
    output_queue.put(None)
    thread = OutputThread(ctx, bound_address(pull), None, output_queue, EngineStats, 0)
    thread.start()
    thread.join(timeout=5)
    decoder = MsgpackDecoder(EngineCoreOutputs)
    messages = []
    while pull.poll(1000):
        messages.append(decoder.decode(pull.recv_multipart(copy=False)))
    pull.close(linger=0)
    assert [m.start_wave for m in messages if m.start_wave is not None] == [2]
    assert [m.wave_complete for m in messages if m.wave_complete is not None] == [2]
    assert [t for m in messages for o in m.outputs for t in o.new_token_ids] == [1, 2]
