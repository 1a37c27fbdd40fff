"""A real worker's runner in the test's own process, behind the engine's Worker interface:
two engines whose workers move K/V through the in-process KV connector
(gpu_worker.kv_connector_local). Its steps run on the event loop; fine for tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import trio

from gpu_worker.protocol import KV_ENGINE_LOCAL, Handshake, StepPlan, StepResult
from gpu_worker.runner import ModelRunner
from tests.worker_fixtures import make_runner


@dataclass
class InProcessWorker:
    model_dir: Path
    kv_memory: float
    kv_staging_tokens: int = 0  # the producer's staging arena (WorkerConfig's)
    plans: list[StepPlan] = field(default_factory=list)  # every plan it ran, in order
    runner: ModelRunner | None = None
    _result: StepResult | None = None
    _gone: trio.Event = field(default_factory=trio.Event)

    async def start(self) -> Handshake:
        await trio.lowlevel.checkpoint()
        self.runner = make_runner(
            self.model_dir,
            kv_memory=self.kv_memory,
            kv_transfer_engine=KV_ENGINE_LOCAL,
            kv_staging_tokens=self.kv_staging_tokens,
        )
        assert self.runner.handshake is not None
        return self.runner.handshake

    async def send_step(self, plan: StepPlan) -> None:
        await trio.lowlevel.checkpoint()
        assert self.runner is not None and self._result is None
        self.plans.append(plan)
        self._result = self.runner.execute(plan)

    async def receive_result(self, step_id: int) -> StepResult:
        await trio.lowlevel.checkpoint()
        result, self._result = self._result, None
        assert result is not None and result.step_id == step_id
        return result

    async def ping(self) -> None:
        await trio.lowlevel.checkpoint()

    async def wait_closed(self) -> None:
        await self._gone.wait()

    async def kill(self) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self.runner is not None and self.runner.kv is not None:
            self.runner.kv.close()
        self._gone.set()
