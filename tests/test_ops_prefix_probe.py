"""`cadence bench prefix`: one document, then questions about it, sent one at a time."""

import itertools

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


async def test_the_probe_sends_the_document_with_each_question_then_the_first_again(
    nursery, tmp_path, tokenizer_json, capsys
):
    server = FakeServer(cached_tokens=3)
    await nursery.start(server.serve)
    argv = ["prefix", "--url", server.url, "--tokenizer", tokenizer_json, "--out", str(tmp_path),
            "--prefix-len", "60", "--questions", "3", "--question-len", "5",
            "--max-tokens", "2"]  # fmt: skip
    assert await run_main(argv) == 0
    prompts = [body["prompt"] for body in server.bodies]
    assert len(prompts) == 4 and prompts[3] == prompts[0]
    document = prompts[0].rsplit("\n", 1)[0]
    assert all(p.startswith(document + "\n") for p in prompts)
    assert len({p[len(document) :] for p in prompts}) == 3  # three different questions
    assert all(body["stream"] and body["max_tokens"] == 2 for body in server.bodies)
    records = orjson.loads((tmp_path / "prefix.json").read_bytes())["records"]
    assert [r["cached_tokens"] for r in records] == [3, 3, 3, 3]
    # one at a time: each request was sent after the one before had ended
    assert all(b["send_s"] >= a["end_s"] for a, b in itertools.pairwise(records))
    out = capsys.readouterr().out
    assert "first again" in out and "TTFT / first's" in out and "1.000" in out


async def test_bad_flags_exit_2_before_sending(nursery, tmp_path, tokenizer_json):
    server = FakeServer()
    await nursery.start(server.serve)
    argv = ["prefix", "--url", server.url, "--tokenizer", tokenizer_json, "--questions", "0"]
    assert await run_main(argv) == 2 and server.bodies == []
