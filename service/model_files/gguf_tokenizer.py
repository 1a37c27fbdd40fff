"""Rebuild a GGUF file's tokenizer (the `tokenizer.ggml.*` metadata) as a `tokenizers` one.

Two kinds are read: byte-level BPE (`gpt2`: Llama 3, Qwen, SmolLM) with the file's merges, and
SentencePiece BPE (`llama`: Llama 2, Mistral v0.x, TinyLlama, Gemma, Phi-3) whose merges are
implied by the vocabulary and its scores. Each is assembled the way the model's own
tokenizer.json is (and transformers' GGUF tokenizer is): a SentencePiece vocabulary splits
on nothing, marks spaces with U+2581 and falls back to <0xNN> byte tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from service.model_files.gguf_meta import GGUFError, require

TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values this module rebuilds

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's visible space

# Tokens that end a turn in the chat formats of the common GGUF models; llama.cpp treats
# them as end-of-generation too, whatever the file's eos id says.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's, with combining marks (\p{M}) kept in words.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k (gpt-oss): cased words with their contractions, numbers of up to three digits.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Nemo, Pixtral's text model).
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split its merges were learned on (llama.cpp's names).
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "qwen35": _QWEN35_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
}
_GEMMA_ARCHES = ("gemma", "gemma2", "gemma3")


@dataclass(slots=True)
class SpecialTokens:
    tokens: list[str]
    bos_id: int | None
    eos_ids: list[int]

    def text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def build_tokenizer(meta: dict[str, Any]) -> tuple[HFTokenizer, SpecialTokens]:
    """A `tokenizers` tokenizer from the tokenizer.ggml.* metadata, and its special tokens."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise GGUFError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )
    tokens = [str(t) for t in require(meta, "tokenizer.ggml.tokens")]
    token_types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if kind == "gpt2":
        tokenizer = _byte_level(meta, tokens)
        vocab_tokens = tokens
    else:
        tokenizer, vocab_tokens = _sentencepiece(meta, tokens)
    control = [t for t, k in zip(tokens, token_types, strict=True) if k == _TOKEN_TYPE_CONTROL]
    # A user-defined token that the vocabulary spells otherwise (Gemma's runs of spaces) is
    # already reached through the normalizer.
    user = [
        t
        for t, v, k in zip(tokens, vocab_tokens, token_types, strict=True)
        if k == _TOKEN_TYPE_USER_DEFINED and t == v
    ]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    special = _special_tokens(meta, tokens, set(control))
    if adds_bos(meta, special):
        bos = special.text(special.bos_id)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, special.bos_id)]
        )
    return tokenizer, special


# ---- byte-level BPE ------------------------------------------------------------------------


def _byte_level(meta: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in require(meta, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default", "gpt-2"):
        return byte_level
    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit alone, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise GGUFError(
        f"GGUF pre-tokenizer {pre!r} is not supported "
        f"(supported: default, gpt2, smollm, {', '.join(_SPLITS)})"
    )


# ---- SentencePiece BPE ---------------------------------------------------------------------


def _sentencepiece(meta: dict[str, Any], tokens: list[str]) -> tuple[HFTokenizer, list[str]]:
    """The tokenizer and the vocabulary as its BPE model spells it."""
    arch = meta.get("general.architecture")
    gemma = arch in _GEMMA_ARCHES
    if gemma:
        # Gemma files store a token of spaces as spaces; its normalizer makes them U+2581.
        vocab_tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        # Gemma's scores do not follow its merge order; the file's order does.
        priority = [-float(i) for i in range(len(tokens))]
    else:
        vocab_tokens = tokens
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise GGUFError("GGUF SentencePiece tokenizer lacks 'tokenizer.ggml.scores'")
        priority = [float(s) for s in scores]
    vocab = {token: index for index, token in enumerate(vocab_tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    model = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(vocab_tokens, priority),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = HFTokenizer(model)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        # Phi-3's tokenizer.json prepends the space with a normalizer, so a leading space
        # of the text adds to it rather than being merged away.
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)]
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        scheme = "first" if prefix_space else "never"
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(_SPACE, scheme, split=False)
        if prefix_space:
            steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, vocab_tokens


def sentencepiece_merges(tokens: list[str], priority: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two
    tokens, the token of higher priority merged first (llama.cpp's SPM tokenizer merges the
    pair whose result scores highest); ties go to the longer left, then the longer right
    piece, then to vocabulary order, as transformers orders them."""
    index = {token: i for i, token in enumerate(tokens)}
    score = dict(zip(tokens, priority, strict=True))
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for token, token_score in score.items():
        splits = [
            (index[token[:cut]], index[token[cut:]], token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in index and token[cut:] in index
        ]
        for _, _, left, right in sorted(splits):
            ranked.append((-token_score, -len(left), -len(right), len(ranked), left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


# ---- special tokens ------------------------------------------------------------------------


def adds_bos(meta: dict[str, Any], special: SpecialTokens) -> bool:
    """Whether encoding with special tokens prepends BOS. A "BOS" that the chat template
    writes literally is a turn marker (SmolLM2's GGUF names <|im_start|>), not a sequence
    start, so it is not prepended, as in the model's own tokenizer.json."""
    default = meta.get("tokenizer.ggml.model") == "llama"  # llama.cpp's SentencePiece default
    if not meta.get("tokenizer.ggml.add_bos_token", default) or special.bos_id is None:
        return False
    return special.text(special.bos_id) not in (meta.get("tokenizer.chat_template") or "")


def _special_tokens(meta: dict[str, Any], tokens: list[str], control: set[str]) -> SpecialTokens:
    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    bos_id = token_id("bos_token_id")
    template = meta.get("tokenizer.chat_template") or ""
    turn_ends = [t for t in _END_OF_TURN_TOKENS if t in control]
    # The chat template's own end-of-turn token first: it is what an instruct model emits;
    # then the file's end of sequence, then the other end-of-turn tokens llama.cpp stops at.
    eos_ids = [tokens.index(t) for t in turn_ends if t in template]
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        candidate = token_id(key)
        # Some converters write the bos id as eos (SmolLM2's GGUF does); that would stop
        # generation at the start of a turn rather than at its end.
        if candidate is not None and candidate != bos_id and candidate not in eos_ids:
            eos_ids.append(candidate)
    eos_ids += [tokens.index(t) for t in turn_ends if tokens.index(t) not in eos_ids]
    if not eos_ids:
        fallback = token_id("eos_token_id")
        if fallback is None:
            raise GGUFError("GGUF names no end-of-sequence token")
        eos_ids.append(fallback)
    return SpecialTokens(tokens=tokens, bos_id=bos_id, eos_ids=eos_ids)


def tokenizer_config(
    meta: dict[str, Any], special: SpecialTokens, context_length: int
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special.text(special.bos_id),
        "eos_token": special.text(special.eos_ids[0]),
        "add_bos_token": adds_bos(meta, special),
        "model_max_length": context_length,
    }
    for name, key in (("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < len(special.tokens):
            config[name] = special.tokens[int(value)]
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config
