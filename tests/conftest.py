"""Fixtures any test module takes by name, without importing them: the tiny random Llama
of the worker tests and their one-thread setting (tests.worker_fixtures)."""

from tests.worker_fixtures import one_torch_thread, tiny_llama_dir

__all__ = ["one_torch_thread", "tiny_llama_dir"]
