"""Fixtures any test module takes by name, without importing them: the tiny random Llama
of the worker tests (and of the other architectures, tiny_models) and their one-thread
setting (tests.worker_fixtures), the default model converted once (tests.model_fixtures),
and the real servers the API tests share (tests.server_fixtures)."""

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
