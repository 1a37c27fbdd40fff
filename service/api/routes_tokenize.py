"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or a chat rendered by the model's
template, tokenized as the generation endpoints would) and POST /detokenize."""

from __future__ import annotations

from typing import Any

import trio
from quart import Blueprint, Response

from service.api.app_state import app_state
from service.api.chat_setup import template_args
from service.api.errors import bad_request, json_response
from service.api.openai_answer import unavailable
from service.api.openai_logprobs import piece
from service.api.openai_schema import (
    TokenizeRequest,
    parse_detokenize_request,
    parse_tokenize_request,
)
from service.api.routes_openai import prompt_bound, read_json_body, require_served_model
from service.tokenizer import ChatTemplateError, Tokenizer

blueprint = Blueprint("tokenize", __name__)


@blueprint.post("/tokenize")
async def tokenize() -> Response:
    state = app_state()
    req = parse_tokenize_request(await read_json_body(), prompt_bound())
    require_served_model(req.model, state)
    # a long prompt is seconds of tokenizer work: off the event loop, as for generation
    chat_args = {} if req.chat is None else template_args(req.chat, state.config)
    ids = await trio.to_thread.run_sync(
        token_ids_of, req, state.tokenizer, chat_args, limiter=state.tokenizer_threads
    )
    bound = prompt_bound()
    if bound is not None:  # byte-level text can be 4 tokens a character: count them
        bound.check_tokens(len(ids), "prompt" if req.prompt is not None else "messages")
    pieces = None
    if req.return_token_strs:
        pieces = [piece(state.tokenizer.pieces, i) for i in ids]
    body = {
        "count": len(ids),
        "max_model_len": state.engine.max_model_len,
        "tokens": ids,
        "token_strs": pieces,
    }
    return json_response(body)


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    state = app_state()
    bound = prompt_bound()
    if bound is None:
        raise unavailable("the model worker is not ready yet; retry shortly")
    model, tokens = parse_detokenize_request(
        await read_json_body(), state.tokenizer.vocab_size, bound
    )
    require_served_model(model, state)
    return json_response({"prompt": state.tokenizer.decode(tokens, skip_special_tokens=False)})


def token_ids_of(
    req: TokenizeRequest, tokenizer: Tokenizer, chat_args: dict[str, Any]
) -> list[int]:
    """Blocking: call it in a worker thread. `chat_args`: the chat template's arguments
    beyond the messages (tools, kwargs), as generation passes them."""
    if req.prompt is not None:
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    assert req.messages is not None
    try:
        return tokenizer.encode_chat(
            req.messages,
            req.add_generation_prompt,
            add_special_tokens=req.add_special_tokens,
            **chat_args,
        )
    except ChatTemplateError as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
