"""`cadence bench speculation`: repetitive and free tasks, one stream at a time, with the
server's draft counters."""

import itertools

import orjson
import trio

from ops.commands import bench
from tests.ops_fakes import FakeServer


async def run_main(argv: list[str]) -> int:
    return await trio.to_thread.run_sync(bench, argv)


async def test_each_task_goes_one_at_a_time_and_reports_the_acceptance(nursery, tmp_path, capsys):
    server = FakeServer(metrics_prefix="cadence:", drafted=8, accepted=6)
    await nursery.start(server.serve)
    argv = ["speculation", "--url", server.url, "--out", str(tmp_path), "--requests", "2",
            "--max-tokens", "5"]  # fmt: skip
    assert await run_main(argv) == 0
    asked = [body["messages"][-1]["content"] for body in server.bodies]
    assert len(asked) == 6
    assert all("Rename" in text and ("def " in text or "class " in text) for text in asked[:2])
    assert all("word for word" in text for text in asked[2:4])
    assert asked[4] != asked[5]
    # greedy and free to stop: a server with and without drafts answers the same tokens
    assert all(b["temperature"] == 0 and b["ignore_eos"] is False for b in server.bodies)
    document = orjson.loads((tmp_path / "speculation.json").read_bytes())
    tasks = document["tasks"]
    assert [t["task"] for t in tasks] == ["edit", "quote", "free"]
    assert [(t["drafted"], t["accepted"]) for t in tasks] == [(16, 12)] * 3
    records = [r for t in tasks for r in t["records"]]
    assert all(b["send_s"] >= a["end_s"] for a, b in itertools.pairwise(records))
    out = capsys.readouterr().out
    assert "75.0%" in out and "tokens/s" in out


async def test_a_server_without_counters_shows_no_acceptance(nursery, tmp_path, capsys):
    server = FakeServer()  # /metrics is a 404, as on llama-server without --metrics
    await nursery.start(server.serve)
    argv = ["speculation", "--url", server.url, "--out", str(tmp_path), "--task", "free",
            "--requests", "1", "--max-tokens", "3"]  # fmt: skip
    assert await run_main(argv) == 0
    (task,) = orjson.loads((tmp_path / "speculation.json").read_bytes())["tasks"]
    assert task["drafted"] is None and task["accepted"] is None
    assert len(server.bodies) == 1


async def test_bad_flags_exit_2_before_sending(nursery, tmp_path):
    server = FakeServer()
    await nursery.start(server.serve)
    argv = ["speculation", "--url", server.url, "--requests", "0"]
    assert await run_main(argv) == 2 and server.bodies == []
