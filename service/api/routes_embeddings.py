"""POST /v1/embeddings: each input's final hidden states pooled (--pooling-type: the last
token's, or the mean over its tokens) and L2-normalized, as vLLM serves a decoder model
as an embedding model.

An input is a prefill-only request through the same engine and scheduler as generation:
its chunks share steps with the streams decoding beside it under the same token budget,
and it ends once its prompt is computed. A request's inputs go to the engine
IN_FLIGHT at a time, so a list of thousands holds no more of the queue than a few prompts.
"""

from __future__ import annotations

import base64
import time

import numpy as np
import trio
from quart import Blueprint, Response, request

from service.api.access import request_key
from service.api.app_state import AppState, app_state
from service.api.errors import json_response
from service.api.lora_models import with_adapter
from service.api.openai_answer import failure_of, unavailable
from service.api.openai_schema import EmbeddingRequest, parse_embedding_request
from service.api.routes_openai import (
    engine_refusals,
    isolated,
    priority_of,
    prompt_bound,
    read_json_body,
    request_id_for,
    require_served_model,
    tenant_of,
)
from service.engine.adapters import Adapter
from service.engine.request import FinishEvent, SamplingParams, SamplingSpec
from service.tokenizer import Tokenizer

blueprint = Blueprint("embeddings", __name__)
IN_FLIGHT = 32  # inputs of one request queued or computing at once


@blueprint.post("/v1/embeddings")
async def embeddings() -> Response:
    state = app_state()
    req = parse_embedding_request(
        await read_json_body(), request.headers.get("X-Tenant"), prompt_bound()
    )
    adapter = require_served_model(req.model, state)
    if not state.engine.ready:
        raise unavailable("the model worker is not ready yet; retry shortly")
    request_id = request_id_for("embd", req.ignored)
    # a long input is seconds of tokenizer work: off the event loop, as for generation
    prompts = await trio.to_thread.run_sync(
        token_ids_of, req, state.tokenizer, limiter=state.tokenizer_threads
    )
    vectors: list[list[float]] = []
    for start in range(0, len(prompts), IN_FLIGHT):
        wave = prompts[start : start + IN_FLIGHT]
        vectors += await embed_wave(req, wave, f"{request_id}-{start}", state, adapter)
    tokens = sum(map(len, prompts))
    body = {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": state.served_model_name,
        "data": [
            {"index": i, "object": "embedding", "embedding": encoded(v, req)}
            for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json_response(body)


def token_ids_of(req: EmbeddingRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """Each input's ids, cut to their last truncate_prompt_tokens (blocking: call it in a
    worker thread)."""
    prompts = [
        list(one) if isinstance(one, list) else tokenizer.encode(one, req.add_special_tokens)
        for one in req.inputs
    ]
    keep = req.truncate_prompt_tokens
    if keep is None:
        return prompts
    return [ids[-keep:] if keep > 0 else ids for ids in prompts]


async def embed_wave(
    req: EmbeddingRequest,
    prompts: list[list[int]],
    wave_id: str,
    state: AppState,
    adapter: Adapter | None = None,
) -> list[list[float]]:
    """The pooled vectors of `prompts`, computed together; a refusal or failure of one ends
    the others (and so does the client going away)."""
    tenant = tenant_of(req.tenant, request_key())
    priority = priority_of(req.priority, request_key())
    params = SamplingParams(
        max_tokens=0, sampling=SamplingSpec(), pooling=state.config.pooling_type
    )
    with_adapter(params, adapter)
    params = isolated(params, tenant, state)
    channels: list[trio.MemoryReceiveChannel] = []
    ids = [f"{wave_id}-{i}" for i in range(len(prompts))]
    try:
        for engine_id, prompt in zip(ids, prompts, strict=True):
            channels.append(await submit(prompt, params, engine_id, tenant, priority, state))
        return [await pooled_vector(channel, req) for channel in channels]
    finally:
        for engine_id, channel in zip(ids, channels, strict=False):
            channel.close()
            state.engine.abort(engine_id)  # nothing for one that finished


async def submit(
    prompt: list[int],
    params: SamplingParams,
    engine_id: str,
    tenant: str,
    priority: int,
    state: AppState,
) -> trio.MemoryReceiveChannel:
    with engine_refusals(lambda param: "input" if param in ("prompt", "max_tokens") else param):
        return await state.engine.submit(
            prompt, params, request_id=engine_id, tenant=tenant, priority=priority
        )


async def pooled_vector(channel: trio.MemoryReceiveChannel, req: EmbeddingRequest) -> list[float]:
    finish: FinishEvent | None = None
    async for event in channel:
        if isinstance(event, FinishEvent):
            finish = event
    error = failure_of(finish)
    if error is not None:
        raise error
    assert finish is not None and finish.embedding is not None
    vector = np.asarray(finish.embedding, dtype=np.float64)
    if req.normalize:
        # as vLLM's normalization (torch's F.normalize): a zero vector stays zero
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32).tolist()


def encoded(vector: list[float], req: EmbeddingRequest) -> list[float] | str:
    """OpenAI's base64: the float32 values' little-endian bytes."""
    if req.encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
