"""LoRA adapters through the real server (--enable-lora, two slots), with the official
openai client: adapters made by peft for the served model, named by a request's `model`,
listed by /v1/models, loaded and unloaded at run time (vLLM's routes) while a stream
decodes, refused with a 400 naming the field when they do not fit, served in turn when
more are asked for than there are slots, kept apart in the prefix cache, and refused (403)
to an API key restricted to others. The adapters' numbers (each against transformers + peft,
several in one step) are tests/test_worker_lora.py's; here an adapter's answer is its own,
not the base model's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import peft
import pytest
import transformers
import trio
from transformers.initialization import no_init_weights

from ops.client import ClientConfig, RequestSpec, run_workload
from ops.scenarios import spread_over_adapters
from service.model_files.resolve import resolve_model
from tests.server_fixtures import RunningServer, cache_dir, start_server, stop_server

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FULL_KEY, LIMITED_KEY = "lora-full-key", "lora-limited-key"
PROMPT = "The adapters of one base model share its weights but not their answers, " * 4


def make_adapters(root: Path) -> Path:
    """Rank-8 adapters alpha, beta, gamma (random, non-zero B) of the served model, and one
    of rank 64, in root/<name>."""
    config = transformers.AutoConfig.from_pretrained(resolve_model(None, cache_dir()))
    with no_init_weights():  # only the adapters' own weights matter here
        model = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=8, target_modules=TARGETS, init_lora_weights=False)
    adapted = peft.get_peft_model(model, lora, adapter_name="alpha")
    for name in ("beta", "gamma"):
        adapted.add_adapter(name, lora)
    adapted.add_adapter("rank64", peft.LoraConfig(r=64, target_modules=TARGETS))
    adapted.save_pretrained(root)  # each named adapter in root/<name>
    return root


@pytest.fixture(scope="module")
def adapters_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def lora_server(
    tmp_path_factory: pytest.TempPathFactory, adapters_root: Path
) -> Iterator[RunningServer]:
    root = adapters_root
    log_dir = tmp_path_factory.mktemp("lora-server")
    (log_dir / "keys").write_text(f"{FULL_KEY} team\n{LIMITED_KEY} limited adapters=alpha\n")
    server = start_server(
        log_dir,
        "--enable-lora", "--max-loras", "2", "--enable-prompt-tokens-details",
        "--lora-modules", f"alpha={root / 'alpha'}", "--lora-modules", f"beta={root / 'beta'}",
        "--lora-modules", f'{{"name": "gamma", "path": "{root / "gamma"}"}}',
        "--api-key-file", str(log_dir / "keys"),
        wait=False,
    )  # fmt: skip
    try:
        server.wait_healthy()
        yield server
    finally:
        stop_server(server)


def client(server: RunningServer, key: str = FULL_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def admin(server: RunningServer, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers=server.admin_headers())


def streamed_completion(server: RunningServer, model: str, max_tokens: int = 4) -> str:
    stream = client(server).completions.create(
        model=model, prompt="Once upon a time", max_tokens=max_tokens, stream=True, temperature=0
    )
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {model}
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def test_models_lists_each_adapter_with_the_base_as_parent(lora_server, adapters_root):
    cards = {card.id: card for card in client(lora_server).models.list().data}
    base = next(name for name, card in cards.items() if getattr(card, "parent", None) is None)
    assert sorted(cards) == sorted([base, "alpha", "beta", "gamma"])
    assert {cards[name].parent for name in ("alpha", "beta", "gamma")} == {base}
    assert cards["beta"].root == str(adapters_root / "beta")


def test_completions_and_chat_name_each_adapter_streamed(lora_server):
    base = streamed_completion(lora_server, lora_server.model, max_tokens=8)
    alpha = streamed_completion(lora_server, "alpha", max_tokens=8)
    assert alpha != base and streamed_completion(lora_server, "alpha", max_tokens=8) == alpha
    for name in ("alpha", "beta"):
        assert streamed_completion(lora_server, name)
        stream = client(lora_server).chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
        )
        chunks = list(stream)
        assert {chunk.model for chunk in chunks} == {name}
        assert any(chunk.choices and chunk.choices[0].delta.content for chunk in chunks)
    finished = lora_server.log_events("request.finished")
    assert {"alpha", "beta"} <= {event["adapter"] for event in finished}
    metrics = httpx.get(f"{lora_server.url}/metrics", headers=lora_server.admin_headers()).text
    assert 'cadence:lora_requests_total{adapter="beta"} 2.0' in metrics


def test_an_adapter_loaded_and_unloaded_while_a_stream_decodes(lora_server, adapters_root):
    path = str(adapters_root / "gamma")

    async def scenario() -> None:
        long_stream = await openai.AsyncOpenAI(
            base_url=f"{lora_server.url}/v1", api_key=FULL_KEY, max_retries=0
        ).completions.create(
            model="alpha",
            prompt="Count:",
            max_tokens=24,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        chunks = []
        async for chunk in long_stream:
            chunks.append(chunk)
            if len(chunks) == 2:  # it decodes: the adapters change under it
                await trio.to_thread.run_sync(run_time_changes)
        assert chunks[-1].usage.completion_tokens == 24  # it kept going to the end

    def run_time_changes() -> None:
        assert lora_server.admin_state()["running"] >= 1
        loaded = admin(lora_server, "load_lora_adapter", {"lora_name": "delta", "lora_path": path})
        assert loaded.status_code == 200, loaded.text
        assert streamed_completion(lora_server, "delta", max_tokens=2)
        assert admin(lora_server, "unload_lora_adapter", {"lora_name": "delta"}).status_code == 200
        with pytest.raises(openai.NotFoundError) as gone:
            client(lora_server).completions.create(model="delta", prompt="Hi", max_tokens=1)
        assert "delta" in gone.value.message and gone.value.code == "model_not_found"

    trio.run(scenario)
    assert lora_server.wait_idle()["running"] == 0


def test_adapters_that_do_not_fit_get_a_400_naming_the_field(lora_server, adapters_root, tmp_path):
    def refusal(path: Path) -> dict:
        answer = admin(
            lora_server, "load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)}
        )
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    assert refusal(adapters_root / "rank64")["param"] == "r"  # --max-lora-rank 16
    tiny = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    lora = peft.LoraConfig(r=8, target_modules=TARGETS, init_lora_weights=False)
    peft.get_peft_model(transformers.LlamaForCausalLM(tiny), lora).save_pretrained(tmp_path / "x")
    mismatched = refusal(tmp_path / "x")
    assert mismatched["param"].endswith("lora_A.weight") and "shape" in mismatched["message"]
    (tmp_path / "x" / "adapter_config.json").write_text("{")
    assert refusal(tmp_path / "x")["param"] == "adapter_config.json"
    assert refusal(tmp_path / "missing")["param"] == "lora_path"
    unauthorised = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json={})
    assert unauthorised.status_code == 401


def test_three_adapters_over_two_slots_are_served_in_turn(lora_server):
    async def one(name: str) -> int:
        answer = await openai.AsyncOpenAI(
            base_url=f"{lora_server.url}/v1", api_key=FULL_KEY, max_retries=0
        ).completions.create(
            model=name, prompt=f"{name}:", max_tokens=6, extra_body={"ignore_eos": True}
        )
        return answer.usage.completion_tokens

    async def all_three() -> list[int]:
        counts: list[int] = []
        async with trio.open_nursery() as nursery:
            for name in ("alpha", "beta", "gamma"):
                nursery.start_soon(lambda n=name: _append(counts, one(n)))
        return counts

    assert trio.run(all_three) == [6, 6, 6]  # nothing lost
    corrections = lora_server.admin_state()["corrections"]
    assert corrections.get("adapter_slots_busy", 0) > 0  # admission waited for a slot


async def _append(counts: list[int], answer) -> None:
    counts.append(await answer)


def test_the_same_prompt_under_two_adapters_shares_no_cached_prefix(lora_server):
    def cached(model: str) -> int:
        answer = client(lora_server).completions.create(model=model, prompt=PROMPT, max_tokens=1)
        return answer.usage.prompt_tokens_details.cached_tokens

    cached("alpha")
    assert cached("beta") == 0
    assert cached("alpha") > 0  # caching is on: alpha finds its own prefix


def test_a_key_restricted_to_adapters_gets_403_for_others(lora_server):
    limited = client(lora_server, LIMITED_KEY)
    assert limited.completions.create(model="alpha", prompt="Hi", max_tokens=1).usage
    with pytest.raises(openai.PermissionDeniedError) as refused:
        limited.completions.create(model="beta", prompt="Hi", max_tokens=1)
    assert "beta" in refused.value.message


def test_the_bench_spreads_its_requests_over_adapters(lora_server):
    """`cadence bench throughput --adapters alpha,beta`: request i names adapter i mod 2."""
    specs = [RequestSpec(i, 0.0, f"Prompt {i}", 3, 2) for i in range(4)]
    config = ClientConfig(lora_server.url, lora_server.model, api_key=FULL_KEY)
    run = trio.run(run_workload, config, spread_over_adapters(specs, "alpha,beta"))
    assert [(r.error, r.output_tokens) for r in run.records] == [(None, 2)] * 4
    received = lora_server.log_events("request.received")[-4:]
    assert sorted(event["adapter"] for event in received) == ["alpha", "alpha", "beta", "beta"]


def test_without_enable_lora_adapters_and_their_routes_are_refused(cadence_server):
    """The shared server (no --enable-lora): an adapter's name is an unknown model, and the
    admin routes say what to enable."""
    with pytest.raises(openai.NotFoundError) as unknown:
        client(cadence_server).completions.create(model="alpha", prompt="Hi", max_tokens=1)
    assert unknown.value.code == "model_not_found" and "alpha" in unknown.value.message
    body = {"lora_name": "alpha", "lora_path": "/nowhere"}
    refused = admin(cadence_server, "load_lora_adapter", body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "lora_not_enabled"
