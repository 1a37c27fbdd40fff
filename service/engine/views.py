"""What a policy sees of each sequence (policies.base.SeqView): a running one as it stands,
a waiting one as admission would take it. Scheduler.build_view gathers them into the
step's View.
"""

from __future__ import annotations

import dataclasses

from policies.base import SeqView
from service.engine.block_manager import BlockManager, PrefixHit
from service.engine.request import Request, account_of


def seq_view(r: Request, blocks: BlockManager) -> SeqView:
    """A sequence as it stands."""
    return SeqView(
        seq_id=r.seq_id,
        tenant=account_of(r.tenant),  # sub-tenants share their tenant's fair share
        priority=r.priority,
        arrival=r.received,
        prompt_len=r.prompt_len,
        num_generated=len(r.token_ids) - r.prompt_len,
        num_computed_tokens=r.num_computed_tokens,
        num_blocks=blocks.num_held(r.seq_id),
        preempted=r.preemptions,
        deadline=r.deadline if r.first_scheduled is None else None,
        num_cached_tokens=r.num_cached_tokens,
        adapter=r.params.adapter,
    )


def waiting_view(r: Request, blocks: BlockManager, hit: PrefixHit) -> SeqView:
    """As admission would take it: its cache hit computed already, the hit blocks that
    others hold counted as its own (they cost it nothing)."""
    hit_tokens = hit.num_blocks * blocks.block_size
    return dataclasses.replace(
        seq_view(r, blocks),
        num_computed_tokens=hit_tokens,
        num_blocks=blocks.blocks_to_hold(r.num_tokens) - blocks.admission_cost(r.num_tokens, hit),
        num_cached_tokens=min(hit_tokens, r.prompt_len),
        waiting=True,
    )
