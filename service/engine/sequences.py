"""A request's sequences, made once admission has let it in: one, or n of one prompt.

A request of n > 1 is n sequences, `request_id` then `request_id-1`, ... (sequence_ids),
whose events share one stream, each with its sequence's `index`; a seeded one's sequence
i samples with seed + i (sibling_params). The later ones start once the first has computed
the prompt: its blocks are then in the prefix cache, and theirs are shared, not computed
again (Scheduler.hold). The group lasts until all of them finish, so that an abort or a
slow reader of the stream ends them all.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import trio

from gpu_worker.protocol import TokenLogprobs
from service.engine.admission import Ticket
from service.engine.detokenizer import Decoder, Detokenizer
from service.engine.grammar import Matcher
from service.engine.request import Request, SamplingParams, UnreadBytes


class TokenizerLike(Decoder, Protocol):
    """What the engine needs of a tokenizer: decoding, which ids end a sequence, and
    encoding (of bad words)."""

    @property
    def eos_token_ids(self) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The request ids of a request's n sequences, the first's its own."""
    return [request_id] + [f"{request_id}-{index}" for index in range(1, n)]


def leader_id_of(request_id: str, index: int) -> str:
    return request_id.removesuffix(f"-{index}") if index else request_id


def sibling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of n: its own seed stream when the request is seeded."""
    seed = params.sampling.seed
    if seed is None:
        return params
    sampling = dataclasses.replace(params.sampling, seed=seed + index)
    return dataclasses.replace(params, sampling=sampling)


class Sequences:
    """Makes each admitted request's sequences, and keeps the groups of n > 1 until all
    their sequences finish."""

    def __init__(self, tokenizer: TokenizerLike, max_stream_buffer_bytes: int) -> None:
        self.tokenizer = tokenizer
        self.max_stream_buffer_bytes = max_stream_buffer_bytes
        self._next_seq_id = 0
        self._groups: dict[str, list[Request]] = {}  # the first's id -> all of them

    def make(
        self, ticket: Ticket, params: SamplingParams, deadline: float | None
    ) -> tuple[list[Request], trio.MemoryReceiveChannel]:
        """The request's sequences, the first first, and the stream they share."""
        ids = sequence_ids(ticket.request_id, ticket.n)
        assert params.max_tokens is not None
        # never blocks: a token event per output token, the finish event, and a spare, each
        send, receive = trio.open_memory_channel(ticket.n * (params.max_tokens + 2))
        unread = UnreadBytes(self.max_stream_buffer_bytes)
        with send:
            made = [self._new(ticket, ids[0], 0, params, send.clone(), unread, deadline)]
            made += [
                self._new(ticket, ids[i], i, sibling_params(params, i), send.clone(), unread, None)
                for i in range(1, ticket.n)
            ]
        if ticket.n > 1:
            self._groups[made[0].request_id] = made
        return made, receive

    def group(self, request_id: str) -> list[Request] | None:
        """The sequences of the request of n > 1 whose id this is; None if none is."""
        return self._groups.get(request_id)

    def members(self, request: Request) -> list[Request]:
        """Every sequence of `request`'s request (itself alone if n is 1)."""
        return self._groups.get(leader_id_of(request.request_id, request.index)) or [request]

    def finished(self, request: Request) -> None:
        """`request` ended: its group is forgotten once every sequence of it has."""
        leader_id = leader_id_of(request.request_id, request.index)
        group = self._groups.get(leader_id)
        if group is not None and all(member.is_finished for member in group):
            del self._groups[leader_id]

    def _new(
        self,
        ticket: Ticket,
        request_id: str,
        index: int,
        params: SamplingParams,
        stream: trio.MemorySendChannel,
        unread: UnreadBytes,
        deadline: float | None,
    ) -> Request:
        ids = list(ticket.prompt_token_ids)
        request = Request(
            request_id=request_id,
            seq_id=self._next_seq_id,
            prompt_len=len(ids),
            token_ids=ids,
            params=params,
            tenant=ticket.tenant,
            priority=ticket.priority,
            received=ticket.received,
            stream=stream,
            unread=unread,
            detokenizer=Detokenizer(
                self.tokenizer,
                ids,
                params.stop,
                params.skip_special_tokens,
                params.sampling.min_tokens,
            ),
            grammar=None if params.grammar is None else Matcher(params.grammar),
            deadline=deadline,
            trace_headers=ticket.trace_headers,
            prompt_logprobs=None if params.sampling.prompt_logprobs is None else TokenLogprobs(),
            index=index,
        )
        self._next_seq_id += 1
        return request
