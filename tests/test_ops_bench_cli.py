"""`cadence bench` and `cadence bench compare` end to end against a fake streaming server."""

import orjson
import pytest
import trio

from ops.commands import bench as main
from ops.prompts import load_codec
from tests.ops_fakes import FakeServer, train_tokenizer_json

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return str(train_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def interference_args(url, tokenizer_json, out):
    return [
        "--url",
        url,
        "--tokenizer",
        tokenizer_json,
        "--out",
        str(out),
        "--seed",
        "7",
        "--decoders",
        "2",
        "--decoder-tokens",
        "60",
        "--inject",
        "20@0.05,300@0.1",
        "--injected-tokens",
        "3",
        "--slo-ttft-ms",
        "5000",
        "--slo-itl-p99-ms",
        "500",
    ]


async def run_main(argv):
    return await trio.to_thread.run_sync(main, argv)


async def test_interference_run_writes_json_table_and_plots(
    nursery, tmp_path, tokenizer_json, capsys, monkeypatch
):
    server = FakeServer()
    await nursery.start(server.serve)
    out = tmp_path / "run"
    monkeypatch.setenv("CADENCE_API_KEY", "sk-bench-key")  # as --api-key's default
    assert (
        await run_main(["interference", *interference_args(server.url, tokenizer_json, out)]) == 0
    )
    assert {h.get("authorization") for h in server.headers} == {"Bearer sk-bench-key"}

    doc = orjson.loads((out / "bench.json").read_bytes())
    assert doc["scenario"] == "interference" and doc["model"] == "fake-model"
    assert doc["config"]["seed"] == 7 and doc["config"]["inject"] == "20@0.05,300@0.1"
    assert (
        "api_key" not in doc["config"] and b"sk-bench-key" not in (out / "bench.json").read_bytes()
    )
    requests = doc["requests"]
    assert [r["role"] for r in requests] == ["decoder", "decoder", "injected", "injected"]
    decoders = requests[:2]
    assert all(len(r["chunk_times"]) == 60 and r["error"] is None for r in decoders)
    assert doc["summary"]["succeeded"] == 4 and doc["summary"]["output_tokens"] == 126
    assert doc["summary"]["goodput_requests"] == 4
    windows = doc["interference"]
    assert [w["prompt_len"] for w in windows] == [20, 300]
    assert all(w["decoders_active"] == 2 and w["injected_ttft_ms"] > 0 for w in windows)
    # the prompts sent are text of exactly the requested token lengths
    codec = load_codec(tokenizer_json)
    sent = sorted(len(codec.encode(b["prompt"])) for b in server.bodies)
    assert sent == sorted(r["prompt_len"] for r in requests) == [20, 64, 64, 300]

    printed = capsys.readouterr().out
    assert "decoder ITL max ms" in printed and "TTFT ms" in printed and "goodput" in printed
    assert (out / "summary.txt").read_text().strip() in printed
    for image in ("token_gaps.png", "itl_cdf.png", "ttft_by_prompt_len.png"):
        data = (out / image).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


async def test_compare_runs_the_same_workload_and_prints_ratios(
    nursery, tmp_path, tokenizer_json, capsys
):
    fast, slow = FakeServer(token_gap_s=0.004), FakeServer(token_gap_s=0.012)
    await nursery.start(fast.serve)
    await nursery.start(slow.serve)
    out = tmp_path / "cmp"
    argv = [
        "compare",
        "--scenario",
        "throughput",
        "--url",
        fast.url,
        "--url",
        slow.url,
        "--label",
        "fast",
        "--label",
        "slow",
        "--requests",
        "3",
        "--prompt-len",
        "10:40",
        "--output-len",
        "12",
        "--tokenizer",
        tokenizer_json,
        "--out",
        str(out),
        "--no-plots",
    ]
    assert await run_main(argv) == 0
    assert [b["prompt"] for b in fast.bodies] != []
    assert sorted(b["prompt"] for b in fast.bodies) == sorted(b["prompt"] for b in slow.bodies)

    table = (out / "compare.txt").read_text()
    assert "slow / fast" in table
    # the table's ratio is the one between the two runs' own summaries (no timing claim)
    itl = [
        orjson.loads((out / label / "bench.json").read_bytes())["summary"]["itl_ms"]["p50"]
        for label in ("fast", "slow")
    ]
    itl_row = next(line for line in table.splitlines() if line.startswith("ITL p50 ms"))
    assert itl_row.split()[-1] == f"{itl[1] / itl[0]:.2f}"
    doc = orjson.loads((out / "compare.json").read_bytes())
    assert [e["label"] for e in doc["entries"]] == ["fast", "slow"]
    assert table.strip() in capsys.readouterr().out


async def test_compare_sets_a_policy_before_each_entry(nursery, tmp_path, tokenizer_json, capsys):
    server = FakeServer()
    await nursery.start(server.serve)
    argv = ["compare", "--scenario", "poisson", "--rate", "20", "--duration", "0.2",
            "--prompt-len", "8", "--output-len", "4",
            "--url", server.url, "--policy", "fcfs",
            "--url", server.url, "--policy", 'stall_free:{"token_budget": 64}',
            "--admin-token", "sekret",
            "--tokenizer", tokenizer_json, "--out", str(tmp_path)]  # fmt: skip
    assert await run_main(argv) == 0
    assert server.policy_puts == [
        ({"name": "fcfs", "params": {}}, "Bearer sekret"),
        ({"name": "stall_free", "params": {"token_budget": 64}}, "Bearer sekret"),
    ]
    table = (tmp_path / "compare.txt").read_text()
    assert "stall_free / fcfs" in table
    bad = ["compare", "--scenario", "poisson", "--url", server.url, "--policy", "fcfs:{oops"]
    assert await run_main([*bad, "--tokenizer", tokenizer_json]) == 2
    assert "are not JSON" in capsys.readouterr().err
    assert len(server.policy_puts) == 2


async def test_bad_arguments_and_unreachable_server_are_clean_errors(
    tmp_path, tokenizer_json, capsys
):
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    for listener in listeners:
        await listener.aclose()
    base = ["--tokenizer", tokenizer_json, "--out", str(tmp_path / "x")]
    dead = await run_main(["throughput", "--url", f"http://127.0.0.1:{port}", *base])
    assert dead == 1
    assert await run_main(["interference", "--inject", "lots@once", *base]) == 2
    assert (
        await run_main(
            [
                "compare",
                "--scenario",
                "poisson",
                "--url",
                "http://a",
                "--url",
                "http://b",
                "--label",
                "only-one",
                *base,
            ]
        )
        == 2
    )
    assert await run_main(["nonsense"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and "LENGTH@SECONDS" in err and "--label once per --url" in err
