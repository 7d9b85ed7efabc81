"""The sparse MLP of a mixture-of-experts decoder layer (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

A router scores every token against every expert; each token runs its ``top_k`` experts (SwiGLU
MLPs) and sums their outputs weighted by the router's probabilities. The experts' weights are
stacked, ``w13`` ``[E, 2I, H]`` (gate rows then up rows, as the dense MLP's fused gate|up) and
``w2`` ``[E, H, I]``, so the kernel backend's ``fused_moe`` runs all of them at once. Qwen2-MoE
adds a dense "shared expert" every token runs, scaled by a sigmoid gate.

Loading names: a checkpoint's ``mlp.experts.{e}.gate_proj`` (Mixtral: ``block_sparse_moe.experts.
{e}.w1``) goes to row block ``gate:{e}`` of ``mlp.w13``, and so on (``moe_hf_name``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from corefleet.engine.models.arch import ArchConfig, MoESpec
from corefleet.engine.models.expert_parallel import ExpertParallel
from corefleet.kernels.backend import KernelBackend

Mlp = Callable[[torch.Tensor], torch.Tensor]  # [T, H] -> [T, H]

# A checkpoint's expert tensor: layer prefix, expert index, projection (HF or Mixtral name).
_EXPERT = re.compile(
    r"^(?P<prefix>.*\.)(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_PROJ_SHARD = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] float32, expert ids [T, K] int64
    """Each token's ``top_k`` experts and their weights: the softmax over all experts (in
    float32), its ``top_k`` largest, renormalised to sum to 1 when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_hf_name(hf_name: str) -> tuple[str, str] | None:
    """A checkpoint's expert tensor -> (our stacked parameter, its block: ``gate:{e}``,
    ``up:{e}`` or ``down:{e}``); None for any other tensor."""
    match = _EXPERT.match(hf_name)
    if match is None:
        return None
    prefix, expert, proj = match["prefix"], match["expert"], match["proj"]
    if proj in ("down_proj", "w2"):
        return f"{prefix}mlp.w2", f"down:{expert}"
    return f"{prefix}mlp.w13", f"{_PROJ_SHARD[proj]}:{expert}"


def expert_block(param: torch.Tensor, block: str, held: range) -> torch.Tensor | None:
    """The rows of a stacked expert parameter that checkpoint block ``block`` fills: expert
    ``e``'s gate (the first half of ``w13[e]``), up (the second half) or down (``w2[e]``);
    None when this rank does not hold expert ``e`` (``held``: the experts it holds, in order)."""
    part, _, expert = block.partition(":")
    if int(expert) not in held:
        return None
    rows = param[int(expert) - held.start]  # [2I, H] or [H, I]
    if part == "down":
        return rows
    half = rows.shape[0] // 2
    return rows.narrow(0, 0 if part == "gate" else half, half)


def expert_blocks(name: str, held: range) -> list[str]:
    """The checkpoint blocks that fill the stacked parameter ``name`` holding the experts
    ``held`` (``_check_complete``)."""
    experts = held
    if name.endswith("mlp.w2"):
        return [f"down:{e}" for e in experts]
    return [f"{part}:{e}" for e in experts for part in ("gate", "up")]


class SparseMoeBlock(nn.Module):
    """A layer's router, stacked experts and (Qwen2-MoE) shared expert; ``bind`` runs them.

    ``shared_expert`` is built by the caller (a dense SwiGLU MLP module with ``bind``), so this
    module needs no knowledge of linear layers or quantization. Under expert parallelism
    (``experts``) it holds only this rank's experts, ``held``.
    """

    def __init__(
        self,
        cfg: ArchConfig,
        spec: MoESpec,
        backend: KernelBackend,
        shared_expert: nn.Module | None,
        experts: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        hidden, size = cfg.hidden_size, spec.expert_intermediate_size
        self.spec = spec
        self.backend = backend
        self.ep = experts if experts is not None and experts.enabled else None
        self.held = self.ep.experts(spec.num_experts) if self.ep else range(spec.num_experts)
        self.router = nn.Linear(hidden, spec.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(len(self.held), 2 * size, hidden))
        self.w2 = nn.Parameter(torch.empty(len(self.held), hidden, size))
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            nn.Linear(hidden, 1, bias=False) if shared_expert is not None else None
        )

    def bind(self, dtype: torch.dtype) -> Mlp:
        """The block's forward pass as a closure over its current weights (``layer_program``)."""
        backend, spec = self.backend, self.spec
        router, w13, w2 = self.router.weight, self.w13, self.w2
        shared: Mlp | None = None
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert.bind(dtype)  # type: ignore[operator]
            shared_gate = self.shared_expert_gate.weight  # [1, H]

        def experts(x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
            weights, ids = route(backend.linear(x, router, None), spec.top_k, spec.renormalize)
            return backend.fused_moe(x, w13, w2, weights, ids)

        run_experts = experts if self.ep is None else self._expert_parallel(experts)

        def forward(x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
            out = run_experts(x)
            if shared is not None:
                out = out + torch.sigmoid(backend.linear(x, shared_gate, None)) * shared(x)
            return out

        return forward

    def _expert_parallel(self, local: Mlp) -> Mlp:
        """``local`` (the experts this rank holds, over tokens it is given) run on every rank's
        tokens, each rank keeping its own tokens' sums (``expert_parallel``)."""
        ep, spec, held, backend = self.ep, self.spec, self.held, self.backend
        assert ep is not None
        router, w13, w2 = self.router.weight, self.w13, self.w2

        def forward(x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
            gathered = ep.gather(x)  # every rank's tokens: [S * M, H]
            every = gathered.x
            weights, ids = route(backend.linear(every, router, None), spec.top_k, spec.renormalize)
            # Other ranks' experts, and the padding rows' choices, are skipped (-1).
            mine = (ids >= held.start) & (ids < held.stop) & gathered.valid().unsqueeze(1)
            local_ids = torch.where(mine, ids - held.start, -1)  # [S * M, K]
            partial = backend.fused_moe(every, w13, w2, weights, local_ids)  # [S * M, H]
            return ep.combine(partial, gathered)  # [T, H]

        return forward
