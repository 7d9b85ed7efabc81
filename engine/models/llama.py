"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flattened token batch.

No padding anywhere: the batch is ``[T]`` tokens from many requests, and attention finds each
request's context through the paged KV cache (``AttentionMetadata``). Projections are fused
(q|k|v and gate|up) so each layer runs few, large GEMMs.

A layer whose source tensors are all in a GGUF block format the kernels read (``quantized``,
by Hugging Face name) keeps them so (``quant_layers``); every other layer holds float weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.models.expert_parallel import ExpertParallel
from corefleet.engine.models.layer_program import (
    AttentionShape,
    KVCache,
    LayerProgram,
    Mlp,
    Reduce,
)
from corefleet.engine.models.layers import BackendLinear, LinearFactory, RMSNorm
from corefleet.engine.models.llama_loading import load_llama_weights
from corefleet.engine.models.moe import SparseMoeBlock
from corefleet.engine.models.pipeline_parallel import PipelineStage
from corefleet.engine.models.qk_norm import NormWeight, QKVTransform, bind_qk_norm, qk_norm_widths
from corefleet.engine.models.quant_layers import QuantEmbedding, QuantLinear
from corefleet.engine.models.rope import build_cos_sin_cache
from corefleet.engine.models.tensor_parallel import ShardPlan, VocabParallelEmbedding
from corefleet.kernels import reference
from corefleet.kernels.backend import KernelBackend
from corefleet.kernels.gguf_quant import QuantFormat
from corefleet.kernels.metadata import AttentionMetadata


class LlamaAttention(nn.Module):
    """Attention's parameters (fused q|k|v, o) and shape; ``LayerProgram`` runs it."""

    def __init__(
        self, cfg: ArchConfig, backend: KernelBackend, make_linear: LinearFactory, prefix: str
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = make_linear(
            cfg.hidden_size,
            [
                (f"{prefix}q_proj.weight", "q", self.q_size),
                (f"{prefix}k_proj.weight", "k", self.kv_size),
                (f"{prefix}v_proj.weight", "v", self.kv_size),
            ],
            cfg.attention_bias,
        )
        self.o_proj = make_linear(
            self.q_size, [(f"{prefix}o_proj.weight", None, cfg.hidden_size)], False
        )
        self.backend = backend
        self.shape = AttentionShape(self.num_heads, self.num_kv_heads, self.head_dim, self.scale)
        self.cfg = cfg
        self.q_norm: NormWeight | None = None
        self.k_norm: NormWeight | None = None
        if cfg.qk_norm is not None:
            q_width, k_width = qk_norm_widths(cfg)
            self.q_norm, self.k_norm = NormWeight(q_width), NormWeight(k_width)

    def bind_qk_norm(self) -> QKVTransform | None:
        """The q/k norms (and clamp) between the projection and RoPE, where the model has them."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return bind_qk_norm(self.cfg, self.backend, self.q_norm, self.k_norm)


class LlamaMLP(nn.Module):
    """The SwiGLU MLP's parameters (fused gate|up, down); ``bind`` runs it."""

    def __init__(
        self,
        cfg: ArchConfig,
        backend: KernelBackend,
        make_linear: LinearFactory,
        prefix: str,
        size: int | None = None,  # the intermediate size; cfg's unless given (a shared expert)
    ) -> None:
        super().__init__()
        size = cfg.intermediate_size if size is None else size
        self.gate_up_proj = make_linear(
            cfg.hidden_size,
            [(f"{prefix}gate_proj.weight", "gate", size), (f"{prefix}up_proj.weight", "up", size)],
            False,
        )
        self.down_proj = make_linear(
            size, [(f"{prefix}down_proj.weight", None, cfg.hidden_size)], False
        )
        self.backend = backend

    def bind(self, dtype: torch.dtype) -> Mlp:
        """``down(silu(gate(x)) * up(x))`` as a closure over the current weights."""
        gate_up, down = self.gate_up_proj.bind(dtype), self.down_proj.bind(dtype)
        silu_and_mul = self.backend.silu_and_mul
        return lambda x: down(silu_and_mul(gate_up(x)))


class LlamaDecoderLayer(nn.Module):
    """One decoder layer's modules; its forward pass is ``program()``'s."""

    def __init__(
        self,
        cfg: ArchConfig,
        backend: KernelBackend,
        make_linear: LinearFactory,
        index: int,
        experts: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{index}."
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = LlamaAttention(cfg, backend, make_linear, f"{prefix}self_attn.")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = self._mlp(cfg, backend, make_linear, index, experts)

    @staticmethod
    def _mlp(
        cfg: ArchConfig,
        backend: KernelBackend,
        make_linear: LinearFactory,
        index: int,
        experts: ExpertParallel | None,
    ) -> LlamaMLP | SparseMoeBlock:
        prefix = f"model.layers.{index}.mlp."
        spec = cfg.moe
        if spec is None or not spec.is_sparse(index):
            return LlamaMLP(cfg, backend, make_linear, prefix)
        shared = None
        if spec.shared_expert_intermediate_size:
            size = spec.shared_expert_intermediate_size
            shared = LlamaMLP(cfg, backend, make_linear, f"{prefix}shared_expert.", size)
        return SparseMoeBlock(cfg, spec, backend, shared, experts)

    def program(self, dtype: torch.dtype, reduce: Reduce | None = None) -> LayerProgram:
        """This layer's forward pass, bound to its current weights, for activations of
        ``dtype`` (``layer_program``: why the modules do not run it themselves); ``reduce``
        sums the row-parallel outputs over tensor-parallel workers."""
        attn, mlp = self.self_attn, self.mlp
        return LayerProgram(
            input_norm=self.input_layernorm.bind(),
            qkv=attn.qkv_proj.bind(dtype),
            o_proj=attn.o_proj.bind(dtype),
            post_norm=self.post_attention_layernorm.bind(),
            mlp=mlp.bind(dtype),
            backend=attn.backend,
            shape=attn.shape,
            reduce=reduce,
            qk_norm=attn.bind_qk_norm(),
        )


class AbsentPart(nn.Module):
    """A part of the model (a layer, the embedding, the head) another pipeline stage holds."""


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head; ``forward`` returns hidden states, not logits.

    Under pipeline parallelism a stage holds some layers (the first stage the embedding, the
    last the final norm and the head): :meth:`run_layers` runs them from the previous stage's
    output, :meth:`finish` applies the final norm."""

    def __init__(
        self,
        cfg: ArchConfig,
        backend: KernelBackend,
        max_positions: int,
        quantized: Mapping[str, QuantFormat] | None = None,
        dtype: torch.dtype = torch.float32,
        shards: ShardPlan | None = None,
        stage: PipelineStage | None = None,
        experts: ExpertParallel | None = None,
    ) -> None:
        """``quantized``: the block format of each weight (by HF name) kept quantized;
        ``dtype``: the activations' dtype (what a quantized embedding dequantizes to);
        ``shards``: this worker's slices under tensor parallelism (``tensor_parallel``);
        ``stage``: the layers it holds under pipeline parallelism (``pipeline_parallel``);
        ``experts``: the experts it holds under expert parallelism (``expert_parallel``)."""
        super().__init__()
        self.vocab_size = cfg.vocab_size  # the whole vocabulary, whatever this worker holds
        self.shards = shards if shards is not None and shards.tp.enabled else None
        stage = stage or PipelineStage()
        self.held_layers = stage.layers(cfg.num_hidden_layers)
        if (self.shards is not None or stage.enabled) and quantized:
            raise ValueError(
                "tensor and pipeline parallelism run unquantized weights: pass --quantization "
                "none (a GGUF file's weights are then dequantized)"
            )
        if self.shards is not None:
            cfg = self.shards.local_arch
        self.cfg = cfg
        self._programs: list[LayerProgram] | None = None  # see _layer_programs
        quantized = quantized or {}
        make_linear = LinearFactory(backend, quantized)
        embed_format = quantized.get("model.embed_tokens.weight")
        self.embed_tokens: nn.Embedding | QuantEmbedding | VocabParallelEmbedding | AbsentPart
        if not stage.is_first:
            self.embed_tokens = AbsentPart()
        elif self.shards is not None:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.shards)
        elif embed_format is not None:
            self.embed_tokens = QuantEmbedding(
                cfg.vocab_size, cfg.hidden_size, embed_format, dtype, backend
            )
        else:
            # An explicit weight skips nn.Embedding's random init, whose call imports
            # torch._dynamo (~1.6 s of every rank's start-up); the loader fills it anyway.
            self.embed_tokens = nn.Embedding(
                cfg.vocab_size,
                cfg.hidden_size,
                _weight=torch.empty(cfg.vocab_size, cfg.hidden_size),
            )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, make_linear, i, experts)
            if i in self.held_layers
            else AbsentPart()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm: RMSNorm | AbsentPart = AbsentPart()
        self.lm_head: BackendLinear | QuantLinear | AbsentPart = AbsentPart()
        if stage.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
            # A tied head is the embedding table, quantized or not like it.
            tied = cfg.tie_word_embeddings
            head_source = "model.embed_tokens.weight" if tied else "lm_head.weight"
            self.lm_head = make_linear(
                cfg.hidden_size, [(head_source, None, cfg.vocab_size)], False
            )
        self.tie_word_embeddings()
        # Computed on the CPU even when the model is built on the meta device: the meta path
        # of these ops imports torch._dynamo (and with it triton: ~1.6 s and ~70 MiB resident
        # in every rank); the model runner rebuilds the table on its device anyway.
        with torch.device("cpu"):
            cos_sin = build_cos_sin_cache(
                cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
            )
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        """The whole model (one pipeline stage): the final norm's hidden states."""
        return self.finish(*self.run_layers(input_ids, positions, kv_caches, meta))

    def run_layers(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # this stage's layers'
        meta: AttentionMetadata,
        carried: tuple[torch.Tensor, torch.Tensor] | None = None,  # the previous stage's
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden, residual: [T, H]
        """This stage's layers, from the embedding (first stage) or from ``carried``."""
        if carried is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = carried
        cos_sin_cache: torch.Tensor = self.cos_sin_cache  # type: ignore[assignment]
        rotary = reference.rotary_cos_sin(positions, cos_sin_cache, hidden.dtype)  # per step
        for program, kv_cache in zip(self._layer_programs(), kv_caches, strict=True):
            hidden, residual = program(hidden, residual, kv_cache, meta, rotary)
        assert residual is not None  # every stage holds a layer
        return hidden, residual

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # [T, H]
        """The final norm (the last stage's)."""
        assert isinstance(self.norm, RMSNorm), "only the last pipeline stage has the norm"
        normed, _ = self.norm(hidden, residual)
        return normed

    def _layer_programs(self) -> list[LayerProgram]:
        # Bound on first use, once the weights are where they stay; dropped whenever tensors
        # may be replaced (_apply: .to(), .to_empty(), ...; loading; tying).
        if self._programs is None:
            held = [self.layers[i] for i in self.held_layers]
            assert isinstance(held[0], LlamaDecoderLayer)
            dtype = held[0].input_layernorm.weight.dtype  # the activations' dtype
            reduce = None if self.shards is None else self.shards.tp.all_reduce
            self._programs = [layer.program(dtype, reduce) for layer in held]  # type: ignore[operator]
        return self._programs

    def _apply(self, fn: Any, recurse: bool = True) -> LlamaForCausalLM:
        self._programs = None
        return super()._apply(fn, recurse)

    def tie_word_embeddings(self) -> None:
        """Make a tied model's LM head read the embedding table (again after materialising)."""
        self._programs = None
        if not self.cfg.tie_word_embeddings or isinstance(self.lm_head, AbsentPart):
            return
        if isinstance(self.embed_tokens, AbsentPart):
            return  # a last pipeline stage: its head holds a copy of the table
        if isinstance(self.lm_head, QuantLinear):
            assert isinstance(self.embed_tokens, QuantEmbedding)
            table: torch.Tensor = self.embed_tokens.qweight  # type: ignore[assignment]
            self.lm_head.share_blocks(table)
        else:
            assert isinstance(self.embed_tokens, nn.Embedding | VocabParallelEmbedding)
            self.lm_head.weight = self.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        assert not isinstance(self.lm_head, AbsentPart), "only the last stage has the head"
        logits = self.lm_head(hidden)  # [N, V] or, tensor-parallel, this worker's [N, V/tp]
        if self.shards is not None:
            logits = self.shards.tp.all_gather_columns(logits)[:, : self.vocab_size]
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive; a
        tensor of a part another pipeline stage holds is skipped (``llama_loading``)."""
        self._programs = None
        load_llama_weights(self, weights)

    def holds(self, name: str) -> bool:
        """Whether this worker holds the parameter ``name`` (ours, after fusing)."""
        if name.startswith("layers."):
            return int(name.split(".")[1]) in self.held_layers
        part = name.split(".")[0]
        return not isinstance(getattr(self, part), AbsentPart)
