"""Gemma 3 270M, the second packaged model, served end to end: `--model gemma3-270m`, greedy
continuations through /v1/completions equal transformers' on the same converted weights
(float32), and a prompt longer than the 512-token window of its local layers continued as
transformers continues it, where attending beyond the window would continue otherwise.

The server is a KV producer too (which changes nothing for plain requests): a consumer
beside it decodes prompts it hands over (disaggregated prefill and decode through Gemma 3's
six KV groups, with Mooncake's real transfer engine over loopback)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
import transformers

from service.model_files.resolve import fetch_packaged_model
from service.tokenizer import Tokenizer
from tests.server_fixtures import RunningServer, cache_dir, start_server, stop_server

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Water boils at a temperature of",
]
MAX_TOKENS = 8
PRODUCER = ("--kv-transfer-role", "producer", "--debug-invariants")
BLOCK = 16  # the servers' block size on a CPU (the default)
WINDOW = 512  # Gemma 3 270M's windowed layers'


def long_prompt() -> str:
    """About 700 tokens whose continuation depends on what lies outside the window: a
    list of codes, the question at the end naming the first."""
    lines = [f"Item {i}: code {(i * 7919) % 1000:03d}." for i in range(1, 90)]
    return "Remember these codes.\n" + "\n".join(lines) + "\nThe code of item 1 is"


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(
        tmp_path_factory.mktemp("gemma-server"), "--model", "gemma3-270m", *PRODUCER
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def gemma_consumer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(
        tmp_path_factory.mktemp("gemma-consumer"),
        "--model",
        "gemma3-270m",
        "--kv-transfer-role",
        "consumer",
        "--debug-invariants",
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Tokenizer]:
    model_dir = fetch_packaged_model("gemma3-270m", cache_dir(), progress=None)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), Tokenizer.from_dir(model_dir)


def greedy(model: Any, tok: Tokenizer, prompt: str) -> list[int]:
    ids = tok.encode(prompt, add_special_tokens=True)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=tok.eos_token_ids,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def complete(server: RunningServer, prompt: str) -> str:
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def test_greedy_continuations_equal_transformers(
    gemma_server: RunningServer, reference: tuple[Any, Tokenizer]
) -> None:
    model, tok = reference
    assert gemma_server.model == "gemma3-270m"
    for prompt in PROMPTS:
        want = tok.decode(greedy(model, tok, prompt))
        assert complete(gemma_server, prompt) == want, prompt


def test_prompt_beyond_the_window_continues_as_transformers(
    gemma_server: RunningServer, reference: tuple[Any, Tokenizer]
) -> None:
    model, tok = reference
    prompt = long_prompt()
    assert len(tok.encode(prompt, add_special_tokens=True)) > 600 > model.config.sliding_window
    windowed = greedy(model, tok, prompt)
    # The same weights with every layer attending to the whole prompt continue otherwise:
    # so the equality below holds only if cadence's local layers keep to their window.
    window = model.config.sliding_window
    try:
        model.config.sliding_window = 1 << 20  # read by transformers' masks at each call
        assert greedy(model, tok, prompt) != windowed
    finally:
        model.config.sliding_window = window
    assert complete(gemma_server, prompt) == tok.decode(windowed)


def test_a_long_prompt_holds_the_full_layers_blocks_and_the_windows_of_the_others(
    gemma_server: RunningServer, reference: tuple[Any, Tokenizer]
) -> None:
    """3,335 tokens: Gemma 3 270M's 3 full layers keep a block per 16 positions, its
    15 windowed layers (5 KV groups of 3: gpu_worker.kv_groups) only their 512-token
    windows, where a cache of all 18 layers in one group would hold 6 blocks per entry."""
    _, tok = reference
    lines = [f"Entry {i}: the value is {(i * 7919) % 1000:03d}." for i in range(1, 230)]
    prompt = "\n".join(lines) + "\nThe value of entry 1 is"
    tokens = len(tok.encode(prompt, add_special_tokens=True))
    assert tokens > 2600
    before = len(gemma_server.log_file.read_text().splitlines())
    complete(gemma_server, prompt)
    records = [json.loads(line) for line in gemma_server.log_file.read_text().splitlines()]
    steps = [r for r in records[before:] if r.get("event") == "iteration"]
    entries = -(-(tokens + MAX_TOKENS) // 16)  # --block-size 16, the default
    cap = -(-(511 + 512) // 16) + 1  # a window's blocks and a 512-token chunk's
    most = max(step["kv_blocks_used"] for step in steps)
    assert most <= entries + 5 * cap < 0.55 * 6 * entries
    window = -(-512 // 16) + 1
    assert steps[-1]["kv_blocks_used"] <= entries + 5 * window < 0.35 * 6 * entries


def test_prompts_handed_over_to_a_consumer_answer_as_one_server(
    gemma_server: RunningServer, gemma_consumer: RunningServer
) -> None:
    """Both stages driven directly, as vllm-router drives them, in float32: the consumer's
    greedy answers equal the producer's own, for a prompt past the window too; a windowed
    group hands over only its window's blocks; both prefix caches hold the prompt's blocks
    (the producer's held ones: a plain request's hit; the consumer's pulled ones: the next
    handover's); every hold is released by its notice, and no block is left used."""
    producer, consumer = gemma_server, gemma_consumer
    held = holds(producer)
    for prompt in (PROMPTS[0], long_prompt()):
        params, prompt_tokens = hand_over(producer, prompt)
        hit = (prompt_tokens - 1) // BLOCK * BLOCK  # a later same prompt's cached tokens
        entries = -(-prompt_tokens // BLOCK)
        first = max(0, hit - WINDOW + 1) // BLOCK  # the windowed groups' first entry sent
        assert [len(ids) for ids in params["remote_block_ids"]] == [entries] + [entries - first] * 5
        alone = completion(producer, prompt)  # one server's answer: the held blocks its hit
        assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
        handed = completion(consumer, prompt, kv_transfer_params=params)
        assert handed["choices"][0]["text"] == alone["choices"][0]["text"], prompt
    assert first > 0  # the long prompt's windows left blocks behind
    # the consumer's pulled blocks are its hit: the long prompt's next handover pulls the rest
    again = completion(consumer, long_prompt(), kv_transfer_params=hand_over(producer, prompt)[0])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    assert again["choices"][0]["text"] == alone["choices"][0]["text"]
    for server in (producer, consumer):
        assert server.wait_idle()["kv_blocks_used"] == 0  # the holds' blocks too
    assert holds(producer) == {**held, "held": held["held"] + 3, "released": held["released"] + 3}


def hand_over(producer: RunningServer, prompt: str) -> tuple[dict, int]:
    """Stage 1: the producer's kv_transfer_params for `prompt`, and its prompt tokens."""
    answer = completion(
        producer, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    return answer["kv_transfer_params"], answer["usage"]["prompt_tokens"]


def completion(server: RunningServer, prompt: str, **fields: object) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def holds(producer: RunningServer) -> dict[str, int]:
    return producer.admin_state()["kv_transfer"]["holds"]
