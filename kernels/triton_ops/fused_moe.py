"""A mixture-of-experts layer's experts in Triton (``reference.fused_moe``'s contract).

Called by ``TritonBackend.fused_moe`` once per MoE layer. The reference runs a Python loop of
small matmuls per expert; here every expert's rows go through one launch per projection:

1. ``group_by_expert`` (torch ops, no host sync): the ``T * K`` slots (token, k) sorted by
   expert, each expert's group padded to a multiple of ``BLOCK_M`` rows with a sentinel slot,
   and the expert of every ``BLOCK_M`` block. The grid is sized by a bound on the block count
   (``S // BLOCK_M + min(E, S)``), so nothing is read back to the host; blocks past the used
   ones find no expert and return at once.
2. ``_moe_gate_up_kernel``, grid (block, I tile): gathers the block's x rows by token, multiplies
   them by its expert's gate and up tiles (two dots sharing each x tile), applies SwiGLU and
   stores ``act`` at the block's own (padded) rows.
3. ``_moe_down_kernel``, grid (block, H tile): ``act`` against the expert's down tile, rounded
   to the dtype (the reference's ``F.linear`` output), times the slot's routing weight, stored
   in a float32 buffer at the slot's own row ``t * K + k``.
4. The combine: that buffer summed over K (torch), in float32, cast once.

Why a per-slot buffer and a sum rather than atomic adds into the output from step 3: float
atomics add in whatever order the programs finish, so the output would change from run to run
(and bfloat16 has no native atomic add); the buffer costs ``T * K * H`` float32 values, small
next to the weights a step reads, and the sum is one bandwidth-bound pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corefleet.kernels.triton_ops.support import check_launchable, is_interpreted

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
# Under the interpreter each program runs in numpy, one after another: the smallest tiles a
# GPU's tl.dot takes (16), and K tiles of 32 so that tests cross tile edges.
_INTERPRETER_M, _INTERPRETER_N, _INTERPRETER_K = 16, 32, 32


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] gate rows :I, up rows I:
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32/int64; an id outside [0, E) is skipped
) -> torch.Tensor:  # [T, H], x's dtype
    """``sum_k w[t, k] * expert_{id[t, k]}(x[t])`` with SwiGLU experts, as grouped GEMMs.

    Raises:
        ValueError: mismatched shapes or dtypes, a strided last dimension, or a device Triton
            cannot launch on.
    """
    check_launchable(_moe_gate_up_kernel, x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden, num_experts, inter = _check(x, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    if num_slots == 0 or num_experts == 0 or hidden == 0 or inter == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    interpreted = is_interpreted(_moe_gate_up_kernel)
    if interpreted:
        block_m, block_n, block_k, warps, stages = (
            _INTERPRETER_M,
            _INTERPRETER_N,
            _INTERPRETER_K,
            4,
            1,
        )
    else:
        block_m, block_n, block_k, warps, stages = _gpu_tiles(num_slots, num_experts, x.dtype)
    slot_of_row, block_expert = group_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # The interpreter's tl.dot multiplies bfloat16 operands' raw bits and its casts to bfloat16
    # truncate (numpy has no bfloat16): there the operands are upcast (the same values, the
    # same float32 accumulation) and the roundings are done by hand, to nearest even as on GPUs.
    bf16_by_hand = interpreted and x.dtype == torch.bfloat16
    act = torch.empty((num_blocks * block_m, inter), dtype=x.dtype, device=x.device)  # [rows, I]
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x,
        w13,
        act,
        slot_of_row,
        block_expert,
        num_slots,
        top_k,
        hidden,
        inter,
        num_experts,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=dot_precision,
        BF16_BY_HAND=bf16_by_hand,
        num_warps=warps,
        num_stages=stages,
    )
    # Slots no expert here computes (ids outside [0, E)) stay 0 in the sum.
    weighted = torch.zeros((num_slots, hidden), dtype=torch.float32, device=x.device)  # [S, H]
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act,
        w2,
        weighted,
        topk_weights.reshape(-1),
        slot_of_row,
        block_expert,
        num_slots,
        hidden,
        inter,
        num_experts,
        w2.stride(0),
        w2.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=dot_precision,
        BF16_BY_HAND=bf16_by_hand,
        num_warps=warps,
        num_stages=stages,
    )
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def group_by_expert(
    topk_ids: torch.Tensor,  # [T, K] int; an id outside [0, E) is skipped
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # slot_of_row [blocks * BM] int32, block_expert [blocks]
    """The slots ``t * K + k`` grouped by expert, each group padded to whole blocks of
    ``block_m`` rows: ``slot_of_row[r]`` is row r's slot (``T * K`` on padding rows and unused
    blocks), ``block_expert[b]`` block b's expert (``num_experts`` for an unused block).

    Device-side torch ops only: the block count is the bound ``S // block_m + min(E, S)`` (each
    non-empty expert adds at most one partial block), not the count itself, which would need
    the counts on the host.
    """
    device = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)  # [S]
    num_slots = ids.shape[0]
    # Skipped ids into one extra bin after the last expert: sorted last, never in a block.
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)  # [E + 1]
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m  # [E + 1] rows per group in blocks
    padded[num_experts] = 0
    padded_end = torch.cumsum(padded, 0)  # [E + 1]
    group_start = torch.cumsum(counts, 0) - counts  # [E + 1] each group's first sorted index
    order = torch.argsort(ids, stable=True)  # [S] slots by expert, token order within a group
    sorted_ids = ids[order]  # [S]
    rank = torch.arange(num_slots, device=device) - group_start[sorted_ids]  # [S] within group
    num_blocks = num_slots // block_m + min(num_experts, num_slots)
    capacity = num_blocks * block_m
    # Skipped slots are written to one spare row past the blocks, dropped by the slice.
    row = torch.where(
        sorted_ids < num_experts, padded_end[sorted_ids] - padded[sorted_ids] + rank, capacity
    )  # [S]
    slot_of_row = torch.full((capacity + 1,), num_slots, dtype=torch.int32, device=device)
    slot_of_row.scatter_(0, row, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m  # [blocks]
    # The expert whose padded rows hold the block's first row: the first one ending after it.
    block_expert = torch.searchsorted(padded_end[:num_experts], block_start, right=True)
    return slot_of_row[:capacity], block_expert.to(torch.int32)


def _check(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> tuple[int, int, int, int]:  # T, H, E, I
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("x must be [T, H], w13 [E, 2I, H] and w2 [E, H, I]")
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    if tuple(w13.shape) != (num_experts, 2 * inter, hidden) or w2.shape[1] != hidden:
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    if x.dtype not in FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13 and w2 must share a float dtype: {x.dtype}, {w13.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype not in ID_DTYPES:
        raise ValueError(f"topk_ids must be [T, K] int32/int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError("topk_weights must be float32 and shaped like topk_ids")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 need a contiguous last dimension")
    if not topk_weights.is_contiguous():
        raise ValueError("topk_weights must be contiguous")
    return num_tokens, hidden, num_experts, inter


def _gpu_tiles(
    num_slots: int, num_experts: int, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    """BLOCK_M, BLOCK_N, BLOCK_K, warps and pipeline stages for ``num_slots`` routed rows.

    A decode step's experts have a row or two each: 16-row blocks (tl.dot's minimum) waste the
    least on padding, and the launch is bound by the experts' weight bytes. A prefill's groups
    are tens to hundreds of rows: larger blocks read each weight tile for more rows.
    Untuned: no GPU measured these yet.
    """
    rows_per_expert = num_slots / max(num_experts, 1)
    block_k = 32 if dtype == torch.float32 else 64  # float32 tiles twice the bytes
    if rows_per_expert <= 16:
        return 16, 64, block_k, 4, 3
    if rows_per_expert <= 64:
        return 32, 64, block_k, 4, 3
    return 64, 128, block_k, 8, 3


@triton.jit
def _round(v: tl.tensor, dtype: tl.constexpr, BY_HAND: tl.constexpr) -> tl.tensor:
    """float32 ``v`` rounded to ``dtype``, returned as float32. By hand: bfloat16's rounding
    to nearest even on the bits (the interpreter's cast truncates), then an exact cast."""
    if BY_HAND:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype).to(tl.float32)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr: tl.tensor,  # [T, H]
    w13_ptr: tl.tensor,  # [E, 2I, H]
    act_ptr: tl.tensor,  # [blocks * BLOCK_M, I], contiguous
    slot_of_row_ptr: tl.tensor,  # [blocks * BLOCK_M] int32
    block_expert_ptr: tl.tensor,  # [blocks] int32
    num_slots: int,  # T * K, the padding rows' slot
    top_k: int,
    hidden: int,  # H
    inter: int,  # I
    num_experts: int,
    stride_x: int,
    stride_we: int,  # between experts
    stride_wn: int,  # between weight rows
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,  # under the interpreter, for bfloat16
) -> None:
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:  # a block past the used ones
        return
    rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM] rows of act
    slots = tl.load(slot_of_row_ptr + rows)  # [BM]
    row_ok = slots < num_slots
    tokens = (slots // top_k).to(tl.int64)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of act
    col_ok = cols < inter
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    gate_rows = cols.to(tl.int64) * stride_wn  # [BN]
    up_rows = (cols + inter).to(tl.int64) * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < hidden
        x_mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=x_mask, other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]  # [BK, BN]
        w_gate = tl.load(w_base + gate_rows[None, :] + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + up_rows[None, :] + ks[:, None], mask=w_mask, other=0.0)
        if BF16_BY_HAND:
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=DOT_PRECISION)  # [BM, BN]
        acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
    # The reference's roundings: the projection's output, silu's output, the product.
    dtype = act_ptr.dtype.element_ty
    gate = _round(acc_gate, dtype, BF16_BY_HAND)
    up = _round(acc_up, dtype, BF16_BY_HAND)
    silu = _round(gate * tl.sigmoid(gate), dtype, BF16_BY_HAND)
    act = _round(silu * up, dtype, BF16_BY_HAND)
    # Padding rows are stored too (zeros: their x was 0); only the down kernel's mask drops them.
    offs = rows[:, None] * inter + cols[None, :]
    tl.store(act_ptr + offs, act.to(dtype), mask=col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr: tl.tensor,  # [blocks * BLOCK_M, I], contiguous
    w2_ptr: tl.tensor,  # [E, H, I]
    out_ptr: tl.tensor,  # [T * K, H] float32: each slot's weighted expert output
    weights_ptr: tl.tensor,  # [T * K] float32
    slot_of_row_ptr: tl.tensor,  # [blocks * BLOCK_M] int32
    block_expert_ptr: tl.tensor,  # [blocks] int32
    num_slots: int,
    hidden: int,  # H
    inter: int,  # I
    num_experts: int,
    stride_we: int,
    stride_wn: int,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,  # under the interpreter, for bfloat16
) -> None:
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM] rows of act
    slots = tl.load(slot_of_row_ptr + rows)  # [BM]
    row_ok = slots < num_slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns (of H)
    col_ok = cols < hidden
    w_rows = w2_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wn  # [BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < inter
        a = tl.load(act_ptr + rows[:, None] * inter + ks[None, :], mask=k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_rows[None, :] + ks[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        if BF16_BY_HAND:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)  # [BM, BN]
    # The down projection's output rounded to the dtype (as the reference's F.linear), then
    # weighted in float32.
    weight = tl.load(weights_ptr + slots, mask=row_ok, other=0.0)  # [BM]
    out = _round(acc, act_ptr.dtype.element_ty, BF16_BY_HAND) * weight[:, None]
    offs = slots.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(out_ptr + offs, out, mask=row_ok[:, None] & col_ok[None, :])
