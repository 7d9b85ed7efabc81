"""An MoE group's data-parallel waves, as one rank keeps them: pure state, no sockets, no torch.

The ranks of an MoE group (``dp_proc.py``) run collectives inside every forward pass (the
expert-parallel layers), so while any of them has work, all of them must step, the idle ones
with dummy batches. A *wave* is such a stretch of steps, numbered. As vLLM's
``DPEngineCoreProc``:

- an idle rank runs nothing and blocks on its input; an ADD, a START_DP_WAVE, or its own drain
  makes it *run*;
- a running rank steps (a real batch, else a dummy one) and, every :data:`SYNC_INTERVAL` steps,
  joins the group's all-reduce of :class:`GroupSync`; when no rank has unfinished requests the
  wave ends on every rank at that same all-reduce: the wave number goes up by one and the
  ranks are idle again. The ranks therefore count the same steps in every wave.

What differs from vLLM, because ranks dial any number of coordinators that come and go
(``docs/architecture.md``, data-parallel waves):

- **The ranks are the truth.** The all-reduce is a MAX that also carries the wave number, so
  the ranks agree on it at every sync whatever a coordinator stamped on a request; a
  coordinator's wave is a hint.
- **A rank that starts on its own always says so.** An ADD that finds a rank idle makes it
  ask every coordinator to start the wave for the others (vLLM asks only when the request's
  wave is older than the rank's); the coordinators relay it, so a coordinator that wrongly
  believed the group running cannot leave the rank alone in the all-reduce.
- **Starts are idempotent.** Several coordinators may send the same START; a rank running
  the wave, or past it, ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass

from corefleet.engine.messages import MAX_WAVE, StartDPWave

# Steps between two all-reduces of a wave (vLLM's 32): the wave can end only on such a step.
SYNC_INTERVAL = 32


@dataclass(frozen=True)
class GroupSync:
    """What the group's all-reduce (MAX over the ranks) says at a sync."""

    unfinished: bool  # some rank holds unfinished requests: the wave goes on
    draining: bool  # some rank drains: every rank stops taking requests, and they leave together
    wave: int  # the highest wave number a rank holds

    def flags(self) -> list[int]:
        """This rank's contribution, as the all-reduce carries it."""
        return [int(self.unfinished), int(self.draining), self.wave]

    @classmethod
    def from_flags(cls, values: list[int]) -> GroupSync:
        """The all-reduce's result."""
        unfinished, draining, wave = values
        return cls(bool(unfinished), bool(draining), int(wave))


@dataclass
class WaveState:
    """One rank's wave: its number, whether it runs, and its steps in it."""

    rank: int
    current_wave: int = 0
    running: bool = False
    steps: int = 0  # forward passes (real or dummy) in the current wave

    def on_request(self, request_wave: int) -> int | None:
        """An ADD arrived, sent in ``request_wave`` (refused or not: its sender may have woken
        the others for it). Returns the wave the coordinators must start for the other ranks,
        or None when this rank was running already."""
        if 0 <= request_wave <= MAX_WAVE and request_wave > self.current_wave:
            self.current_wave = request_wave  # a coordinator saw a later wave: catch up
        return self.start()

    def start(self) -> int | None:
        """Run the current wave on this rank's own account (a request, a drain). Returns the
        wave to announce, or None when it was running already."""
        if self.running:
            return None
        self.running = True
        return self.current_wave

    def on_start(self, wave: StartDPWave) -> bool:
        """A START_DP_WAVE: run ``wave.new_wave`` unless this rank is its excluded starter or
        that wave is over here. Returns whether this rank started running now."""
        if wave.exclude_rank == self.rank or wave.new_wave < self.current_wave:
            return False  # the starter itself, or a late START of a wave that ended
        self.current_wave = wave.new_wave
        started = not self.running
        self.running = True
        return started

    def count_step(self) -> bool:
        """One forward pass of the wave; True when the group's sync is due after it."""
        self.steps += 1
        return self.steps % SYNC_INTERVAL == 0

    def on_sync(self, sync: GroupSync) -> int | None:
        """Apply the all-reduce's answer; returns the wave that ended, or None while it goes
        on. Every rank gets the same answer, so they all end it at once."""
        self.current_wave = max(self.current_wave, sync.wave)
        if sync.unfinished:
            return None
        ended = self.current_wave
        self.current_wave += 1
        self.running = False
        self.steps = 0
        return ended
