"""The fused-MoE Triton kernels against the torch reference, on CPU under the interpreter.

Small layers on purpose (the interpreter runs every program in numpy, one after another), with
the routings of ``tests/moe_cases.py``; an expert with more rows than one 16-row block; and
the sm_90 compile of both kernels (``compile_fused_moe.py``, in a child process: the kernels
in this one are interpreted).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from corefleet.kernels import reference
from corefleet.kernels.triton_ops import fused_moe as triton_moe
from corefleet.kernels.triton_ops.backend import TritonBackend
from tests.kernel_cases import require_interpreted_kernels
from tests.moe_cases import ROUTINGS, assert_close, moe_case
from tests.unit.triton import compile_fused_moe

require_interpreted_kernels()

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_matches_reference(dtype: torch.dtype, routing: str) -> None:
    # H and I not multiples of the 32-wide tiles; K = 2 of 5 experts.
    case = moe_case(7, 40, 24, 5, 2, dtype, routing, seed=1)
    actual = triton_moe.fused_moe(*case.args())
    assert_close(actual, reference.fused_moe(*case.args()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_on_one_expert(dtype: torch.dtype, top_k: int) -> None:
    # 20 rows on one expert: two blocks of 16, the second padded.
    case = moe_case(20, 48, 40, 4, top_k, dtype, "one_expert", seed=2, ids_dtype=torch.int32)
    actual = triton_moe.fused_moe(*case.args())
    assert_close(actual, reference.fused_moe(*case.args()))


@pytest.mark.parametrize("tokens", [0, 1])
def test_tiny_batches_through_the_backend(tokens: int) -> None:
    case = moe_case(tokens, 64, 32, 8, 2, torch.bfloat16, seed=3)
    actual = TritonBackend().fused_moe(*case.args())
    assert_close(actual, reference.fused_moe(*case.args()))


def test_backend_hands_strided_rows_to_the_reference() -> None:
    case = moe_case(3, 32, 16, 4, 2, torch.float32, seed=4)
    x = case.x.t().contiguous().t()  # [T, H] column-major: no contiguous last dimension
    actual = TritonBackend().fused_moe(x, *case.args()[1:])
    assert torch.equal(actual, reference.fused_moe(*case.args()))


@pytest.mark.parametrize("routing", ["topk", "skipped", "unused_expert", "none"])
def test_group_by_expert(routing: str) -> None:
    case = moe_case(9, 16, 16, 6, 3, torch.float32, routing, seed=5)
    block_m, num_experts = 4, 6
    slot_of_row, block_expert = triton_moe.group_by_expert(case.topk_ids, num_experts, block_m)
    ids = case.topk_ids.reshape(-1)  # [S]
    num_slots = ids.shape[0]
    assert block_expert.shape[0] == num_slots // block_m + min(num_experts, num_slots)
    assert slot_of_row.shape[0] == block_expert.shape[0] * block_m
    blocks = slot_of_row.view(-1, block_m)  # [blocks, BM]
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        real = [s for s in blocks[b].tolist() if s < num_slots]
        if expert == num_experts:  # unused: padding only
            assert not real
            continue
        assert real, "a used block holds at least one slot"
        assert all(int(ids[s]) == expert for s in real)
        assert real == sorted(real)  # token order within a group, as the reference's nonzero
        seen += real
    valid = [s for s in range(num_slots) if 0 <= int(ids[s]) < num_experts]
    assert sorted(seen) == valid  # every routed slot exactly once, skipped ones never


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.triton.compile_fused_moe"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") == 2 * len(compile_fused_moe.SHAPES), done.stdout
