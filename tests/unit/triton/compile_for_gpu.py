"""Compile every corefleet Triton kernel for a GPU target without a GPU (run as a script).

The interpreter runs the kernels' logic but not Triton's GPU code generation, where layout,
``tl.dot`` shape and dtype rules live. Triton compiles down to a cubin (its wheel ships
``ptxas``) for any ``GPUTarget`` without a device, so this catches what would otherwise only
fail on the first GPU run. Kernel signatures come from the kernels' own annotations
(``tl.tensor`` pointers, ``int``, ``float``, ``tl.constexpr``); each case gives the pointer
element types that differ from the activation dtype and the constexpr values. The GGUF cases
also name the arguments a real launch finds divisible by 16 (Triton specializes on that, and
it decides whether weight bytes are loaded as vectors and pipelined).

Must run with ``TRITON_INTERPRET`` unset (an interpreted kernel cannot be compiled). Prints one
line per case and exits 1 if any failed.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, NamedTuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from corefleet.kernels import gguf_quant
from corefleet.kernels.triton_ops import activation as triton_activation
from corefleet.kernels.triton_ops import attention as triton_attention
from corefleet.kernels.triton_ops import gguf_matmul as triton_gguf
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
            "KV_FP8": False,
        }
        ints = {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
        name = f"attention {dtype} BLOCK_Q={block_q}"
        cases.append((name, triton_attention._unified_attention_kernel, dtype, ints, constexprs))
        if dtype == "bf16":  # the same with a float8 cache (--kv-cache-dtype fp8)
            fp8 = {**ints, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
            kernel = triton_attention._unified_attention_kernel
            cases.append((f"{name} fp8 cache", kernel, dtype, fp8, {**constexprs, "KV_FP8": True}))
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
        (
            "kv cache fp8",
            triton_kv_cache._write_kv_cache_kernel,
            "fp8e4nv",
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


class Case(NamedTuple):
    name: str
    kernel: Any
    dtype: str  # the activations' element type: every pointer not in ``pointers``
    pointers: dict[str, str]
    constexprs: dict[str, Any]
    divisible: tuple[str, ...] = ()  # arguments a real launch finds divisible by 16
    options: dict[str, Any] = {}  # noqa: RUF012  (num_warps, num_stages; never mutated)


def _gguf_cases() -> list[Case]:
    # A 4096-wide layer: pointers, K, row bytes and strides are multiples of 16 at launch.
    ints = ("k", "row_bytes", "stride_x", "stride_out")
    divisible = ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "ids_ptr", *ints)

    def fmt_constexprs(fmt: gguf_quant.QuantFormat) -> dict[str, Any]:
        groups = fmt.block_elems // triton_gguf.GROUP
        return {"FMT": fmt.ggml_type, "BLOCK_BYTES": fmt.block_bytes, "GROUPS_PER_BLOCK": groups}

    def matmul(fmt: gguf_quant.QuantFormat, dtype: str, m: int) -> Case:
        block_m, block_n, block_k, warps, stages = triton_gguf._gpu_tiles(m)
        constexprs = fmt_constexprs(fmt) | {
            "HAS_BIAS": True,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "DOT_IN_F32": False,
        }
        return Case(
            f"gguf matmul {fmt.name} {dtype} M={m}",
            triton_gguf._gguf_matmul_kernel,
            dtype,
            {"w_ptr": "*u8"},
            constexprs,
            divisible,
            {"num_warps": warps, "num_stages": stages},
        )

    # Every format's branch at the decode tiles; the prefill and middle tiles and float16 and
    # float32 once each.
    cases = [matmul(fmt, "bf16", 1) for fmt in gguf_quant.FORMATS.values()]
    cases += [matmul(gguf_quant.Q4_K, "bf16", 256), matmul(gguf_quant.Q4_0, "fp16", 64)]
    cases.append(matmul(gguf_quant.Q8_0, "fp32", 1))  # IEEE dots
    cases.append(
        Case(
            "gguf dequantize Q6_K bf16",
            triton_gguf._gguf_dequantize_kernel,
            "bf16",
            {"w_ptr": "*u8", "ids_ptr": "*i64"},
            fmt_constexprs(gguf_quant.Q6_K) | {"BLOCK_R": 1, "BLOCK_G": 32},
            divisible,
        )
    )
    return cases


def _compile(target: GPUTarget, case: Case) -> None:
    params = list(inspect.signature(case.kernel.fn).parameters)
    attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in case.divisible if n in params}
    source = ASTSource(
        fn=case.kernel,
        signature=_signature(case.kernel, case.dtype, case.pointers),
        constexprs=case.constexprs,
        attrs=attrs,
    )
    compiled = triton.compile(source, target=target, options=case.options)
    assert compiled.asm.get("cubin"), "no cubin produced"


def main() -> int:
    failed = 0
    cases = [Case(*c) for c in _attention_cases() + _layer_cases()] + _gguf_cases()
    for target in TARGETS:
        for case in cases:
            try:
                _compile(target, case)
                print(f"ok   sm_{target.arch} {case.name}")
            except Exception as exc:  # report every case, then fail
                failed += 1
                print(f"FAIL sm_{target.arch} {case.name}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
