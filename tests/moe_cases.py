"""Random mixture-of-experts layers and routings for the fused-MoE kernel tests (CPU op, Triton
under the interpreter, Triton on a GPU), and a dense oracle for the reference itself.

A case is the inputs of ``KernelBackend.fused_moe``: x [T, H], w13 [E, 2I, H], w2 [E, H, I],
topk_weights [T, K] float32 and topk_ids [T, K]. Routings cover what a router and expert
parallelism produce: top-k of random logits (distinct experts per token), ids of -1 (another
rank's experts), an expert no token chose, every token on one expert, a token with the same
expert twice, and no expert at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (rtol, atol) against the reference. float32: summation order only. 16-bit: a different
# summation order can move a projection's output by one rounding, which the next layers carry.
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
ROUTINGS = ("topk", "skipped", "unused_expert", "one_expert", "repeated", "none")


@dataclass
class MoECase:
    x: torch.Tensor  # [T, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    topk_weights: torch.Tensor  # [T, K] float32
    topk_ids: torch.Tensor  # [T, K] int64 (int32 where asked)

    def args(self) -> tuple[torch.Tensor, ...]:
        """The five arguments of ``fused_moe``, in order."""
        return self.x, self.w13, self.w2, self.topk_weights, self.topk_ids

    def to(self, device: torch.device) -> MoECase:
        """The same case on ``device``."""
        return MoECase(*(t.to(device) for t in self.args()))


def moe_case(
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype,
    routing: str = "topk",
    *,
    seed: int = 0,
    ids_dtype: torch.dtype = torch.int64,
) -> MoECase:
    """Weights scaled so every projection's output is O(1); ``routing`` one of ``ROUTINGS``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)  # [T, H]
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)  # [T, E]
    if routing == "unused_expert":
        logits[:, experts // 2] = float("-inf")  # the router never picks it
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)  # [T, K] each
    if routing == "skipped":  # expert parallelism: other ranks' experts arrive as -1
        ids = torch.where(torch.rand(tokens, top_k, generator=gen) < 0.4, -1, ids)
    elif routing == "one_expert":  # every token's first choice is the same expert
        ids[:, 0] = experts - 1
        if top_k > 1:
            ids[:, 1:] = torch.where(ids[:, 1:] == experts - 1, 0, ids[:, 1:])
    elif routing == "repeated":  # a token that names one expert twice: both count
        ids[:, -1] = ids[:, 0]
    elif routing == "none":
        ids[:] = -1
    elif routing not in ("topk", "unused_expert"):
        raise ValueError(f"unknown routing {routing!r}")
    return MoECase(x, w13, w2, weights.contiguous(), ids.to(ids_dtype).contiguous())


def dense_moe(case: MoECase) -> torch.Tensor:  # [T, H] float64
    """The layer token by token in float64, no rounding anywhere: an oracle for the reference
    written without its per-expert grouping."""
    x, w13, w2 = case.x.double(), case.w13.double(), case.w2.double()
    num_experts, inter = w2.shape[0], w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)  # [T, H]
    for t in range(x.shape[0]):
        for k in range(case.topk_ids.shape[1]):
            e = int(case.topk_ids[t, k])
            if not 0 <= e < num_experts:
                continue
            proj = w13[e] @ x[t]  # [2I]
            hidden = torch.nn.functional.silu(proj[:inter]) * proj[inter:]  # [I]
            out[t] += float(case.topk_weights[t, k]) * (w2[e] @ hidden)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same shape and dtype, values within ``TOLERANCE`` of the expected dtype."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol, atol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)
