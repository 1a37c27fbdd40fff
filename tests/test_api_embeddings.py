"""POST /v1/embeddings on real servers (float32) through the official `openai` client,
checked against transformers' final hidden states of the same weights: the last token's
(the default pooling) and the mean over the prompt (--pooling-type mean, on a server whose
token budget cuts the longer prompts into chunks), L2-normalized or not, as floats and as
base64, and the 4xx answers for what the route refuses; `add_special_tokens` on a tokenizer
that adds a BOS."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from tokenizers import processors

from service.api.openai_schema import parse_embedding_request
from service.api.routes_embeddings import token_ids_of
from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer
from tests.server_fixtures import RunningServer, cache_dir, start_server, stop_server

pytestmark = pytest.mark.real_model
TOLERANCE = 1e-4  # float32 on both sides, normalized vectors; kernels sum in other orders
INPUTS = [
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b",
    "Ünïcödé, emoji 🙂 and numbers 12345",
    # 170 tokens: three chunks on the mean server's 64-token budget
    " ".join(f"word{i}" for i in range(60)),
]
CHUNK_BUDGET = 64


@pytest.fixture(scope="module")
def hidden_states():
    """The default model in transformers, float32: token ids -> final hidden states [n, d]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(None, cache_dir()), dtype=torch.float32
    ).eval()

    def states(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()

    return states


@pytest.fixture(scope="module")
def mean_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(
        tmp_path_factory.mktemp("mean-pooling"),
        "--pooling-type",
        "mean",
        "--max-batched-tokens",
        str(CHUNK_BUDGET),
    )
    yield server
    stop_server(server)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")


def token_ids(server: RunningServer, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": True}
    return httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]


def normalized(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def test_last_token_embeddings_equal_transformers_final_hidden_state(
    cadence_server: RunningServer, hidden_states
) -> None:
    # the client asks for base64 unless told otherwise, and decodes it
    reply = client(cadence_server).embeddings.create(model=cadence_server.model, input=INPUTS)
    assert [item.index for item in reply.data] == list(range(len(INPUTS)))
    prompts = [token_ids(cadence_server, text) for text in INPUTS]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, prompts))
    for item, ids in zip(reply.data, prompts, strict=True):
        expected = normalized(hidden_states(ids)[-1])
        found = np.asarray(item.embedding)
        assert found.shape == expected.shape
        np.testing.assert_allclose(found, expected, atol=TOLERANCE)
    assert cadence_server.wait_idle()["kv_blocks_used"] == 0


def test_floats_and_base64_are_the_same_vector_and_token_ids_the_same_input(
    cadence_server: RunningServer,
) -> None:
    ids = token_ids(cadence_server, INPUTS[0])
    url = f"{cadence_server.url}/v1/embeddings"
    as_floats = httpx.post(url, json={"input": INPUTS[0]}, timeout=60).json()
    as_base64 = httpx.post(
        url, json={"input": [ids], "encoding_format": "base64"}, timeout=60
    ).json()
    assert as_floats["object"] == "list" and as_floats["model"] == cadence_server.model
    floats = np.asarray(as_floats["data"][0]["embedding"], dtype=np.float32)
    decoded = np.frombuffer(base64.b64decode(as_base64["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(floats, decoded)  # one computation, whatever the batch and the form
    assert abs(np.linalg.norm(floats) - 1) < 1e-5


def test_mean_pooling_over_chunks_equals_the_mean_of_transformers_states(
    mean_server: RunningServer, hidden_states
) -> None:
    raw = client(mean_server).embeddings.create(
        model=mean_server.model,
        input=INPUTS,
        encoding_format="float",
        extra_body={"normalize": False},
    )
    prompts = [token_ids(mean_server, text) for text in INPUTS]
    assert max(map(len, prompts)) > 2 * CHUNK_BUDGET  # the longest takes three chunks
    for item, ids in zip(raw.data, prompts, strict=True):
        expected = hidden_states(ids).mean(axis=0)
        found = np.asarray(item.embedding)
        np.testing.assert_allclose(found, expected, atol=TOLERANCE * np.abs(expected).max())
    # the same prompt again, alone, and its vector normalized: the same bits before normalizing
    again = client(mean_server).embeddings.create(
        model=mean_server.model, input=INPUTS[-1], encoding_format="float"
    )
    np.testing.assert_allclose(
        again.data[0].embedding, normalized(np.asarray(raw.data[-1].embedding)), atol=1e-6
    )
    assert mean_server.wait_idle()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": "hi", "dimensions": 64}, 400, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": [[1, 2, 49152 * 4]]}, 400, "input"),
        ({"input": "hi", "model": "other-model"}, 404, "model"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ],
)
def test_bad_input_is_a_4xx_in_openai_shape(
    cadence_server: RunningServer, body: dict, status: int, param: str
) -> None:
    reply = httpx.post(f"{cadence_server.url}/v1/embeddings", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_prompt_past_the_window_is_refused_unless_truncated(
    cadence_server: RunningServer,
) -> None:
    url = f"{cadence_server.url}/v1/embeddings"
    limit = httpx.get(f"{cadence_server.url}/v1/models", timeout=10).json()["data"][0]
    too_long = [5] * (limit["max_model_len"] + 1)
    refused = httpx.post(url, json={"input": [too_long]}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    cut = httpx.post(url, json={"input": [too_long], "truncate_prompt_tokens": 8}, timeout=60)
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 8


def test_add_special_tokens_reaches_the_tokenizer(tmp_path: Path) -> None:
    """SmolLM2's tokenizer adds nothing either way, so the field is shown on its vocabulary
    with a BOS added as Llama's tokenizers add one: with it by default (vLLM's), without it
    when false; token-id inputs are taken as they are."""
    model_dir = resolve_model(None, cache_dir())
    backend = Tokenizer.from_dir(model_dir).backend
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_bytes(
        (model_dir / "tokenizer_config.json").read_bytes()
    )
    tokenizer = Tokenizer.from_dir(tmp_path)
    plain = tokenizer.encode("one one")
    body = {"input": ["one one", [5, 6]]}
    with_bos = token_ids_of(parse_embedding_request(body, None), tokenizer)
    without = token_ids_of(
        parse_embedding_request({**body, "add_special_tokens": False}, None), tokenizer
    )
    assert with_bos == [[1, *plain], [5, 6]] and without == [plain, [5, 6]]
