"""A tensor-parallel group's KV transfers as one worker's: each rank's connector moves its
own shard (its KV heads) to or from the same rank of the peer group, and rank 0 reports a
transfer only once every rank's part of it has ended.

vLLM's rule for equal TP sizes: consumer rank r reads producer rank r's cache. Each rank
submits its part of a plan's pulls (KvPull.for_rank) and polls its own connector; on the
steps where the service awaits news (StepPlan.transfer_news) the ranks' polls are gathered
on rank 0, whose GroupTransfers tallies them across steps:
- a pull is done when every rank's part is (failed if any part failed): until then some
  rank's transfer engine may still write its blocks, which the service must not free;
- a hold is released when every rank has the consumer's notice: until then some rank's
  blocks may still be read.
Other steps gather nothing, so a group's decode steps without P/D pay for no collective;
the news waits in the connectors meanwhile.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from gpu_worker.kv_connector import NOTICE_DONE, Notice
from gpu_worker.protocol import PullDone


@dataclass(slots=True)
class RankNews:
    """What one rank's connector reported since its last poll: pulls ended, and the
    transfer ids consumers read (notices) or began to read (reading)."""

    done: list[PullDone] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    reading: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, done: list[PullDone], notices: list[Notice]) -> RankNews:
        news = cls(done)
        for transfer_id, kind in notices:
            (news.notices if kind == NOTICE_DONE else news.reading).append(transfer_id)
        return news


# forgotten transfer ids remembered, so that a rank's late news of one is dropped too
FORGOTTEN_KEPT = 1024


@dataclass(slots=True)
class GroupTransfers:
    """Rank 0's tally of its ranks' transfer news, by transfer id, until complete; a hold's
    notices also until the service forgets it (a hold it ended unreleased: a consumer that
    died after some of its ranks' notices would leave their count here for ever)."""

    world_size: int
    _parts: dict[str, list[PullDone]] = field(default_factory=dict)
    _noticed: collections.Counter[str] = field(default_factory=collections.Counter)
    _forgotten: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=FORGOTTEN_KEPT)
    )

    def forget(self, transfer_ids: list[str]) -> None:
        """Drop the notices counted of holds `transfer_ids`, and those that come later.
        (Never a pull's parts: every rank's connector reports its part, and the service
        frees a pull's blocks only once all have.)"""
        for transfer_id in transfer_ids:
            self._noticed.pop(transfer_id, None)
            self._forgotten.append(transfer_id)

    def combine(self, news: list[RankNews]) -> RankNews:
        """The pulls and notices complete on every rank once `news` (each rank's, in rank
        order) is added; the incomplete ones wait for a later step's news."""
        combined = RankNews()
        for rank, ranks_news in enumerate(news):
            for part in ranks_news.done:
                if part.error is not None:
                    part.error = f"rank {rank}: {part.error}"
                if (done := self._add_part(part)) is not None:
                    combined.done.append(done)
            for transfer_id in ranks_news.notices:
                if transfer_id in self._forgotten:
                    continue
                self._noticed[transfer_id] += 1
                if self._noticed[transfer_id] == self.world_size:
                    del self._noticed[transfer_id]
                    combined.notices.append(transfer_id)
            # any rank's reading keeps the hold: every rank's blocks stay until all are read
            combined.reading.extend(set(ranks_news.reading) - set(combined.reading))
        return combined

    def _add_part(self, part: PullDone) -> PullDone | None:
        parts = self._parts.setdefault(part.transfer_id, [])
        parts.append(part)
        if len(parts) < self.world_size:
            return None
        del self._parts[part.transfer_id]
        errors = [p.error for p in parts if p.error is not None]
        return PullDone(
            part.transfer_id,
            "; ".join(errors) or None,
            sum(p.bytes for p in parts),
            sum(p.segments for p in parts),
        )
