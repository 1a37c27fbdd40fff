"""`priority` over HTTP as vLLM defines it: a lower value runs first (the real server, the
`priority` policy, the official openai client)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest

from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model


def test_lower_priority_values_run_first_as_vllm_does(
    one_at_a_time: RunningServer, tmp_path: Path
) -> None:
    client = openai.OpenAI(
        base_url=f"{one_at_a_time.url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    model = one_at_a_time.model
    blocker = client.completions.create(
        model=model, prompt="Count:", max_tokens=48, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(blocker))  # it holds the only slot now
    ids: dict[int, str] = {}

    def ask(priority: int) -> None:
        reply = client.completions.create(
            model=model, prompt=f"Say {priority}.", max_tokens=2, temperature=0,
            extra_body={"priority": priority, "ignore_eos": True},
        )  # fmt: skip
        ids[priority] = reply.id

    threads = []
    for priority in (9, 0, -5):  # they arrive least important first
        threads.append(threading.Thread(target=ask, args=(priority,)))
        threads[-1].start()
        time.sleep(0.05)
    for _ in blocker:
        pass
    for thread in threads:
        thread.join()
    finished = [e["request_id"] for e in one_at_a_time.log_events("request.finished")]
    order = sorted(ids, key=lambda p: finished.index(ids[p]))
    assert order == [-5, 0, 9]
