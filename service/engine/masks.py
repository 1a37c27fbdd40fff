"""Grammar masks filled off the event loop, in batches, beside the worker's step.

A constrained sequence may sample only with the mask of its grammar's current state (the
scheduler leaves it out of a step, or stops its prefill chunk a token short, until then).
Filling a mask walks the vocabulary against the grammar: microseconds for most schemas,
but 10-50 ms a row for some (a long bounded repetition, such as a string `maxLength` or a
`pattern` like `[^"]{0,500}`: xgrammar issue #852). Done in the scheduler for every
constrained row of every step, that stopped every stream for as long.

So the MaskFiller task fills, in one thread and in xgrammar batches, every mask the live
constrained sequences lack: as soon as a step's tokens are accepted (while the engine sends
that step's text), and for new requests while they wait or prefill. Before each step the
loop waits for the masks its decoding constrained rows need, until `wait_s`
(--grammar-mask-wait-ms) after the batch filling them began; a row whose mask is later sits
that step out, so no grammar holds the free streams longer than that, and a batch already
late holds no step at all. Rows that lack a mask while a batch runs go in the next one: a
slow grammar slows the constrained rows of its batch, never the free ones.

Beside a step on a GPU, a batch takes half the cores (the rest stay with the loop). Where
the worker computes on the CPU (`beside_step` False), its step needs every core: a fill
beside it would slow it many times over (its threads wait for each other at every
operation). There fills run only while the worker waits for its next plan, on every core,
and a batch stops between chunks of rows when a plan goes out; its unfilled rows wait for
the next gap between steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import structlog
import trio

from service.engine.grammar import CORES, fill_masks
from service.engine.request import Request, Status

log = structlog.get_logger()


def unmasked(constrained: Iterable[Request], most: int) -> list[Request]:
    """Constrained sequences whose next mask is neither filled nor being filled, the
    running first, at most `most` (a step's worth)."""
    lacking = [r for r in constrained if r.grammar and r.grammar.needs_mask]
    lacking.sort(key=lambda r: r.status is not Status.RUNNING)
    return lacking[:most]


def waits_for_masks(constrained: Iterable[Request]) -> bool:
    """A running constrained sequence would sample next and has no mask yet."""
    return any(
        r.status is Status.RUNNING and r.remaining == 1 and r.grammar.mask is None
        for r in constrained
        if r.grammar is not None
    )


class MaskFiller:
    """The task that fills grammar masks (module docstring), and the wait for them."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.beside_step = True  # fills may run while the worker computes
        self._kick = trio.Event()
        self._filled = trio.Event()
        self._limiter = trio.CapacityLimiter(1)  # one batch at a time
        self._batch_began: float | None = None  # while a batch fills
        self._worker_waits = trio.Event()  # set while no plan is in flight
        self._worker_waits.set()
        self._stop = threading.Event()  # tells a batch's thread to stop between chunks

    def kick(self) -> None:
        """Some sequence may lack a mask now (a token accepted, a request added)."""
        self._kick.set()

    def worker_waits(self) -> None:
        """No plan is in flight: fills may run."""
        self._stop.clear()
        self._worker_waits.set()

    def worker_computes(self) -> None:
        """A plan goes out: where the worker computes on the CPU, fills pause."""
        if not self.beside_step:
            self._worker_waits = trio.Event()
            self._stop.set()

    async def run(
        self,
        unmasked: Callable[[], list[Request]],
        filled: Callable[[], None],
        failed: Callable[[list[Request], str], None],
    ) -> None:
        """Forever: on each kick, while fills may run, fill the masks of `unmasked()` in a
        thread, then call `filled()` (so an idle loop wakes) or, if xgrammar raised,
        `failed(requests, why)`."""
        while True:
            await self._kick.wait()
            await self._worker_waits.wait()
            self._kick = trio.Event()
            batch = unmasked()
            if not batch:
                continue
            await self._fill(batch, failed)
            self._filled.set()
            self._filled = trio.Event()
            filled()
            if unmasked():  # stopped by a plan, or lacking since the batch began
                self.kick()

    async def _fill(
        self, batch: list[Request], failed: Callable[[list[Request], str], None]
    ) -> None:
        matchers = [r.grammar for r in batch if r.grammar is not None]
        for matcher in matchers:
            matcher.filling = True
        self._batch_began = trio.current_time()
        try:
            threads = max(1, CORES // 2) if self.beside_step else CORES
            masks = await trio.to_thread.run_sync(
                fill_masks,
                matchers,
                threads,
                self._stop,
                limiter=self._limiter,
                abandon_on_cancel=True,
            )
        except trio.Cancelled:
            self._stop.set()  # the abandoned thread ends after its chunk
            raise
        except Exception as exc:  # a bug of xgrammar's must end its requests, not the engine
            log.error("grammar.mask_failed", error=str(exc), rows=len(matchers))
            failed(batch, f"the grammar's token mask could not be computed: {exc}")
            return
        finally:
            self._batch_began = None
            for matcher in matchers:
                matcher.filling = False
        for matcher, mask in zip(matchers, masks, strict=False):  # a stopped batch: a prefix
            matcher.mask = mask

    async def settle(self, pending: Callable[[], bool]) -> None:
        """Kick, then wait until `pending()` is false (no decoding constrained row lacks its
        mask), until `wait_s` after the running batch began (or from now, if none runs);
        then the step goes without the late rows. The kick comes first whatever `pending`
        says: a new request's first mask is wanted before any step of it has run."""
        self.kick()
        if not pending():
            return
        began = trio.current_time() if self._batch_began is None else self._batch_began
        with trio.move_on_at(began + self.wait_s):
            while pending():
                await self._filled.wait()
