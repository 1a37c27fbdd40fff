"""`cadence pd`'s supervision, on real processes that start in milliseconds (the whole
command, with its two servers and vllm-router, runs in tests/test_api_pd_disaggregation.py):
one nursery owns the children; one exiting on its own stops the others and gives the
command its exit code; the role flag is the command's alone."""

from __future__ import annotations

import sys

import pytest
import trio

from service import pd_launch
from service.pd_launch import FirstExit, start_child


async def test_a_child_exiting_on_its_own_stops_the_others_and_gives_the_exit_code() -> None:
    first_exit = FirstExit()
    commands = {
        "producer": [sys.executable, "-c", "import time; time.sleep(30)"],
        "router": [sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(3)"],
        "consumer": [sys.executable, "-c", "import time; time.sleep(30)"],
    }
    started = []
    with trio.fail_after(10):  # far less than the sleepers' 30 s
        async with trio.open_nursery() as nursery:
            for name, command in commands.items():
                child = await start_child(nursery, name, command, None, None, 5.0, first_exit)
                started.append(child)
            await trio.sleep_forever()  # the router's exit cancels this
    assert (first_exit.name, first_exit.returncode, first_exit.exit_code) == ("router", 3, 3)
    by_name = {child.name: child.process.returncode for child in started}
    assert by_name == {"producer": -15, "router": 3, "consumer": -15}  # SIGTERM, then done


def test_exit_codes() -> None:
    assert FirstExit().exit_code == 0  # stopped by a signal: nothing exited on its own
    assert FirstExit("producer", -9).exit_code == 137  # as a shell reports SIGKILL
    assert FirstExit("consumer", 1).exit_code == 1


def test_the_role_flag_is_the_commands_alone(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        pd_launch.main(["--", "--model", "x", "--kv-transfer-role=both"])
    assert exited.value.code == 2
    assert "--kv-transfer-role" in capsys.readouterr().err
