"""Tests marked `cuda` run where PyTorch sees a CUDA device and are skipped elsewhere: the
only skip the suite allows (a GPU host runs them, `pytest tests/gpu`)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    no_device = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # not a parameter id "cuda"
            item.add_marker(no_device)
