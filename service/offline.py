"""Offline generation for scripts and benchmarks, the way `vllm.LLM` is used.

    from service.engine.request import SamplingParams, SamplingSpec

    llm = LLM()                     # the default model, fetched and converted once
    greedy = SamplingParams(max_tokens=32, sampling=SamplingSpec(temperature=0))
    outs = llm.generate(["Hello"], greedy)

It runs the very engine the server runs (service.engine.assembly.open_engine) inside one
trio.run per generate() call; the worker process starts and stops with that call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import trio

from service.config import Config
from service.engine.assembly import open_engine
from service.engine.request import FinishEvent, SamplingParams, TokenEvent
from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    finish_detail: str
    prompt_token_ids: list[int]
    error: str | None = None


class LLM:
    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        known = {f.name for f in dataclasses.fields(Config)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown config option(s) {unknown}; see service.config.Config")
        self.config = Config(model=model, **overrides)
        self.model_dir = resolve_model(model, self.config.cache_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, in order. Text prompts are tokenized as given."""
        token_lists = [self._tokens(p) for p in prompts]
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(token_lists)
        else:
            params_list = list(params)
            if len(params_list) != len(token_lists):
                raise ValueError("give one SamplingParams, or one per prompt")
        return trio.run(self._generate, token_lists, params_list)

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return list(prompt)
        raise TypeError("a prompt is a string or a list of token ids")

    async def _generate(
        self, token_lists: list[list[int]], params_list: list[SamplingParams]
    ) -> list[Completion]:
        # everything is submitted at once: the queue must hold all of it
        config = dataclasses.replace(
            self.config,
            max_queue=max(self.config.max_queue, len(token_lists)),
            max_queued_tokens=max(self.config.max_queued_tokens, sum(map(len, token_lists))),
        )
        results: list[Completion | None] = [None] * len(token_lists)
        async with (
            open_engine(config, model_dir=self.model_dir, tokenizer=self.tokenizer) as engine,
            trio.open_nursery() as readers,
        ):
            for i, (ids, params) in enumerate(zip(token_lists, params_list, strict=True)):
                channel = await engine.submit(ids, params, request_id=f"offline-{i}")
                readers.start_soon(self._read, channel, ids, results, i)
        return [r for r in results if r is not None]

    @staticmethod
    async def _read(
        channel: trio.MemoryReceiveChannel,
        prompt: list[int],
        results: list[Completion | None],
        index: int,
    ) -> None:
        text: list[str] = []
        ids: list[int] = []
        async for event in channel:
            if isinstance(event, TokenEvent):
                text.append(event.text)
                ids.extend(event.token_ids)
            elif isinstance(event, FinishEvent):
                results[index] = Completion(
                    "".join(text), ids, event.reason, event.detail, prompt, event.error
                )
