"""A request body's fields read with their types, and the fields accepted only at their
neutral value: what every route's parser (service.api.openai_schema, openai_sampling,
openai_grammar) reads a body with, and what the OpenAPI document lists."""

from __future__ import annotations

import math
from typing import Any

from service.api.counts import COUNTS, check_count
from service.api.errors import bad_request

# Fields OpenAI (or common benchmark clients) send that cadence accepts only with their
# neutral value: anything else would silently change the meaning of the request.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "echo": (False, None),  # completions read it; chat's (vLLM's) is another thing
    "suffix": (None, ""),
    "store": (None, False),
    "metadata": (None,),
    "service_tier": (None, "auto", "default"),
    "user": (),  # handled as the tenant; listed so it is never "unrecognized"
    "stream_options": (),
    # vLLM's and SGLang's extensions, which routers (sglang-router, vllm-router) and their
    # clients add to every body: accepted at the values that ask for nothing more
    "add_generation_prompt": (True, None),
    "continue_final_message": (False, None),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "include_stop_str_in_output": (False, None),
    "no_stop_trim": (False, None),
    "spaces_between_special_tokens": (True, None),
    "min_new_tokens": (0, None),
    "logits_processors": (None, []),
    "custom_logit_processor": (None,),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "length_penalty": (1, 1.0, None),
    "use_beam_search": (False, None),
    "return_tokens_as_token_ids": (False, None),
    "return_token_ids": (False, None),
    "return_hidden_states": (False, None),
    "lora_path": (None,),
    "lora_request": (None,),
    # nothing to ask for: reasoning is always returned apart (--reasoning-parser), and
    # this server keeps no sessions
    "separate_reasoning": (),
    "add_special_tokens": (),  # the tokenizer's own choice either way: no BOS is configured
    "stream_reasoning": (),
    "request_id": (),
    "rid": (),
    "session_params": (),
    # SGLang's prefill/decode handover: sglang-router in PD mode sends them to both halves,
    # and two cadence servers would each compute every request in full
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "vllm_xargs": (),
}
# Why a field's other values are refused, where "not supported" would not tell the client
# what to change.
UNSUPPORTED_WHY = dict.fromkeys(
    ("bootstrap_host", "bootstrap_port", "bootstrap_room"),
    "is not supported: cadence serves each request whole and takes no part in a "
    "prefill/decode handover, so route to it as a regular worker, not a prefill or decode one",
)


class Fields:
    """Reads typed fields out of a JSON object, remembering which keys were used; a count
    (service.api.counts) is bounded as it is read, `window` the context window if known."""

    def __init__(self, body: Any, window: int | None = None) -> None:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self.body = body
        self.window = window
        self.used: set[str] = set()
        self.ignored: list[str] = []  # fields this server does not know

    def raw(self, name: str) -> Any:
        self.used.add(name)
        return self.body.get(name)

    def number(self, name: str, default: float) -> float:
        value = self.raw(name)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise bad_request(f"'{name}' must be a number, got {value!r}", name)
        return float(value)

    def integer(self, name: str, default: int | None) -> int | None:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"'{name}' must be an integer, got {value!r}", name)
        return check_count(name, value, self.window) if name in COUNTS else value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be true or false, got {value!r}", name)
        return value

    def check_leftovers(self) -> None:
        """Known fields at values asking for what this server lacks are a 400; unknown ones
        are ignored (and logged by the caller), as vLLM does."""
        for name in sorted(set(self.body) - self.used):
            if name not in NEUTRAL_VALUES:
                self.ignored.append(name)
                continue
            allowed = NEUTRAL_VALUES[name]
            if allowed and self.body[name] not in allowed and self.body[name] != {}:
                why = UNSUPPORTED_WHY.get(name, "is not supported by this server")
                raise bad_request(f"'{name}' {why} (only {allowed[0]!r} is accepted)", name)
