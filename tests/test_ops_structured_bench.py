"""`cadence bench structured`: the same free requests alone, beside constrained requests, and
beside unconstrained ones as long as the constrained answers were."""

import orjson
import pytest
import trio

from ops.commands import bench
from tests.ops_fakes import FakeServer, train_tokenizer_json


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return str(train_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


async def run_main(argv: list[str]) -> int:
    return await trio.to_thread.run_sync(bench, argv)


async def test_three_rounds_put_the_same_tokens_beside_the_free_requests(
    nursery, tmp_path, tokenizer_json, capsys
):
    server = FakeServer()
    await nursery.start(server.serve)
    argv = ["structured", "--url", server.url, "--tokenizer", tokenizer_json, "--out",
            str(tmp_path), "--requests", "2", "--beside", "3", "--prompt-len", "20",
            "--max-tokens", "4"]  # fmt: skip
    assert await run_main(argv) == 0
    bodies = server.bodies
    assert len(bodies) == 1 + 2 + 5 + 5  # a constrained warm-up, then the rounds
    constrained = [b for b in bodies if "response_format" in b]
    assert len(constrained) == 1 + 3
    assert all(b["response_format"]["type"] == "json_schema" for b in constrained)
    rounds = orjson.loads((tmp_path / "structured.json").read_bytes())["rounds"]
    assert list(rounds) == ["alone", "constrained beside", "unconstrained beside"]
    lengths = [
        r["completion_tokens"] for r in rounds["constrained beside"] if r["role"] == "beside"
    ]
    again = [r["max_tokens"] for r in rounds["unconstrained beside"] if r["role"] == "beside"]
    assert again == lengths
    prompts = [b["prompt"] for b in bodies]
    assert len(set(prompts)) == len(prompts)  # no round finds another's in a prefix cache
    out = capsys.readouterr().out
    assert "free tok/s" in out and "constrained beside" in out


async def test_bad_flags_exit_2_before_sending(nursery, tmp_path, tokenizer_json):
    server = FakeServer()
    await nursery.start(server.serve)
    argv = ["structured", "--url", server.url, "--tokenizer", tokenizer_json, "--beside", "0"]
    assert await run_main(argv) == 2 and server.bodies == []
