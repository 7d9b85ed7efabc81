"""A message type and array/tensor assertions shared by the msgpack codec tests."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch


class Carrier(msgspec.Struct):
    a: np.ndarray
    b: Any
    c: list[int]


def assert_same_array(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def assert_same_tensor(got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(got, want)
