"""InputBatch: the flattened inputs of decode steps stay right as requests come and go."""

from __future__ import annotations

import numpy as np

from corefleet.engine.messages import SamplingParams
from corefleet.engine.worker.input_batch import InputBatch

PARAMS = SamplingParams(max_tokens=8)


def _add(batch: InputBatch, req_id: str, tokens: list[int], first_block: int) -> None:
    batch.add(req_id, tokens, len(tokens), [first_block], len(tokens) - 1, PARAMS, None)


def test_decode_steps_follow_removed_and_readded_requests() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=16)
    _add(batch, "a", [11, 12, 13], first_block=1)
    _add(batch, "b", [21, 22], first_block=2)
    step = batch.prepare({"a": 1, "b": 1})
    assert step.input_ids.tolist() == [13, 22]
    assert step.slot_mapping.tolist() == [1 * 16 + 2, 2 * 16 + 1]
    batch.append_tokens(step.rows, np.array([14, 23]))

    step = batch.prepare({"a": 1, "b": 1})  # the same batch again: rows reused
    assert step.input_ids.tolist() == [14, 23] and step.positions.tolist() == [3, 2]
    batch.append_tokens(step.rows, np.array([15, 24]))

    # "a" leaves and comes back (as after a preemption) in a different row, with "c" in its old one.
    batch.remove("a")
    _add(batch, "c", [31, 32], first_block=3)
    _add(batch, "a", [11, 12, 13, 14, 15], first_block=4)
    step = batch.prepare({"a": 1, "b": 1, "c": 1})
    assert step.input_ids.tolist() == [15, 24, 32]
    assert step.slot_mapping.tolist() == [4 * 16 + 4, 2 * 16 + 3, 3 * 16 + 1]
    assert len(set(step.rows.tolist())) == 3
