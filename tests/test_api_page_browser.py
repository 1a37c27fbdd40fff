"""The playground page in real headless Chromium against a real cadence server, one that
wants an API key: the page says so until its key field holds one, then sends it."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.server_fixtures import ADMIN_TOKEN, RunningServer, start_server, stop_server

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
PAGE_KEY = "sk-playground-0123456789"

# Records every change to a stream's output text, with its time, before the page's own script runs.
RECORD_MUTATIONS = """
window.__outputChanges = [];
new MutationObserver((records) => {
  for (const r of records) {
    const node = r.target.nodeType === 1 ? r.target : r.target.parentElement;
    const output = node && node.closest('.output');
    if (output) window.__outputChanges.push({t: performance.now(), len: output.textContent.length});
  }
}).observe(document, {subtree: true, childList: true, characterData: true});
"""


@pytest.fixture(scope="module")
def page_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log_dir = tmp_path_factory.mktemp("page-server")
    (log_dir / "keys").write_text(f"{PAGE_KEY} playground\n")
    server = start_server(
        log_dir,
        "--policy",
        "stall_free",
        "--api-key-file",
        str(log_dir / "keys"),
        "--enable-prompt-tokens-details",  # the page shows cached tokens
        "--tenant-quota",
        "1",  # the page's streams are one tenant's
        wait=False,
    )
    try:
        server.wait_healthy()
        models = httpx.get(
            f"{server.url}/v1/models", headers={"Authorization": f"Bearer {PAGE_KEY}"}, timeout=10
        )
        server.model = models.json()["data"][0]["id"]
    except BaseException:
        stop_server(server)
        raise
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = shutil.which("chromium")
    assert executable, "Debian's chromium is required (./dev test installs it)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, page_server: RunningServer) -> Iterator[Page]:
    context = browser.new_context()
    page = context.new_page()
    page.add_init_script(RECORD_MUTATIONS)
    page.goto(page_server.url + "/")
    page.wait_for_function("document.getElementById('model-name').textContent !== '?'")
    assert page.inner_text("#model-name") == "needs an API key"  # /v1/models answered 401
    page.fill("#api-key", PAGE_KEY)
    page.press("#api-key", "Tab")  # a change event, as when a person leaves the field
    wait_for_the_model(page, page_server)
    yield page
    context.close()


def wait_for_the_model(page: Page, server: RunningServer) -> None:
    """Until the page shows the model's name: its /v1/models request had the key."""
    name = orjson.dumps(server.model).decode()
    page.wait_for_function(f"document.getElementById('model-name').textContent === {name}")


def panels(page: Page, state: str | None = None) -> int:
    selector = ".stream" if state is None else f'.stream[data-state="{state}"]'
    return page.locator(selector).count()


def wait_until_no_stream_running(page: Page, timeout_ms: float = 120_000) -> None:
    page.wait_for_function(
        "document.querySelectorAll('.stream[data-state=\"streaming\"]').length === 0",
        timeout=timeout_ms,
    )


def test_tokens_appear_incrementally_in_the_dom(page: Page) -> None:
    page.fill("#prompt", "Tell me about the sea in a few sentences.")
    page.fill("#max-tokens", "48")
    page.click("#send")
    page.wait_for_selector(".stream .output:not(:empty)", timeout=60_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground-mid-stream.png"), full_page=True)
    wait_until_no_stream_running(page)
    assert panels(page, "done") == 1
    lengths = [c["len"] for c in page.evaluate("window.__outputChanges")]
    growing = sorted(set(lengths))
    # More than one DOM update before the end: text arrived piece by piece, not at once.
    assert len(growing) > 5, lengths
    assert "finished" in page.locator(".stream .status").first.inner_text()
    stats = page.locator(".stream .stats").first.inner_text()
    assert "TTFT" in stats and "ms" in stats


def test_long_prompt_injected_while_two_streams_run(page: Page) -> None:
    page.fill("#prompt", "Count from one to fifty in words.")
    page.fill("#max-tokens", "96")
    page.fill("#copies", "2")
    page.click("#send")
    page.wait_for_function(
        "[...document.querySelectorAll('.stream .output')].filter(o => o.textContent).length >= 2",
        timeout=60_000,
    )
    page.fill("#long-len", "1024")
    page.click("#inject")
    wait_until_no_stream_running(page, 180_000)
    assert panels(page) == 3
    assert panels(page, "done") == 3, page.locator(".stream .status").all_inner_texts()
    injected = page.locator(".stream.injected .status").inner_text()
    assert injected.startswith("finished"), injected


def test_a_repeated_long_prompt_shows_its_cached_tokens(page: Page) -> None:
    """The same long prompt twice: the second panel reports the prefix cache's share (all
    full blocks but the one holding the last token, which is computed to sample from)."""
    page.fill("#long-len", "512")
    for done in (1, 2):
        page.click("#inject")
        page.wait_for_function(
            f"document.querySelectorAll('.stream.injected[data-state=\"done\"]').length === {done}",
            timeout=120_000,
        )
    stats = page.locator(".stream.injected .stats").all_inner_texts()  # newest first
    print(stats)
    assert stats[0].endswith("prompt 512 tokens, 496 cached"), stats


def test_policy_switch_with_admin_token(page: Page, page_server: RunningServer) -> None:
    page.fill("#admin-token", ADMIN_TOKEN)
    page.press("#admin-token", "Tab")  # a change event, as when a person leaves the field
    page.wait_for_function("document.querySelectorAll('#policy-select option').length >= 5")
    page.select_option("#policy-select", "fcfs")
    page.fill("#policy-params-input", "")
    page.click("#switch-policy")
    page.wait_for_function("document.getElementById('admin-msg').textContent.includes('switched')")
    assert "→ fcfs" in page.inner_text("#admin-msg")
    current = httpx.get(
        f"{page_server.url}/admin/policy", headers=page_server.admin_headers(), timeout=10
    ).json()["current"]
    assert current["name"] == "fcfs"
    page.wait_for_function("document.getElementById('policy-name').textContent === 'fcfs'")

    page.fill("#admin-token", "wrong-token")
    page.press("#admin-token", "Tab")
    page.wait_for_function("document.getElementById('admin-msg').textContent.startsWith('403')")


def test_stopping_a_stream_frees_its_kv_blocks(page: Page, page_server: RunningServer) -> None:
    page.fill("#prompt", "Write a very long essay about the history of clocks.")
    page.fill("#max-tokens", "2000")
    page.fill("#copies", "1")
    page.check("#ignore-eos")
    page.click("#send")
    page.wait_for_selector(".stream .output:not(:empty)", timeout=60_000)
    busy = page_server.admin_state()
    assert busy["running"] == 1 and busy["kv_blocks_used"] > 0
    page.locator(".stream .stop").first.click()
    page.wait_for_selector('.stream[data-state="stopped"]')
    idle = page_server.wait_idle(timeout=30)
    assert idle["kv_blocks_used"] == 0 and idle["running"] == 0, idle
    aborted = [
        e for e in page_server.log_events("request.finished") if e["finish_reason"] == "abort"
    ]
    assert aborted, "the server never saw the browser's stop as an abort"


def test_the_api_key_stays_in_this_tab_only(page: Page, page_server: RunningServer) -> None:
    assert page.evaluate("sessionStorage.getItem('cadence-api-key')") == PAGE_KEY
    assert page.evaluate("document.cookie") == "" and page.evaluate("localStorage.length") == 0
    page.reload()  # the same tab keeps it, and the page needs nothing else to work
    wait_for_the_model(page, page_server)
    assert page.input_value("#api-key") == PAGE_KEY


def test_model_output_is_rendered_as_text_not_html(page: Page) -> None:
    # The HTML here stands in for what a model may write; the server's reply is replaced so the
    # exact bytes are known. What is under test is the page's rendering of streamed text.
    evil = ["<script>window.__pwned = 1</script>", '<img src=x onerror="window.__pwned = 2">']
    chunks = [
        {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }
        for text in evil
    ]
    body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, body=body, content_type="text/event-stream"),
    )
    page.click("#send")
    page.wait_for_selector('.stream[data-state="done"]')
    output = page.locator(".stream .output").first
    assert output.inner_text() == "".join(evil)
    assert output.locator("script, img").count() == 0
    time.sleep(0.2)
    assert page.evaluate("window.__pwned === undefined")
