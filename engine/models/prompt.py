"""Prompt token ids for the supported tasks, from the config's templates.

caption(length): the caption template. query(question): prefix + tokens(question) + suffix +
suffix (the answer marker appears twice, as the released Moondream 2 was trained), the
question first brought to the model's trained wording by its config's `question_rewrites`.
"""

from __future__ import annotations

import functools
import re

from ..config import CAPTION_LENGTHS, ModelConfig
from ..errors import RequestError
from .tokenizer import Tokenizer


def prompt_ids(
    config: ModelConfig, tokenizer: Tokenizer, caption: str | None = None, question: str | None = None
) -> list[int]:
    if (caption is None) == (question is None):
        raise RequestError("give exactly one of caption (short|normal|long) or question")
    templates = config.tokenizer.templates
    if caption is not None:
        if caption not in CAPTION_LENGTHS:
            raise RequestError(f"caption length must be one of {', '.join(CAPTION_LENGTHS)}, got {caption!r}")
        return list(templates.caption[caption])
    if not isinstance(question, str) or not question.strip():
        raise RequestError("the question is empty")
    q = templates.query
    question = asked_question(config, question)
    ids = list(q.prefix) + tokenizer.encode(question) + list(q.suffix) + list(q.suffix)
    too_big = [i for i in ids if i >= config.text.vocab_size]
    if too_big:
        raise RequestError(
            f"the tokenizer produced id {too_big[0]}, outside the model's vocabulary ({config.text.vocab_size})"
        )
    return ids


def asked_question(config: ModelConfig, question: str) -> str:
    """The question the model is asked: the first of the config's rewrites that fully matches it
    (in lower case, spaces collapsed, end punctuation dropped), else the question as given."""
    rewrites = config.tokenizer.question_rewrites
    if not rewrites:
        return question
    text = " ".join(question.split()).rstrip(" ?.!").lower()
    for pattern, replacement in _compiled(rewrites):
        m = pattern.fullmatch(text)
        if m:
            return m.expand(replacement)
    return question


@functools.lru_cache(maxsize=8)
def _compiled(rewrites: tuple[tuple[str, str], ...]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(p), r) for p, r in rewrites]
