"""Compile the fused-MoE Triton kernels for an sm_90 GPU without a GPU (run as a script).

``compile_for_gpu.py``'s method (``triton.compile`` to a cubin for a ``GPUTarget``) on the two
grouped-GEMM kernels, at the tiles ``fused_moe._gpu_tiles`` picks for a decode step and a
prefill, in every dtype the wrapper takes. Must run with ``TRITON_INTERPRET`` unset. Prints
one line per case and exits 1 if any failed.
"""

from __future__ import annotations

import sys

import torch

from corefleet.kernels.triton_ops import fused_moe as triton_moe
from tests.unit.triton.compile_for_gpu import TARGETS, Case, _compile

# (activation element type, torch dtype, routed slots) for a 64-expert layer: 8 slots is a
# decode step's (16-row blocks), 512 and 4096 prefills' (32- and 64-row blocks).
SHAPES = [
    ("bf16", torch.bfloat16, 8),
    ("bf16", torch.bfloat16, 4096),
    ("fp16", torch.float16, 512),
    ("fp32", torch.float32, 8),
]
# Pointers, the hidden and intermediate sizes and the strides of a real layer are multiples of
# 16 at launch; Triton specializes on that.
DIVISIBLE = (
    *("x_ptr", "w13_ptr", "w2_ptr", "act_ptr", "out_ptr"),
    *("hidden", "inter", "stride_x", "stride_we", "stride_wn"),
)


def cases() -> list[Case]:
    """Both kernels at each of ``SHAPES``."""
    found = []
    for name, dtype, slots in SHAPES:
        block_m, block_n, block_k, warps, stages = triton_moe._gpu_tiles(slots, 64, dtype)
        constexprs = {
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "BF16_BY_HAND": False,
        }
        ints = {"slot_of_row_ptr": "*i32", "block_expert_ptr": "*i32"}
        options = {"num_warps": warps, "num_stages": stages}
        found.append(
            Case(
                f"moe gate_up {name} slots={slots}",
                triton_moe._moe_gate_up_kernel,
                name,
                ints,
                constexprs,
                DIVISIBLE,
                options,
            )
        )
        found.append(
            Case(
                f"moe down {name} slots={slots}",
                triton_moe._moe_down_kernel,
                name,
                {**ints, "out_ptr": "*fp32", "weights_ptr": "*fp32"},
                constexprs,
                DIVISIBLE,
                options,
            )
        )
    return found


def main() -> int:
    failed = 0
    for target in TARGETS:
        for case in cases():
            try:
                _compile(target, case)
                print(f"ok   sm_{target.arch} {case.name}")
            except Exception as exc:  # report every case, then fail
                failed += 1
                print(f"FAIL sm_{target.arch} {case.name}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
