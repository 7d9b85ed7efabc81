"""Expert parallelism over real processes (gloo): two ranks, each holding half the experts and
its own tokens, compute exactly what one process holding every expert computes."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from corefleet.engine.models.expert_parallel import ExpertParallel
from corefleet.engine.models.llama import LlamaForCausalLM
from corefleet.engine.models.loader import load_arch_config
from corefleet.engine.models.moe import SparseMoeBlock
from corefleet.engine.models.weights import load_weights
from corefleet.kernels.backend import KernelBackend
from tests.fixtures_moe import write_tiny_moe

pytestmark = pytest.mark.slow

# Tokens per rank: uneven, one rank with a single (dummy-batch-like) token, one with none.
TOKEN_COUNTS = [(5, 1), (1, 7), (0, 3), (4, 4)]


def _model(folder: Path, experts: ExpertParallel | None) -> LlamaForCausalLM:
    arch = load_arch_config(folder)
    model = LlamaForCausalLM(arch, KernelBackend(), 64, experts=experts)
    model.load_weights(load_weights(str(folder), torch.float32, False))
    return model.eval()


def _tokens(rank: int, count: int, hidden: int) -> torch.Tensor:  # [count, H]
    generator = torch.Generator().manual_seed(1000 * rank + count)
    return torch.randn(count, hidden, generator=generator)


def _rank_main(rank: int, folder: str, port: int, result_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        whole = _model(Path(folder), None)
        split = _model(Path(folder), ExpertParallel(rank, 2, None))
        for layer_index, layer in enumerate(split.layers):
            block = layer.mlp  # type: ignore[union-attr]
            if not isinstance(block, SparseMoeBlock):
                continue
            assert len(block.held) == 4 and block.held.start == 4 * rank
            sparse = block.bind(torch.float32)
            reference = whole.layers[layer_index].mlp.bind(torch.float32)  # type: ignore[union-attr,operator]
            for counts in TOKEN_COUNTS:
                x = _tokens(rank, counts[rank], block.router.weight.shape[1])
                with torch.inference_mode():
                    got, expected = sparse(x), reference(x)
                assert got.shape == expected.shape, (got.shape, expected.shape)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        Path(result_dir, f"rank{rank}").write_text("ok")
    except Exception:
        Path(result_dir, f"rank{rank}").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("architecture", ["qwen2_moe", "mixtral"])
def test_two_ranks_holding_half_the_experts_equal_one_holding_all(
    tmp_path: Path, architecture: str
) -> None:
    folder = write_tiny_moe(tmp_path / "m", architecture=architecture, num_experts=8)
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_rank_main, args=(str(folder), _free_port(), str(results)), nprocs=2, join=True)
    assert [(results / f"rank{r}").read_text() for r in range(2)] == ["ok", "ok"]


def test_experts_that_do_not_split_evenly_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="8 experts, which 3 data-parallel ranks cannot split"):
        ExpertParallel(0, 3).experts(8)
