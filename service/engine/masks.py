"""Grammar masks filled off the event loop, in batches, beside the worker's step.

A constrained sequence may sample only with the mask of its grammar's current state (the
scheduler leaves it out of a step, or stops its prefill chunk a token short, until then).
Filling a mask walks the vocabulary against the grammar: microseconds for most schemas,
but tens of milliseconds a row for some (a string `maxLength`: xgrammar issue #852), which,
done in the scheduler for every constrained row of every step, stopped every stream.

So the MaskFiller task fills, in one thread at a time and in one xgrammar batch, every
mask the live constrained sequences lack: as soon as a step's tokens are accepted (while
the engine sends that step's text), and for new requests while they wait or prefill.
Before each step the loop waits for the masks its decoding constrained rows need, until
`wait_s` (--grammar-mask-wait-ms) after the batch filling them began; a row whose mask is
late sits that step out and its fill goes on while the worker runs the others, so no
grammar holds the free streams longer than that, and a batch already late holds no step.
Rows that lack a mask while a batch runs go in the next one: a slow grammar slows the other
constrained rows of its batch, never the free ones.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import trio

from service.engine.grammar import fill_masks
from service.engine.request import Request

log = structlog.get_logger()


class MaskFiller:
    """The task that fills grammar masks (module docstring), and the wait for them."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._kick = trio.Event()
        self._filled = trio.Event()
        self._limiter = trio.CapacityLimiter(1)  # one batch at a time
        self._batch_began: float | None = None  # while a batch fills

    def kick(self) -> None:
        """Some sequence may lack a mask now (a token accepted, a request added)."""
        self._kick.set()

    async def run(
        self,
        unmasked: Callable[[], list[Request]],
        filled: Callable[[], None],
        failed: Callable[[list[Request], str], None],
    ) -> None:
        """Forever: on each kick, fill the masks of `unmasked()` in a thread, then call
        `filled()` (so an idle loop wakes) or, if xgrammar raised, `failed(requests, why)`."""
        while True:
            await self._kick.wait()
            self._kick = trio.Event()
            batch = unmasked()
            if batch:
                await self._fill(batch, failed)
                self._filled.set()
                self._filled = trio.Event()
                filled()

    async def _fill(
        self, batch: list[Request], failed: Callable[[list[Request], str], None]
    ) -> None:
        matchers = [r.grammar for r in batch if r.grammar is not None]
        for matcher in matchers:
            matcher.filling = True
        self._batch_began = trio.current_time()
        try:
            masks = await trio.to_thread.run_sync(fill_masks, matchers, limiter=self._limiter)
        except Exception as exc:  # a bug of xgrammar's must end its requests, not the engine
            log.error("grammar.mask_failed", error=str(exc), rows=len(matchers))
            failed(batch, f"the grammar's token mask could not be computed: {exc}")
            return
        finally:
            self._batch_began = None
            for matcher in matchers:
                matcher.filling = False
        for matcher, mask in zip(matchers, masks, strict=True):
            matcher.mask = mask

    async def settle(self, pending: Callable[[], bool]) -> None:
        """Kick, then wait until `pending()` is false (no decoding constrained row lacks its
        mask), until `wait_s` after the running batch began (or from now, if none runs);
        then the step goes without the late rows."""
        if not pending():
            return
        self.kick()
        began = trio.current_time() if self._batch_began is None else self._batch_began
        with trio.move_on_at(began + self.wait_s):
            while pending():
                await self._filled.wait()
