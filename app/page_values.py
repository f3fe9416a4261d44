"""A web page's values as the UI's events read them, and what they send back.

`number`: a number box's value (empty keeps a default); `user_error`: a user's mistake as a
one-line `gr.Error`; `upload_named`: an error naming an upload by its own name; `markdown_text`:
text shown as written in a Markdown note; `new_shots`: change pictures only when a page lacks
some; `unread`: the updates Gradio holds for a page that it has not read.
"""

import math
from pathlib import Path

from app.errors import UIError


def unread(demo, session: str) -> int | None:
    """The updates Gradio holds for a page that its stream has not read yet (None where this
    Gradio keeps them elsewhere: its queue's internals, read defensively)."""
    try:
        pending = demo._queue.pending_messages_per_session.get(session)
        return None if pending is None else int(pending.qsize())
    except Exception:  # another Gradio: no backpressure, as before
        return None


def upload_named(e: Exception, path: str | None) -> Exception:
    """The error with an uploaded file named by its name, not by Gradio's scratch path
    (/tmp/gradio/be5207.../clip.mp4 is not a readable video...)."""
    if not path or path not in str(e):
        return e
    return UIError(str(e).replace(path, Path(path).name))


def user_error(message: str) -> Exception:
    """A mistake of the page's user: said on the page in one line, and not logged with a traceback
    in the server's console (Gradio printed one for every such error)."""
    import gradio as gr

    return gr.Error(message, print_exception=False)


def number(value, default: int | float, what: str) -> int | float:
    """A number box's value: empty (None) keeps `default`; else a finite number, whole where
    `default` is (a whole one that is not is left for the check that says so)."""
    if value is None or value == "":
        return default
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UIError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise UIError(f"{what} must be a finite number, got {value!r}")
    return int(x) if isinstance(default, int) and x == int(x) else x


def new_shots(shots: list, shown: float | None) -> tuple[list | None, float | None]:
    """(the feed's change pictures if the page lacks some, else None; what the page then shows):
    pictures go to a page only when there are new ones. `shown` is the newest picture's time
    (unique across the feeds a page may follow, whose change numbers each start at 1)."""
    if not shots or shots[-1].wall == shown:
        return None, shown
    return shots, shots[-1].wall


def markdown_text(text: str) -> str:
    """`text` shown as written in a Markdown note (a file named like_this_*draft*.mp4)."""
    return "".join("\\" + c if c in "\\`*_[]<>#|~" else c for c in text)
