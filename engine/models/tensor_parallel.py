"""Tensor parallelism: which slice of each weight a worker holds, and the collectives between.

``N`` workers split every decoder layer (Megatron's layout, as vLLM): q, k, v and gate, up are
column-parallel (each worker computes its own heads and its own rows of the intermediate), o and
down are row-parallel (each worker multiplies its slice of the input, then one all-reduce sums
the partial outputs: two per layer). The embedding and the LM head are vocabulary-parallel: a
worker holds ``ceil(V / N)`` rows of the table (zero rows pad the last), looks up the ids it
holds and all-reduces; its logits slice is all-gathered. Norms and the rotary table are whole
on every worker.

Grouped-query attention with fewer KV heads than workers replicates each KV head over
``N / num_kv_heads`` workers, whose query heads all read it. The KV cache holds a worker's own
KV heads, so it is sharded (or replicated) the same way.

Everything here is plain torch: the collectives are ``torch.distributed``'s over the group the
executor set up (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from corefleet.engine.models.arch import ArchConfig


@dataclass(frozen=True)
class TensorParallel:
    """One worker's place among the ``size`` workers of its tensor-parallel group (``rank``
    within it; ``group`` is the group's ``torch.distributed`` handle, None for the default
    group; ``first`` the global rank of its rank 0)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # dist.ProcessGroup: one per pipeline stage
    first: int = 0

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over workers, in place."""
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:  # [N, v] -> [N, size*v]
        """Every worker's ``x`` side by side along the last dimension, in rank order."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Worker 0's ``x`` on every worker, in place (its sampled tokens: random sampling
        must not tell the workers' batches apart)."""
        if self.enabled:
            dist.broadcast(x, src=self.first, group=self.group)
        return x


@dataclass(frozen=True)
class ShardPlan:
    """Where worker ``tp.rank``'s slices lie in the full (Hugging Face) tensors."""

    arch: ArchConfig  # the whole model's
    tp: TensorParallel

    def __post_init__(self) -> None:
        check_tensor_parallel(self.arch, self.tp.size)

    @property
    def local_arch(self) -> ArchConfig:
        """The shapes one worker builds: its heads, its intermediate rows, its vocabulary rows."""
        a, n = self.arch, self.tp.size
        moe = a.moe
        if moe is not None:  # each expert (and the shared one) split like a dense MLP
            moe = dataclasses.replace(
                moe,
                expert_intermediate_size=moe.expert_intermediate_size // n,
                shared_expert_intermediate_size=moe.shared_expert_intermediate_size // n,
            )
        return dataclasses.replace(
            a,
            num_attention_heads=a.num_attention_heads // n,
            num_key_value_heads=max(1, a.num_key_value_heads // n),
            intermediate_size=a.intermediate_size // n,
            vocab_size=self.vocab_rows,
            moe=moe,
        )

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and LM head per worker (the vocabulary, padded to N)."""
        return -(-self.arch.vocab_size // self.tp.size)

    @property
    def vocab_start(self) -> int:
        return self.tp.rank * self.vocab_rows

    def shard(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This worker's slice of the Hugging Face tensor ``hf_name`` (the tensor itself when it
        is replicated)."""
        if not self.tp.enabled:
            return tensor
        a, rank, n = self.arch, self.tp.rank, self.tp.size
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return _rows(tensor, rank, a.num_attention_heads // n * a.head_dim)
        if hf_name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return _rows(tensor, self._kv_head(), max(1, a.num_key_value_heads // n) * a.head_dim)
        if hf_name.endswith("o_proj.weight"):
            return _columns(tensor, rank, a.num_attention_heads // n * a.head_dim)
        # A dense MLP, a shared expert or an expert (Mixtral's w1, w3, w2): its own size.
        if hf_name.endswith(("gate_proj.weight", "up_proj.weight", ".w1.weight", ".w3.weight")):
            return _rows(tensor, rank, tensor.shape[0] // n)
        if hf_name.endswith(("down_proj.weight", ".w2.weight")):
            return _columns(tensor, rank, tensor.shape[1] // n)
        if hf_name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self._vocab_rows(tensor)
        return tensor  # norms, routers, the shared expert's gate

    def _kv_head(self) -> int:
        """The index, in units of a worker's KV slice, of the KV heads this worker holds."""
        kv, n = self.arch.num_key_value_heads, self.tp.size
        if kv >= n:
            return self.tp.rank
        return self.tp.rank * kv // n  # each KV head serves n / kv workers

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:  # [V, H] -> [V/N, H]
        start, rows = self.vocab_start, self.vocab_rows
        held = tensor[start : start + rows]
        if held.shape[0] == rows:
            return held
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: held.shape[0]] = held
        return padded


def _rows(tensor: torch.Tensor, index: int, size: int) -> torch.Tensor:
    return tensor.narrow(0, index * size, size)


def _columns(tensor: torch.Tensor, index: int, size: int) -> torch.Tensor:
    return tensor.narrow(1, index * size, size)


def check_tensor_parallel(arch: ArchConfig, size: int) -> None:
    """Raise ``ValueError`` naming the shape that ``size`` workers cannot split."""
    problems = []
    if arch.num_attention_heads % size:
        problems.append(f"{arch.num_attention_heads} attention heads")
    kv = arch.num_key_value_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} key/value heads")
    if arch.intermediate_size % size:
        problems.append(f"an intermediate size of {arch.intermediate_size}")
    if arch.moe is not None:
        for what, width in (
            ("an expert intermediate size", arch.moe.expert_intermediate_size),
            ("a shared-expert intermediate size", arch.moe.shared_expert_intermediate_size),
        ):
            if width % size:
                problems.append(f"{what} of {width}")
    if arch.qk_norm == "projection" and size > 1:
        # Its norm's statistics span every head: a worker holding some heads cannot compute it.
        problems.append("q/k norms over the whole projection (OLMoE)")
    if problems:
        raise ValueError(
            f"invalid engine argument tensor_parallel_size={size}: the model has "
            f"{' and '.join(problems)}, which {size} workers cannot split evenly"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """The embedding table's rows ``[start, start + rows)`` on this worker: ids outside them
    give zeros, and the all-reduce adds the worker that holds each id."""

    def __init__(self, rows: int, hidden_size: int, plan: ShardPlan) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, hidden_size))
        self.plan = plan

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        start, rows = self.plan.vocab_start, self.plan.vocab_rows
        local = input_ids - start
        held = (local >= 0) & (local < rows)  # [T]
        out = torch.nn.functional.embedding(local.clamp(0, rows - 1), self.weight)
        out = out * held.unsqueeze(-1).to(out.dtype)
        return self.plan.tp.all_reduce(out)
