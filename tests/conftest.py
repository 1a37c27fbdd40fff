"""Fixtures any test module takes by name, without importing them: the tiny random Llama
of the worker tests (and of the other architectures, tiny_models) and their one-thread
setting (tests.worker_fixtures), the default model converted once (tests.model_fixtures),
and the real servers the API tests share (tests.server_fixtures).

After collection the objects that exist (every imported module, every collected test) are
frozen out of the garbage collector's reach: the worker collects garbage each time it loads
a model (gpu_worker.runtime), and in this process a full collection walked them all, most
of the start of each of the suite's many in-process runners (a tiny model's: 0.4 s of
0.45 s in a bare script, more here). The objects tests make are collected as before."""

import gc

import pytest

from tests.model_fixtures import default_model_dir
from tests.server_fixtures import (
    cadence_server,
    cadence_server_bf16,
    one_at_a_time,
    server_of_each_dtype,
    watched_server,
)
from tests.worker_fixtures import one_torch_thread, tiny_llama_dir, tiny_models

__all__ = [
    "cadence_server",
    "cadence_server_bf16",
    "default_model_dir",
    "one_at_a_time",
    "one_torch_thread",
    "server_of_each_dtype",
    "tiny_llama_dir",
    "tiny_models",
    "watched_server",
]


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()
