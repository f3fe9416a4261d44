"""Prompt token ids for the supported tasks, from the config's templates.

caption(length): the caption template. query(question): prefix + tokens(question) + suffix +
suffix (the answer marker appears twice, as the released Moondream 2 was trained). A question
first goes through the config's rewrites (`asked_prompt`): one that asks for a description may
become a caption, another may be brought to the model's trained wording.
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
    if question is not None:
        if not isinstance(question, str):
            raise RequestError(f"the question must be a string, got {type(question).__name__}")
        if not question.strip():
            raise RequestError("the question is empty")
        try:
            question.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, e.g. half of an emoji cut from its pair
            raise RequestError(f"the question is not valid text: {e.reason} at character {e.start}") from None
        asked = asked_prompt(config, question)
        caption, question = asked.get("caption"), asked.get("question")
    templates = config.tokenizer.templates
    if caption is not None:
        if caption not in CAPTION_LENGTHS:
            raise RequestError(f"caption length must be one of {', '.join(CAPTION_LENGTHS)}, got {caption!r}")
        return list(templates.caption[caption])
    q = templates.query
    ids = list(q.prefix) + tokenizer.encode(question) + list(q.suffix) + list(q.suffix)
    too_big = [i for i in ids if i >= config.text.vocab_size]
    if too_big:
        raise RequestError(
            f"the tokenizer produced id {too_big[0]}, outside the model's vocabulary ({config.text.vocab_size})"
        )
    return ids


def asked_prompt(config: ModelConfig, question: str) -> dict[str, str]:
    """What the model is asked for a question: {"caption": length} where one of the config's
    caption rewrites fully matches it, else {"question": the first question rewrite's form, or
    the question as given}. Patterns match the question in lower case, spaces collapsed, a
    typographic apostrophe made straight, end punctuation, a leading "please", "hey" (...) and a
    trailing "please" or "yes or no" dropped."""
    tok = config.tokenizer
    if not (tok.caption_rewrites or tok.question_rewrites):
        return {"question": question}
    text = " ".join(question.split()).replace("\u2019", "'").lower().rstrip(" ?.!…")
    text = _COURTESY_HEAD.sub("", _COURTESY_TAIL.sub("", text)).rstrip(" ?.!,…")
    for pattern, length in _compiled(tok.caption_rewrites):
        if pattern.fullmatch(text):
            return {"caption": length}
    for pattern, replacement in _compiled(tok.question_rewrites):
        m = pattern.fullmatch(text)
        if m:
            return {"question": m.expand(replacement)}
    return {"question": question}


# Words around a question that change nothing it asks ("Where’s the star?" curly, "Hey,
# what color...", "..., please?", "Is there a star? Answer yes or no."): with them, no rewrite
# matched, and the tiny model, trained on the bare forms, answered them far worse (EVAL.md).
_COURTESY_HEAD = re.compile(r"^(?:(?:please|hey|hi|hello|ok|okay|so)\b,? ?|(?:can|could|would) you (?:please )?"
                            r"(?=tell me |describe|caption|summari|count |give |write |name |identify |list ))+")
_COURTESY_TAIL = re.compile(r"(?:,? please|,? yes or no|[?.,]? (?:please )?answer (?:with )?(?:yes or no|in one word))$")


@functools.lru_cache(maxsize=8)
def _compiled(rewrites: tuple[tuple[str, str], ...]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(p), r) for p, r in rewrites]
