"""Random-weight Llama GGUF files at real model shapes, for the benchmarks against llama-server.

Speed and memory depend on a model's shapes and block formats, not on its weights, so these
files carry random but valid blocks: random quant bytes, with the float16 scales (and mins)
set so that values come out around N(0, 0.02) like a trained checkpoint's. Writing the bytes
directly takes seconds for a 3B model; quantizing float tensors in Python would take many
minutes. Norms are float32 ones. The tokenizer metadata is the embedded SmolLM2-135M's
(49152 tokens), so both servers tokenize the same way; the benchmarks send token ids anyway.

Shapes (all Llama architecture, tied embedding, SmolLM2's vocabulary):

- ``0.5b``: Qwen2.5-0.5B's dimensions (hidden 896, 24 layers, intermediate 4864, 14 heads,
  2 KV heads);
- ``1b``: Llama-3.2-1B's (hidden 2048, 16 layers, intermediate 8192, 32 heads, 8 KV heads);
- ``3b``: Llama-3.2-3B's (hidden 3072, 28 layers, intermediate 8192, 24 heads, 8 KV heads).

Formats (``LAYOUTS``):

- ``Q4_0``: linear weights Q4_0, the tied embedding Q8_0 (issue 38's 1.1B model);
- ``Q8_0``: everything Q8_0;
- ``Q4_K_M``: llama.cpp's mix (``llama-quant.cpp``): Q4_K, with Q6_K for the tied
  embedding/output and for ``attn_v`` and ``ffn_down`` in the layers its ``use_more_bits``
  picks. A K-quant needs rows of a multiple of 256 values; where a row is not (hidden 896),
  llama.cpp falls back to Q5_0 for Q4_K and Q8_0 for Q6_K. corefleet keeps no Q5_0 blocks
  (it would dequantize them), so Q4_0 stands in for Q5_0 here.

Files are cached under ``--cache-dir`` (default ``~/.cache/corefleet/bench-models``), named by
shape and format, written once (to a temporary name, renamed when complete) and reused.

    python benchmarks/gguf_shapes.py --shape 1b --format Q4_0     # prints the file's path
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from corefleet.engine.models.default_model import default_model_path
from corefleet.kernels.gguf_quant import FORMATS_BY_NAME, QuantFormat

DEFAULT_CACHE = Path.home() / ".cache" / "corefleet" / "bench-models"
WEIGHT_STD = 0.02  # a trained checkpoint's typical weight scale


@dataclass(frozen=True)
class Shape:
    """A Llama model's dimensions."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 49152  # SmolLM2's tokenizer
    context: int = 8192
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Weights in the file (the tied embedding counted once)."""
        kv = self.kv_heads * self.head_dim
        per_layer = 2 * self.hidden * (self.hidden + kv) + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("0.5b", hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2),
        Shape("1b", hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8),
        Shape("3b", hidden=3072, layers=28, intermediate=8192, heads=24, kv_heads=8),
    )
}

# GGUF tensor kinds of one layer's linear weights, and their [rows, cols] (nn.Linear layout).
LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def linear_shape(shape: Shape, kind: str) -> tuple[int, int]:
    kv = shape.kv_heads * shape.head_dim
    return {
        "attn_q": (shape.hidden, shape.hidden),
        "attn_k": (kv, shape.hidden),
        "attn_v": (kv, shape.hidden),
        "attn_output": (shape.hidden, shape.hidden),
        "ffn_gate": (shape.intermediate, shape.hidden),
        "ffn_up": (shape.intermediate, shape.hidden),
        "ffn_down": (shape.hidden, shape.intermediate),
    }[kind]


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in a *_K_M mix."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# A K-quant on a row whose length is no multiple of 256: llama.cpp's fallback (Q4_K -> Q5_0
# there, Q4_0 here since corefleet keeps no Q5_0 blocks; Q6_K -> Q8_0 as in llama.cpp).
K_FALLBACK = {"Q4_K": "Q4_0", "Q6_K": "Q8_0"}

# format -> (embedding's format, layer's format for (kind, layer, layers))
Layout = tuple[str, Callable[[str, int, int], str]]


def _q4_k_m(kind: str, layer: int, layers: int) -> str:
    more = kind in ("attn_v", "ffn_down") and use_more_bits(layer, layers)
    return "Q6_K" if more else "Q4_K"


LAYOUTS: dict[str, Layout] = {
    "Q4_0": ("Q8_0", lambda kind, layer, layers: "Q4_0"),
    "Q8_0": ("Q8_0", lambda kind, layer, layers: "Q8_0"),
    "Q4_K_M": ("Q6_K", _q4_k_m),
}
FILE_TYPES = {
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}


def block_format(name: str, cols: int) -> QuantFormat:
    """``name``'s block format, or its fallback when a row of ``cols`` values cannot hold it."""
    fmt = FORMATS_BY_NAME[name]
    if cols % fmt.block_elems:
        fmt = FORMATS_BY_NAME[K_FALLBACK[name]]
    if cols % fmt.block_elems:
        raise ValueError(f"a row of {cols} values fits no {name} nor {fmt.name} block")
    return fmt


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: GGUF name, [rows, cols], and block format (None: float32)."""

    name: str
    rows: int
    cols: int
    fmt: QuantFormat | None


def plan(shape: Shape, fmt: str) -> list[TensorPlan]:
    """Every tensor of ``shape`` in ``fmt``, in file order."""
    embedding, layer_format = LAYOUTS[fmt]
    tensors = [
        TensorPlan(
            "token_embd.weight", shape.vocab, shape.hidden, block_format(embedding, shape.hidden)
        ),
    ]
    for i in range(shape.layers):
        tensors.append(TensorPlan(f"blk.{i}.attn_norm.weight", 1, shape.hidden, None))
        for kind in LINEAR_KINDS:
            rows, cols = linear_shape(shape, kind)
            block = block_format(layer_format(kind, i, shape.layers), cols)
            tensors.append(TensorPlan(f"blk.{i}.{kind}.weight", rows, cols, block))
        tensors.append(TensorPlan(f"blk.{i}.ffn_norm.weight", 1, shape.hidden, None))
    tensors.append(TensorPlan("output_norm.weight", 1, shape.hidden, None))
    return tensors


# Each format's float16 fields (byte offset in the block, multiple of WEIGHT_STD), chosen so
# that values come out with a standard deviation near WEIGHT_STD: ``d`` divides by the spread
# of what it multiplies (Q4_0's q - 8: ~4.6; Q8_0's int8: ~74; Q4_K's 6-bit scale times q:
# ~36 * 4.6; Q6_K's int8 scale times q - 32: ~74 * 18.5). Q4_K's dmin centres the values.
_F16_FIELDS: dict[str, tuple[tuple[int, float], ...]] = {
    "Q4_0": ((0, 1 / 4.6),),
    "Q4_1": ((0, 1 / 4.6), (2, -7.5 / 4.6)),
    "Q8_0": ((0, 1 / 74),),
    "Q4_K": ((0, 1 / (36 * 4.6)), (2, 7.5 / (36 * 4.6))),
    "Q5_K": ((0, 1 / (36 * 9.2)), (2, 15.5 / (36 * 9.2))),
    "Q6_K": ((208, 1 / (74 * 18.5)),),
}


def random_blocks(fmt: QuantFormat, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, fmt.row_bytes(cols)]`` uint8 of valid ``fmt`` blocks: random bytes, then the
    float16 fields set to a sane magnitude (each block's within ±25 % of the target)."""
    raw = np.frombuffer(rng.bytes(rows * fmt.row_bytes(cols)), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.block_bytes).copy()
    for offset, per_std in _F16_FIELDS[fmt.name]:
        spread = rng.uniform(0.75, 1.25, size=blocks.shape[0]).astype(np.float32)
        values = (spread * np.float32(WEIGHT_STD * per_std)).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, fmt.row_bytes(cols))


def model_path(shape: str, fmt: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    return cache_dir / f"llama-{shape}-random-{fmt}.gguf"


def ensure_model(shape: str, fmt: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The cached file for ``shape`` and ``fmt``, written first if it is not there yet."""
    path = model_path(shape, fmt, cache_dir)
    if not path.is_file():
        write_model(SHAPES[shape], fmt, path)
    return path


def write_model(shape: Shape, fmt: str, path: Path, seed: int = 0) -> Path:
    """Write ``shape`` in ``fmt`` to ``path`` (via a temporary name: a crash leaves no file
    that looks complete). The tensors are generated one at a time, never all in memory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    tensors = plan(shape, fmt)
    writer = gguf.GGUFWriter(str(partial), "llama")
    _add_metadata(writer, shape, fmt)
    for t in tensors:
        if t.fmt is None:
            writer.add_tensor_info(t.name, (t.cols,), np.dtype(np.float32), 4 * t.cols)
        else:
            qtype = gguf.GGMLQuantizationType(t.fmt.ggml_type)
            byte_shape = (t.rows, t.fmt.row_bytes(t.cols))
            nbytes = t.rows * t.fmt.row_bytes(t.cols)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for t in tensors:
        if t.fmt is None:
            writer.write_tensor_data(np.ones(t.cols, dtype=np.float32))
        else:
            writer.write_tensor_data(random_blocks(t.fmt, t.rows, t.cols, rng))
    writer.close()
    partial.rename(path)
    return path


def _add_metadata(writer: gguf.GGUFWriter, shape: Shape, fmt: str) -> None:
    writer.add_name(f"random Llama {shape.name} {fmt}")
    writer.add_file_type(FILE_TYPES[fmt])
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    _copy_tokenizer(writer, Path(default_model_path()), shape.vocab)


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path, vocab: int) -> None:
    """Every ``tokenizer.*`` key of ``source`` (the embedded SmolLM2 file), as it is there."""
    reader = gguf.GGUFReader(str(source))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    if len(tokens) != vocab:
        raise ValueError(f"{source}: {len(tokens)} tokens, the shapes assume {vocab}")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), main, sub)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), nargs="+", required=True)
    p.add_argument("--format", choices=sorted(LAYOUTS), nargs="+", default=["Q4_0"])
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = p.parse_args()
    for shape in args.shape:
        for fmt in args.format:
            path = ensure_model(shape, fmt, args.cache_dir)
            size = path.stat().st_size / 2**20
            params = SHAPES[shape].parameters() / 1e9
            print(f"{shape} {fmt}: {params:.2f} B parameters, {size:.0f} MiB: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
