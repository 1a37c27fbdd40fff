"""The service's tokenizer: tokenizer.json through `tokenizers`, the chat template through a
sandboxed jinja2, end-of-sequence ids from the model directory's config files.

A chat's special tokens come from its template only: a message's content is text, so a
user who writes `<|im_start|>system` gets those characters' tokens, not a forged turn."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding
from tokenizers import Tokenizer as RustTokenizer

from service.chat_messages import for_template

MAX_REQUEST_TEMPLATES = 16  # requests' own chat templates kept compiled
# Private-use characters: one that no content and no template holds marks where a special
# token's name stood in a message, from rendering to encoding
_PRIVATE_USE = re.compile("[\ue000-\uf8ff]")


class ChatTemplateError(ValueError):
    """The chat cannot be rendered: no template, or the template rejected the messages."""


class Tokenizer:
    def __init__(
        self,
        backend: RustTokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: list[int],
    ) -> None:
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._eos_token_ids = eos_token_ids
        self._template = _compile_template(chat_template) if chat_template else None
        # Every id's text, decoded once here: the API looks pieces up (logprobs, echo,
        # token_strs) instead of calling the tokenizer per token on the event loop.
        self._pieces = tuple(
            backend.decode_batch(
                [[i] for i in range(backend.get_vocab_size(with_added_tokens=True))],
                skip_special_tokens=False,
            )
        )
        self._max_token_chars = _longest_token_chars(backend, self._pieces)
        self._chat_source = chat_template or ""
        self._specials = _special_tokens_pattern(backend)
        self._as_text = _text_only(backend)  # the same vocabulary, special tokens as text

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load from a Hugging Face style model directory (tokenizer.json required);
        `chat_template` (--chat-template) replaces the directory's own."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        backend = RustTokenizer.from_file(str(tokenizer_file))
        tok_config = _read_json(path / "tokenizer_config.json")
        model_config = _read_json(path / "config.json")
        gen_config = _read_json(path / "generation_config.json")
        bos_token = _token_text(tok_config.get("bos_token"))
        eos_token = _token_text(tok_config.get("eos_token"))
        if bos_token is None and isinstance(model_config.get("bos_token_id"), int):
            bos_token = backend.id_to_token(model_config["bos_token_id"])
        eos_ids = _eos_token_ids(backend, eos_token, gen_config, model_config)
        return cls(
            backend,
            chat_template=chat_template or _chat_template(path, tok_config),
            bos_token=bos_token,
            eos_token=eos_token,
            eos_token_ids=eos_ids,
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while it works and encode does not: a long prompt
        # tokenized in a worker thread must leave the event loop running.
        batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        template: str | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (and `tools`, as transformers passes them), by
        `template` if given, else the model's; ChatTemplateError if it cannot be rendered.
        `extra`: more variables for the template (chat_template_kwargs)."""
        compiled = self._template if template is None else _request_template(template)
        if compiled is None:
            raise ChatTemplateError("this model has no chat template; use the completions API")
        try:
            return compiled.render(
                **extra,
                messages=for_template(messages, template or self._chat_source),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token or "",
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        **template_args: Any,
    ) -> list[int]:
        """The prompt ids of `messages` (ChatTemplateError if they cannot be rendered);
        `template_args` go to apply_chat_template (tools, template, the template's kwargs).

        A chat whose contents name no special token encodes exactly as its rendered text
        does. Where a content names one, each such name is rendered as a marker, the text
        between markers is encoded as usual (the template's own special tokens), and each
        name as plain text."""
        contents = [m.get("content") or "" for m in messages]
        if self._specials is None or not any(map(self._specials.search, contents)):
            text = self.apply_chat_template(messages, add_generation_prompt, **template_args)
            return self.encode(text, add_special_tokens)
        sources = [self._chat_source, template_args.get("template") or ""]
        marker = _free_marker([*contents, *sources])
        names: list[str] = []

        def mark(found: re.Match) -> str:
            names.append(found.group())
            return f"{marker}{len(names) - 1}{marker}"

        marked = [
            {**m, "content": self._specials.sub(mark, c)} if m.get("content") else m
            for m, c in zip(messages, contents, strict=True)
        ]
        text = self.apply_chat_template(marked, add_generation_prompt, **template_args)
        return self._encode_marked(text, marker, names, add_special_tokens)

    def _encode_marked(
        self, text: str, marker: str, names: list[str], add_special_tokens: bool
    ) -> list[int]:
        parts = re.split(f"{marker}(\\d+){marker}", text)  # text, name index, text, ...
        texts = self._backend.encode_batch(parts[::2], add_special_tokens=False)
        named = self._as_text.encode_batch(
            [names[int(i)] for i in parts[1::2]], add_special_tokens=False
        )
        pieces = [texts[0]]
        for name, after in zip(named, texts[1:], strict=True):
            pieces += [name, after]
        merged = Encoding.merge(pieces, growing_offsets=True)
        return self._backend.post_process(merged, add_special_tokens=add_special_tokens).ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: a text longer than n times this
        cannot encode to n tokens or fewer, which rejects a huge prompt without encoding it."""
        return self._max_token_chars

    @property
    def pieces(self) -> tuple[str, ...]:
        """Each token id's own text (special tokens included), by id."""
        return self._pieces

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> RustTokenizer:
        """The `tokenizers` object itself (structured output builds its vocabulary from it)."""
        return self._backend

    @property
    def bos_token_id(self) -> int | None:
        return None if self._bos_token is None else self._backend.token_to_id(self._bos_token)


def _longest_token_chars(backend: RustTokenizer, decoded: tuple[str, ...]) -> int:
    ids = range(len(decoded))
    # A byte-level token holding part of a UTF-8 character decodes to one replacement
    # character but can add up to its byte count to a text: its raw form has one
    # character per byte, so the larger of the two lengths is a safe bound.
    raw = (backend.id_to_token(i) or "" for i in ids)
    return max(1, *map(len, decoded), *map(len, raw))


def _special_tokens_pattern(backend: RustTokenizer) -> re.Pattern[str] | None:
    """Matches the name of any special token (the longest first); None if it has none."""
    names = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
    if not names:
        return None
    return re.compile("|".join(map(re.escape, sorted(names, key=len, reverse=True))))


def _text_only(backend: RustTokenizer) -> RustTokenizer:
    copy = RustTokenizer.from_str(backend.to_str())
    copy.encode_special_tokens = True
    return copy


def _free_marker(texts: list[str]) -> str:
    """A private-use character that none of `texts` holds."""
    used = {c for t in texts for c in _PRIVATE_USE.findall(t)}
    for code in range(0xE000, 0xF900):
        if chr(code) not in used:
            return chr(code)
    raise ChatTemplateError("the messages use every private-use character")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _eos_token_ids(
    backend: RustTokenizer,
    eos_token: str | None,
    gen_config: dict[str, Any],
    model_config: dict[str, Any],
) -> list[int]:
    candidates = _ids(gen_config.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
    if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
        candidates.append(eos_id)
    return list(dict.fromkeys(candidates))


def _chat_template(path: Path, tok_config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, or tokenizer_config.json's entry
    (a string, or a list of named templates)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Unlike jinja2's own tojson, keep non-ASCII and HTML characters as they are, as
    # transformers does: the output is a prompt, not HTML.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=MAX_REQUEST_TEMPLATES)
def _request_template(source: str) -> Template:
    """A request's own template, compiled once while it is among the recent ones."""
    return _compile_template(source)


def _compile_template(source: str) -> Template:
    # The same environment settings transformers uses, so templates render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
