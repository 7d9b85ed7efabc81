"""Compile every corefleet Triton kernel for a GPU target without a GPU (run as a script).

The interpreter runs the kernels' logic but not Triton's GPU code generation, where layout,
``tl.dot`` shape and dtype rules live. Triton compiles down to a cubin (its wheel ships
``ptxas``) for any ``GPUTarget`` without a device, so this catches what would otherwise only
fail on the first GPU run. Kernel signatures come from the kernels' own annotations
(``tl.tensor`` pointers, ``int``, ``float``, ``tl.constexpr``); each case gives the pointer
element types that differ from the activation dtype and the constexpr values.

Must run with ``TRITON_INTERPRET`` unset (an interpreted kernel cannot be compiled). Prints one
line per case and exits 1 if any failed.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from corefleet.kernels.triton_ops import activation as triton_activation
from corefleet.kernels.triton_ops import attention as triton_attention
from corefleet.kernels.triton_ops import kv_cache as triton_kv_cache
from corefleet.kernels.triton_ops import rms_norm as triton_rms_norm
from corefleet.kernels.triton_ops import rotary as triton_rotary

TARGETS = [GPUTarget("cuda", 90, 32)]  # H100/H200


def _signature(fn: Any, dtype: str, pointers: dict[str, str]) -> dict[str, str]:
    kinds = {"tl.tensor": f"*{dtype}", "int": "i32", "float": "fp32", "tl.constexpr": "constexpr"}
    params = inspect.signature(fn.fn).parameters
    return {name: pointers.get(name, kinds[str(p.annotation)]) for name, p in params.items()}


def _attention_cases() -> list[tuple[str, Any, str, dict[str, str], dict[str, Any]]]:
    cases = []
    # Decode-only and mixed batches in bfloat16 (float16 takes the same path); float32 (IEEE
    # dots, no tensor cores) for decode only: its mixed-batch variant takes ~10 s to compile.
    for dtype, block_q, block_m in (("bf16", 1, 16), ("bf16", 16, 64), ("fp32", 1, 16)):
        constexprs = {
            "NUM_GROUP": 4,
            "HEAD_DIM": 128,
            "HEAD_DIM_PAD": 128,
            "BLOCK_SIZE": 16,
            "BLOCK_Q": block_q,
            "BLOCK_M": block_m,
            "TILE_N": 64,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "DOT_IN_F32": False,
        }
        ints = {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
        name = f"attention {dtype} BLOCK_Q={block_q}"
        cases.append((name, triton_attention._unified_attention_kernel, dtype, ints, constexprs))
    return cases


def _layer_cases() -> list[tuple[str, Any, str, dict[str, str], dict[str, Any]]]:
    return [
        (
            "kv cache",
            triton_kv_cache._write_kv_cache_kernel,
            "bf16",
            {"slot_mapping_ptr": "*i64"},
            {"HEAD_DIM": 128, "ROW": 1024, "BLOCK_T": 8, "ROW_TILE": 1024},
        ),
        *[
            (
                f"rms_norm residual={res}",
                triton_rms_norm._rms_norm_kernel,
                "bf16",
                {},
                {"HAS_RESIDUAL": res, "BLOCK_ROWS": 1, "BLOCK_H": 4096},
            )
            for res in (False, True)
        ],
        (
            "rotary",
            triton_rotary._rotary_kernel,
            "bf16",
            {},
            {
                "NUM_Q_HEADS": 32,
                "NUM_KV_HEADS": 8,
                "Q_HEADS_PAD": 32,
                "KV_HEADS_PAD": 8,
                "HALF": 64,
                "HALF_PAD": 64,
                "BLOCK_T": 1,
            },
        ),
        (
            "silu_and_mul",
            triton_activation._silu_and_mul_kernel,
            "bf16",
            {},
            {"BLOCK_T": 1, "BLOCK_I": 1024},
        ),
    ]


def main() -> int:
    failed = 0
    for target in TARGETS:
        for name, kernel, dtype, pointers, constexprs in _attention_cases() + _layer_cases():
            source = ASTSource(
                fn=kernel, signature=_signature(kernel, dtype, pointers), constexprs=constexprs
            )
            try:
                compiled = triton.compile(source, target=target)
                assert compiled.asm.get("cubin"), "no cubin produced"
                print(f"ok   sm_{target.arch} {name}")
            except Exception as exc:  # report every case, then fail
                failed += 1
                print(f"FAIL sm_{target.arch} {name}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
