"""The coordinator's client over all ranks: route, stream, re-route refusals, migrate on death.

``generate(request)`` yields the request's outputs as they arrive, whichever rank serves it:

- the rank is chosen by a routing policy (``routing.py``) over the ranks' latest stats, plus one
  waiting request per request routed since those stats (vLLM's optimistic bump);
- a rank that refuses a request because it drains (finish reason ``rejected``) is excluded and
  the request goes to another rank; the caller never sees the refusal;
- when a rank dies, each request it held is re-sent to another rank with its prompt plus the
  tokens generated so far and the remaining token budget, so the caller's stream simply
  continues; after ``max_migrations`` moves it ends with finish reason ``error`` instead;
- with no rank accepting, a request waits up to ``wait_for_rank_s`` for one, then fails;
- the ranks of an MoE group take requests only while the whole group serves, and are woken
  for each wave (``waves.py``): an ADD carries the wave, START_DP_WAVE wakes the others.

Nothing here blocks: every rank interaction is a message; outputs arrive through the
FleetServer's callbacks on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import zmq

from corefleet.engine.coordinator.membership import Membership, RankMember
from corefleet.engine.coordinator.routing import NoRankAvailable, RankLoad, RoutingPolicy
from corefleet.engine.coordinator.server import FleetServer
from corefleet.engine.coordinator.waves import Wakeup, WaveTracker
from corefleet.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
)

logger = logging.getLogger(__name__)


class StampedOutput(NamedTuple):
    """An output with the rank that made it and that rank's ``time.monotonic()`` when its step
    ended (what the per-request metrics measure phases with: a rank's clock means nothing to
    another process). Rank -1 and time 0.0: the coordinator ended the request itself."""

    output: EngineCoreOutput
    rank: int
    engine_time: float


class _Outputs:
    """A request's outputs on their way to its reader: a deque and a future to wake it.
    ``asyncio.Queue`` does the same with more (a size bound, ``join``'s event, waiter lists)
    that costs a twentieth of a short request's coordinator CPU here."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[StampedOutput] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, output: StampedOutput) -> None:
        self._items.append(output)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> StampedOutput:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


@dataclass
class _InFlight:
    """One request as the coordinator tracks it across ranks."""

    request: EngineCoreRequest  # as the caller sent it
    queue: _Outputs
    rank: int = -1  # the rank serving it now; -1 while being (re-)routed
    generated: list[int] = field(default_factory=list)
    excluded: set[int] = field(default_factory=set)  # ranks that refused it or died with it
    migrations: int = 0
    finished: bool = False


@dataclass
class FleetCounters:
    """Cumulative counts for /metrics."""

    migrations: int = 0
    refusals_rerouted: int = 0
    requests_failed: int = 0


class FleetClient:
    """Routes requests over the ranks of a :class:`FleetServer` and streams their outputs."""

    def __init__(
        self,
        server_factory: type[FleetServer] = FleetServer,
        *,
        policy: RoutingPolicy,
        max_migrations: int = 2,
        wait_for_rank_s: float = 30.0,
        **server_args: Any,
    ) -> None:
        self.policy = policy
        self.max_migrations = max_migrations
        self.wait_for_rank_s = wait_for_rank_s
        self.counters = FleetCounters()
        self._requests: dict[str, _InFlight] = {}
        # rank -> requests routed there since its last stats and not finished yet (vLLM's
        # optimistic bump, made exact for short requests that end before the next stats).
        self._bumps: dict[int, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.server = server_factory(
            on_outputs=self._on_outputs,
            on_rank_dead=self._on_rank_dead,
            on_waves=self._on_waves,
            **server_args,
        )
        self.waves = WaveTracker(self.server.membership)

    @property
    def membership(self) -> Membership:
        return self.server.membership

    async def start(self) -> None:
        await self.server.start()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.server.close()

    # ---- the caller's side ---------------------------------------------------------------------

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        """Yield the request's outputs until it finishes; abort it if the caller stops early."""
        async with contextlib.aclosing(self.generate_stamped(request)) as stamped:
            async for item in stamped:
                yield item.output

    async def generate_stamped(
        self, request: EngineCoreRequest
    ) -> AsyncGenerator[StampedOutput, None]:
        """:meth:`generate`, each output with the rank that made it and when."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        state = _InFlight(request, _Outputs())
        self._requests[request.request_id] = state
        try:
            await self._dispatch(state)
            while True:
                item = await state.queue.get()
                yield item
                if item.output.finished:
                    return
        finally:
            if not state.finished:  # the caller went away (e.g. an HTTP client disconnected)
                state.finished = True
                await self._send_abort(state)
            self._requests.pop(request.request_id, None)

    def rank_of(self, request_id: str) -> int | None:
        """The rank serving a request now (None if unknown or being re-routed)."""
        state = self._requests.get(request_id)
        return state.rank if state is not None and state.rank >= 0 else None

    async def abort(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None and not state.finished:
            state.finished = True
            await self._send_abort(state)

    # ---- routing -------------------------------------------------------------------------------

    def loads(self) -> list[RankLoad]:
        loads = []
        for member in self.membership.members.values():
            stats = member.stats
            waiting = (stats.num_waiting_reqs if stats else 0) + self._bumps.get(member.rank, 0)
            running = stats.num_running_reqs if stats else 0
            accepting = self.waves.routable(member)  # an MoE group's ranks: all or none
            loads.append(RankLoad(member.rank, waiting, running, accepting))
        return loads

    async def _dispatch(self, state: _InFlight) -> None:
        """Send (or re-send) a request to the best rank, waiting a while if none accepts."""
        deadline = time.monotonic() + self.wait_for_rank_s
        request = self._continuation(state)
        while not state.finished:
            try:
                rank = self.policy.choose(
                    request.prompt_token_ids,
                    self.loads(),
                    state.excluded,
                    cache_salt=request.cache_salt,
                )
            except NoRankAvailable as exc:
                if time.monotonic() >= deadline:
                    self._fail(state, f"no engine rank can take the request: {exc}")
                    return
                if state.excluded and not self.membership.accepting():
                    state.excluded.clear()  # a rank that refused or died may be back by now
                await asyncio.sleep(0.1)
                continue
            state.rank = rank
            self._bumps[rank] = self._bumps.get(rank, 0) + 1
            wave = self.waves.wave_for(rank)  # None: the rank is not in an MoE group
            stamped = (
                request if wave is None else msgspec.structs.replace(request, current_wave=wave)
            )
            try:
                await self.server.send(rank, RequestType.ADD, stamped)
            except zmq.ZMQError as exc:  # the rank vanished between the choice and the send
                logger.info("rank %d unreachable (%s); routing elsewhere", rank, exc)
                state.excluded.add(rank)
                continue
            self._wake(self.waves.on_routed(rank))
            return

    def _continuation(self, state: _InFlight) -> EngineCoreRequest:
        """The request as the next rank must see it: prompt plus the tokens already streamed."""
        original = state.request
        if not state.generated:
            return original
        params = original.sampling_params
        done = len(state.generated)
        changes: dict[str, object] = {"min_tokens": max(0, params.min_tokens - done)}
        if params.max_tokens is not None:
            changes["max_tokens"] = params.max_tokens - done
        return msgspec.structs.replace(
            original,
            prompt_token_ids=[*original.prompt_token_ids, *state.generated],
            sampling_params=msgspec.structs.replace(params, **changes),
        )

    # ---- what the ranks say --------------------------------------------------------------------

    def _on_outputs(self, rank: int, outputs: EngineCoreOutputs) -> None:
        if outputs.engine_stats is not None:
            self._bumps[rank] = 0  # fresh figures include what we routed
        for output in outputs.outputs:
            state = self._requests.get(output.request_id)
            if state is None or state.rank != rank or state.finished:
                continue  # an old rank's late output, or a request already ended
            if output.finish_reason is FinishReason.REJECTED:
                self.counters.refusals_rerouted += 1
                state.excluded.add(rank)
                state.rank = -1
                self._spawn(self._dispatch(state))
                continue
            state.generated += output.new_token_ids
            if output.finished:
                state.finished = True
                # A request that ended since the rank's last stats no longer loads it.
                self._bumps[rank] = max(0, self._bumps.get(rank, 0) - 1)
            state.queue.put_nowait(StampedOutput(output, rank, outputs.timestamp))

    def _on_waves(self, rank: int, outputs: EngineCoreOutputs) -> None:
        if outputs.wave_complete is not None:
            self.waves.on_wave_complete(outputs.wave_complete)
        if outputs.start_wave is not None:
            self._wake(self.waves.on_start_wave(rank, outputs.start_wave))
        if outputs.engine_stats is not None:
            self._wake(self.waves.on_stats(rank, outputs.engine_stats, time.monotonic()))

    def _wake(self, wakeups: list[Wakeup]) -> None:
        """Send START_DP_WAVE messages; one that cannot go (a rank reconnecting) is repeated
        by the stats repair if it mattered."""
        for rank, message in wakeups:
            self.server.send_nowait(rank, RequestType.START_DP_WAVE, message)

    def _on_rank_dead(self, member: RankMember) -> None:
        self.waves.on_rank_dead(member.rank)
        self.policy.forget_rank(member.rank)
        self._bumps.pop(member.rank, None)
        for state in self._requests.values():
            if state.rank != member.rank or state.finished:
                continue
            state.excluded.add(member.rank)
            state.rank = -1
            if state.migrations >= self.max_migrations:
                self._fail(
                    state,
                    f"rank {member.rank} died ({member.dead_reason}) and the request had "
                    f"already moved {state.migrations} time(s) (--max-migrations)",
                )
                continue
            state.migrations += 1
            self.counters.migrations += 1
            logger.info(
                "migrating %s from dead rank %d after %d tokens",
                state.request.request_id,
                member.rank,
                len(state.generated),
            )
            self._spawn(self._dispatch(state))

    def _fail(self, state: _InFlight, message: str) -> None:
        self.counters.requests_failed += 1
        state.finished = True
        output = EngineCoreOutput(
            state.request.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=message
        )
        state.queue.put_nowait(StampedOutput(output, -1, 0.0))

    async def _send_abort(self, state: _InFlight) -> None:
        if state.rank < 0:
            return
        with contextlib.suppress(zmq.ZMQError):  # a gone rank took the request with it
            await self.server.send(state.rank, RequestType.ABORT, [state.request.request_id])

    def _spawn(self, coroutine: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
