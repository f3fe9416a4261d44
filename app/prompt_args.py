"""The prompt arguments of `image`, `video` and `live`: what each frame is asked, and how its
answers may be constrained.

    --caption short|normal|long     a caption
    --question TEXT                 a question (repeatable in video and live)
    --choices A,B,...               the answer is one of these
    --regex PATTERN                 the answer fully matches this regular expression
    --json-schema FILE|JSON         the answer is JSON valid against this schema

A constraint belongs to the prompt written before it (`--question "Is the door open?" --choices
yes,no --question "How many people?" --regex "[0-9]+"`); with one prompt its place does not
matter. Every mistake is a UsageError before the model loads, except a pattern or schema that
parses but cannot be compiled over the model's vocabulary, which the engine's
`check_constraint` reports (ConstraintError) before any frame is asked.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from app.errors import UsageError

CONSTRAINT_FLAGS = {"choices": "--choices", "regex": "--regex", "json_schema": "--json-schema"}


class _InOrder(argparse.Action):
    """Stores like `store` (or `append`) and also notes the order prompts and constraints came in,
    so that a constraint can belong to the prompt before it."""

    def __init__(self, *args, append: bool = False, **kwargs):
        self.append = append
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.prompt_order = [*(getattr(namespace, "prompt_order", None) or []), (self.dest, values)]
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values] if self.append
                else values)


def add_prompt_args(p: argparse.ArgumentParser, more: str = "") -> None:
    """video and live: --caption and any number of --question, each with its constraint."""
    p.add_argument("--caption", choices=["short", "normal", "long"], action=_InOrder,
                   help="caption length (default short, when no --question is asked)")
    p.add_argument("--question", metavar="TEXT", action=_InOrder, append=True,
                   help="a question asked about every frame; repeat it for several (with --caption too: "
                        "all share each frame's image encoding)" + more)
    add_constraint_args(p, several=True)


def add_constraint_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    where = (" (of the --question or --caption written before it, when there are several)" if several else "")
    p.set_defaults(prompt_order=[])
    p.add_argument("--choices", metavar="A,B,...", action=_InOrder,
                   help="the answer is exactly one of these, separated by commas" + where)
    p.add_argument("--regex", metavar="PATTERN", action=_InOrder,
                   help="the answer fully matches this regular expression" + where)
    p.add_argument("--json-schema", metavar="FILE|JSON", action=_InOrder,
                   help="the answer is JSON valid against this schema: a file, or the schema itself" + where)


def region_task(args: argparse.Namespace) -> tuple[str, str] | None:
    """--detect OBJECT / --point OBJECT: ("detect" | "point", the object), or None without them.
    An empty object, or a prompt or constraint beside them, is a UsageError."""
    if getattr(args, "detect", None) is None and getattr(args, "point", None) is None:
        return None
    task, what = ("detect", args.detect) if args.detect is not None else ("point", args.point)
    if not what.strip():
        raise UsageError(f"--{task} names no object")
    if getattr(args, "caption", None) or getattr(args, "question", None) or args.prompt_order:
        raise UsageError(f"--{task} gives places, not answers: it goes without --caption, --question and their "
                         "constraints (run them separately)")
    # What shapes a decoded answer, or where images are encoded for the engine: the region
    # protocol has neither, and each was ignored without a word
    for flag, dest in (("--max-tokens", "max_tokens"), ("--temperature", "temperature"), ("--top-p", "top_p"),
                       ("--seed", "seed"), ("--no-vision-thread", "no_vision_thread")):
        given = getattr(args, dest, None)
        if given is not None and given is not False:  # `--seed 0` too (0 == False)
            raise UsageError(f"{flag} goes with captions and questions, not --{task} (places are decoded greedily "
                             "by the region protocol, beside the engine)")
    return task, what.strip()


def or_default(value, default):
    """An option's value, or its default where it was not given (None: so that a region task can
    tell an option given from one left alone)."""
    return default if value is None else value


def prompt_tasks(args: argparse.Namespace, default_caption: str = "short") -> list[dict]:
    """The prompts as `Engine.submit` keywords ({"caption": kind} or {"question": text}, with a
    "constraint" where one was given), in the order given; every one is asked about every frame."""
    questions = [] if args.question is None else args.question  # '' is a question, and an empty one
    if isinstance(questions, str):  # image: one question
        questions = [questions]
    if any(not q.strip() for q in questions):
        raise UsageError("--question is empty")
    if len(set(questions)) != len(questions):
        raise UsageError("a --question is asked twice")
    tasks = ([{"caption": args.caption}] if args.caption else []) + [{"question": q} for q in questions]
    tasks = tasks or [{"caption": default_caption}]
    order = getattr(args, "prompt_order", None) or []
    if sum(dest == "caption" for dest, _ in order) > 1:  # argparse keeps the last: which one was meant?
        raise UsageError("--caption is given twice (a frame gets one caption; ask more with --question)")
    by_value = {(("caption" if "caption" in t else "question"), t.get("caption") or t["question"]): t
                for t in tasks}
    current: dict | None = tasks[0] if len(tasks) == 1 else None
    given: dict[int, str] = {}  # id of a task -> the constraint flag it has
    for dest, value in order:
        if dest in ("caption", "question"):
            if len(tasks) > 1:
                current = by_value[(dest, value)]
            continue
        flag = CONSTRAINT_FLAGS[dest]
        if current is None:
            raise UsageError(f"with several prompts, write {flag} after the --question (or --caption) it constrains")
        if id(current) in given:
            raise UsageError(f"{given[id(current)]} and {flag} given for one prompt; a prompt takes one constraint")
        given[id(current)] = flag
        current["constraint"] = parse_constraint(dest, value)
    return tasks


def check_constraints(engine, tasks: list[dict]) -> None:
    """Compile every prompt's constraint on the loaded model: one that parses but cannot compile
    over its vocabulary is a ConstraintError (exit 2) here, not at the first frame."""
    for t in tasks:
        if "constraint" in t:
            engine.check_constraint(t["constraint"])


def parse_constraint(dest: str, value: str):
    """One constraint flag's value as an engine constraint; a UsageError for a mistake."""
    from engine import Choice, JsonSchema, Regex

    if dest == "choices":
        options = list(dict.fromkeys(o.strip() for o in value.split(",") if o.strip()))
        if not options:
            raise UsageError("--choices needs at least one choice (separated by commas)")
        return Choice(options)
    if dest == "regex":
        if not value:
            raise UsageError("--regex is empty")
        from engine.constraints import ConstraintError, check_read_alike

        try:
            check_read_alike(value)
            re.compile(value)
        except re.error as e:
            raise UsageError(f"--regex is not a valid regular expression: {e}") from None
        except ConstraintError as e:
            raise UsageError(f"--regex: {e}") from None
        return Regex(value)
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value)
        if not path.is_file() and _is_json(value):  # `[]`, `true`: JSON, but no schema object
            raise UsageError("--json-schema must be a JSON object (a schema), not " + value.strip()[:40])
        if not path.is_file():
            what = "not a regular file" if path.exists() else "no such file"  # /dev/null, a folder
            raise UsageError(f"--json-schema: {what} {value!r} (give a file, or the schema itself as JSON)")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--json-schema: cannot read {value}: {e}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--json-schema is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:  # a thousand levels deep: Python's JSON reader recurses (a traceback, exit 1)
        raise UsageError("--json-schema is not valid JSON: nested too deep") from None
    if not isinstance(schema, dict):
        raise UsageError("--json-schema must be a JSON object (a schema)")
    return JsonSchema(schema)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
