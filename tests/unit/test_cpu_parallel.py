"""The C++ ops' own parallel loop (csrc/parallel.h): the same answer on any number of threads,
from several calling threads at once, and across changes of torch's thread count.

The loop hands chunks to whichever thread claims them first, so which thread computes what
changes from call to call; the ops must not depend on it. Each output element is computed by
one chunk in a fixed order, so results are compared bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from tests.cpu_ops_support import load_cpu_ops_or_skip

OPS = load_cpu_ops_or_skip()


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _linear_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 576, generator=gen)  # [M, K]: a decode step of eight rows
    weight = torch.randn(1536, 576, generator=gen)  # [N, K]: 24 bands of 64 rows
    bias = torch.randn(1536, generator=gen)  # [N]
    return x, weight, bias


def _attention_case(
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, hq, hkv, d, block, blocks = 13, 9, 3, 64, 16, 64
    query = torch.randn(batch, hq, d, generator=gen)  # [B, Hq, D]
    k_cache = torch.randn(blocks, block, hkv, d, generator=gen)  # [blocks, bs, Hkv, D]
    v_cache = torch.randn(blocks, block, hkv, d, generator=gen)  # [blocks, bs, Hkv, D]
    table = torch.randperm(blocks, generator=gen)[: batch * 4].reshape(batch, 4)  # [B, 4]
    lens = torch.randint(1, 4 * block + 1, (batch,), generator=gen)  # [B] uneven rows
    return query, k_cache, v_cache, table, lens


@pytest.mark.parametrize("threads", [2, 3, 5, 16])  # up to many more threads than cores
def test_any_thread_count_gives_the_single_thread_answer(threads: int, restore_threads) -> None:
    x, weight, bias = _linear_case(1)
    attention = _attention_case(2)
    logits = torch.randn(7, 49152, generator=torch.Generator().manual_seed(3))  # [B, V]
    torch.set_num_threads(1)
    linear_1 = OPS.small_linear(x, weight, bias)
    attention_1 = OPS.paged_attention(*attention, 0.125)
    argmax_1 = OPS.argmax_rows(logits)

    torch.set_num_threads(threads)
    for _ in range(20):  # chunks go to different threads from call to call
        assert torch.equal(OPS.small_linear(x, weight, bias), linear_1)
        assert torch.equal(OPS.paged_attention(*attention, 0.125), attention_1)
        assert torch.equal(OPS.argmax_rows(logits), argmax_1)


def test_calls_from_several_threads_at_once_are_all_right(restore_threads) -> None:
    """One call uses the pool; the others, arriving meanwhile, run on their own thread."""
    torch.set_num_threads(2)
    cases = [_linear_case(seed) for seed in range(4)]
    expected = [torch.nn.functional.linear(x, w, b) for x, w, b in cases]
    wrong: list[int] = []
    errors: list[BaseException] = []

    def caller(index: int) -> None:
        x, weight, bias = cases[index]
        try:
            for _ in range(50):
                out = OPS.small_linear(x, weight, bias)
                if not torch.allclose(out, expected[index], rtol=1e-5, atol=1e-4):
                    wrong.append(index)
        except BaseException as exc:  # surfaced below: a thread's exception is lost otherwise
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    assert not errors and not wrong


def test_thread_count_changes_between_calls_resize_the_pool(restore_threads) -> None:
    x, weight, bias = _linear_case(4)
    expected = torch.nn.functional.linear(x, weight, bias)
    for threads in [2, 4, 1, 3, 2, 6, 2]:
        torch.set_num_threads(threads)
        out = OPS.small_linear(x, weight, bias)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_an_error_in_a_chunk_is_raised_to_the_caller_and_the_pool_goes_on(
    threads: int, restore_threads
) -> None:
    """A chunk's check fails on whichever thread runs it: the caller gets the error (a helper
    thread must not end the process), and the next call works."""
    torch.set_num_threads(threads)
    query, k_cache, v_cache, table, lens = _attention_case(5)
    good = OPS.paged_attention(query, k_cache, v_cache, table, lens, 0.125)
    bad_table = table.clone()
    bad_table[:, 0] = k_cache.shape[0] + 7  # every row's first block is out of range
    for _ in range(5):
        with pytest.raises(RuntimeError, match="out of range"):
            OPS.paged_attention(query, k_cache, v_cache, bad_table, lens, 0.125)
        assert torch.equal(OPS.paged_attention(query, k_cache, v_cache, table, lens, 0.125), good)
