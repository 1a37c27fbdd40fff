"""The contract between the GGUF converter and the worker: each architecture's tiny GGUF
(test_model_files_gguf_arch), converted by cadence and run by cadence's worker, continues a
prompt greedily as transformers' original model does. The prompt (144 tokens) reaches past
the tiny sliding windows and past the longrope model's original length, where the worker
and transformers pick the same factors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_model_files_gguf_arch import CASES, IDS, converted
from tests.worker_fixtures import generate_greedy, make_runner

STEPS = 5


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_worker_continues_each_converted_architecture_as_transformers(
    tmp_path: Path, case_name: str
) -> None:
    model, _, out = converted(case_name, tmp_path)
    prompt = IDS * 8
    with torch.no_grad():
        want = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    runner = make_runner(out, kv_memory=float(8 * 1024 * 1024))
    assert generate_greedy(runner, prompt, STEPS) == want
