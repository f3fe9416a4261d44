"""What the web UI asks about every frame: engine tasks from the form's fields (prompt kind,
questions one a line, a constraint for all or one after a question). Every mistake is a UIError."""

from __future__ import annotations

import json

from app.errors import UIError

# Questions a form may ask about every frame (or the image): as many as one batch of the engine
# runs (EngineConfig.max_batch_size). Every line was a request of its own: one page's 5,000 lines
# put another page's caption 12 s behind them (67 ms alone), the engine's queue shared by all.
MAX_QUESTIONS = 32


def make_task(kind: str, question: str = "", constraint_kind: str = "none",
              constraint_text: str = "", regions: bool = False) -> dict | list[dict]:
    """Keyword arguments for `Engine.submit`: kind 'short' | 'normal' | 'long' (a caption) or
    'question', plus an optional constraint (see `make_constraint`). Several questions, one a
    line, give one task each (asked together about every frame, the constraint on each). A
    question may carry its own constraint after its question mark (`inline_constraint`), which
    then replaces the form's for it. With `regions` (the video tabs), kind 'detect' or 'point'
    gives {kind: the object named in the question's box}."""
    if regions and kind in ("detect", "point"):
        lines = [q.strip() for q in (question or "").splitlines() if q.strip()]
        if len(lines) != 1:
            raise UIError(f"name one object to {kind} (a word or a few, in the box below the prompt)")
        if constraint_kind not in ("none", "", None):
            raise UIError(f"a constraint goes with captions and questions, not {kind}")
        return {kind: lines[0]}
    if kind == "question":
        lines = [q.strip() for q in (question or "").splitlines() if q.strip()]
        if not lines:
            raise UIError("the question is empty")
        if len(lines) > MAX_QUESTIONS:
            raise UIError(f"{len(lines)} questions: at most {MAX_QUESTIONS}, one a line")
        tasks = [inline_constraint(q) for q in lines]
        if len({t["question"] for t in tasks}) != len(tasks):
            raise UIError("a question is asked twice")
    elif kind in ("short", "normal", "long"):
        tasks = [{"caption": kind}]
    else:
        raise UIError(f"unknown prompt {kind!r}")
    constraint = make_constraint(constraint_kind, constraint_text or "")
    if constraint is not None:
        for t in tasks:
            t.setdefault("constraint", constraint)
    return tasks[0] if len(tasks) == 1 else tasks


def inline_constraint(line: str) -> dict:
    """One question line: `Is the door open? [yes, no]` (choices) or `How many people? /[0-9]+/`
    (a regex) carry their own constraint after the question mark; any other line is the question
    alone."""
    for i, c in enumerate(line):
        if c != "?":
            continue
        rest = line[i + 1:].strip()
        if len(rest) >= 2 and (rest[0], rest[-1]) in (("[", "]"), ("/", "/")):
            text = rest[1:-1]
            return {"question": line[:i + 1].strip(),
                    "constraint": make_constraint("choices" if rest[0] == "[" else "regex", text)}
    return {"question": line}


def make_constraint(kind: str, text: str):
    """kind: 'none' | 'choices' (comma or newline separated) | 'regex' | 'json schema'."""
    from engine import Choice, JsonSchema, Regex

    if kind in ("none", "", None):
        return None
    if not text.strip():
        raise UIError(f"the {kind} constraint is empty")
    if kind == "choices":
        options = [o.strip() for o in text.replace("\n", ",").split(",") if o.strip()]
        return Choice(options)
    if kind == "regex":
        return Regex(text)
    if kind == "json schema":
        try:
            return JsonSchema(json.loads(text))
        except json.JSONDecodeError as e:
            raise UIError(f"the JSON schema is not valid JSON: {e.msg} (line {e.lineno})") from None
    raise UIError(f"unknown constraint kind {kind!r}")
