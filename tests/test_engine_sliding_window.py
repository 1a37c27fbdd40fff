"""The engine on a model whose every layer attends within a window (a tiny Mistral): the
blocks behind each sequence's window are released as it decodes and taken by the others,
and every output is the one computed with every block kept, on a cache with room to spare."""

from __future__ import annotations

import pytest

from service.config import Config
from service.engine.assembly import open_engine
from service.engine.block_manager import BlockManager
from service.engine.request import SamplingParams, SamplingSpec
from tests.sim_worker import RecordingObserver, SimTokenizer, run_together

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8
BLOCK = 4
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True, sampling=SamplingSpec())
PROMPTS = [[(7 * s + i) % 250 + 3 for i in range(12 + 5 * s)] for s in range(4)]


def engine_config(blocks: int) -> Config:
    # a float32 block of the tiny model: K and V, 2 layers, 2 heads x 16, 4 slots
    block_bytes = 2 * 2 * 2 * 16 * BLOCK * 4
    return Config(
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        kv_memory=float(blocks * block_bytes),
        use_cuda_graphs=False,
        enable_prefix_caching=False,
        watermark=0.0,
    )


async def outputs(
    model_dir, blocks: int, prompts, *, keep_blocks: bool = False
) -> tuple[list[list[int]], RecordingObserver]:
    """Each prompt's greedy tokens, all submitted at once, and what the engine reported;
    with `keep_blocks`, every block a sequence filled stays its own to its end."""
    async with open_engine(
        engine_config(blocks), model_dir=model_dir, tokenizer=SimTokenizer()
    ) as engine:
        observer = RecordingObserver()
        engine.add_observer(observer)
        handshake = engine.handshake
        assert handshake is not None and handshake.kv_group_windows == [WINDOW]
        if keep_blocks:  # a manager that knows of no window
            whole = BlockManager(handshake.num_blocks, BLOCK, enable_caching=False)
            engine.scheduler.replace_blocks(whole)
        results = await run_together(engine, prompts, GREEDY, "r")
    return results, observer


async def test_blocks_behind_the_window_serve_others_and_outputs_stay_the_same(tiny_models):
    model_dir = tiny_models("mistral", sliding_window=WINDOW)
    kept, _ = await outputs(model_dir, 256, PROMPTS, keep_blocks=True)
    # at their ends the 4 sequences (up to 67 tokens) would hold 4 x 17 blocks without the
    # window; in 24, nobody is preempted: each holds its window's blocks
    together, seen = await outputs(model_dir, 24, PROMPTS)
    assert together == kept  # the window's masks hide the keys others wrote since
    assert sum(-(-(len(p) + 40) // BLOCK) for p in PROMPTS) > 2 * 24
    assert not seen.preempted
    assert max(stats.kv_blocks_used for stats in seen.iterations) <= 4 * 4
