"""A request's place in the prefix cache (BlockManager's, keyed by chained block hashes).

A waiting sequence starts with its longest cached prefix of full blocks (never the whole
of its tokens: the step must compute at least the last one to sample): admission shares
those blocks and counts only what they do not cover, a hit block that others hold costing
nothing; the policy's view shows the hit as computed already. A block is registered in the
cache by the scheduler's update(), once the step that filled it has returned, so a hit
never names a block a failed step left half-written.
"""

from __future__ import annotations

from service.engine.block_manager import BlockManager, PrefixHit, chain_hashes
from service.engine.request import Request


def prefix_hit(blocks: BlockManager, request: Request) -> PrefixHit:
    """The cached blocks a waiting request would start with; at least its last token
    is left to compute, since the step must produce the logits it samples from."""
    if not blocks.enable_caching or request.computes_whole_prompt:
        return blocks.no_hit
    hashes = _hashes(blocks, request)
    return blocks.match(hashes[: (request.num_tokens - 1) // blocks.block_size])


def register_blocks(blocks: BlockManager, request: Request) -> None:
    """Make the blocks `request` has filled and computed findable by later prompts."""
    if not blocks.enable_caching:
        return  # every step of every sequence: hash nothing nobody will look up
    blocks.register(request.seq_id, _hashes(blocks, request), request.num_computed_tokens)


def _hashes(blocks: BlockManager, request: Request) -> list[bytes]:
    """The chained hashes of `request`'s full blocks (computed once each)."""
    return chain_hashes(
        request.token_ids, blocks.block_size, request.block_hashes, salt_of(request)
    )


def salt_of(request: Request) -> str | None:
    """The salt of a request's block hashes: its cache_salt (a tenant's, a client's), and
    its LoRA adapter's name and path, as the same tokens under two adapters have different
    K/V (an adapter changes k_proj and v_proj, and every layer's input)."""
    params = request.params
    if params.adapter is None:
        return params.cache_salt
    return "\0".join(
        ["adapter", params.adapter, params.adapter_path or "", params.cache_salt or ""]
    )
