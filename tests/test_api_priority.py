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


def test_a_more_important_arrival_at_the_cap_preempts_and_outputs_stay_the_same(
    one_at_a_time: RunningServer,
) -> None:
    """One slot, held by a priority-5 stream: a priority-0 request preempts it (as vLLM's
    priority scheduling does), is answered before the stream ends, and both answers equal
    their runs alone (the preempted one is recomputed, greedy)."""
    client = openai.OpenAI(
        base_url=f"{one_at_a_time.url}/v1", api_key="unused", max_retries=0, timeout=120
    )

    def create(priority: int, max_tokens: int, stream: bool) -> object:
        return client.completions.create(
            model=one_at_a_time.model, prompt=f"List {priority} fruits:", max_tokens=max_tokens,
            temperature=0, stream=stream, extra_body={"priority": priority, "ignore_eos": True},
        )  # fmt: skip

    minor_alone = create(5, 48, False).choices[0].text  # type: ignore[attr-defined]
    urgent_alone = create(0, 4, False).choices[0].text  # type: ignore[attr-defined]
    stream = create(5, 48, True)
    minor = iter(stream)  # type: ignore[call-overload]
    first = next(minor)  # it holds the only slot now
    texts = [first.choices[0].text]
    urgent = create(0, 4, False).choices[0].text  # type: ignore[attr-defined]
    answered_at = time.monotonic()
    texts += [chunk.choices[0].text for chunk in minor]
    ended_at = time.monotonic()
    assert urgent == urgent_alone and "".join(texts) == minor_alone
    assert answered_at < ended_at - 0.1  # the stream still had tokens to send
    (finished,) = [
        e for e in one_at_a_time.log_events("request.finished") if e["request_id"] == first.id
    ]
    assert finished["preemptions"] >= 1
