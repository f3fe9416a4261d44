"""Where per-frame results go: JSONL, SRT, WebVTT, and (`pipelines.annotated`) an annotated MP4.

Every sink writes incrementally and flushes, so an interrupted run keeps what it finished.
Subtitles merge identical consecutive captions into one cue spanning their frames; a cue ends
where the next processed frame starts (the last one a frame duration after its start).
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import numpy as np

from .output_file import cut_partial_line, name_write_error, open_output
from .prompts import PROMPT_KEYS, answers_text, prompt_key, prompt_of

_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(obj) -> str:
    """One JSON line as every output writes it: UTF-8 text as it is, except a file name's bytes
    that are not UTF-8 (Python's surrogate escapes), written as \\udcXX escapes that read back as
    the same name. Raw, they were a UnicodeEncodeError traceback in a JSONL file, and a line a
    strict UTF-8 reader refused on standard output."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(obj, ensure_ascii=False))


@dataclass(slots=True)  # no per-object dict: --resume holds one per answer already written
class FrameResult:
    """One prompt's answer about one frame. `prompt` is the task it answers, {"caption": "short"}
    or {"question": "..."}; its key and value are fields of the JSON line."""

    source: str
    index: int
    pts: float
    text: str
    token_ids: list[int]
    finish_reason: str
    timings_ms: dict[str, float]
    prompt: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # the model that answered (`engine.models.loader.model_id`): --resume checks it

    def to_dict(self) -> dict:
        """The JSON line's fields: the prompt's key and value among them."""
        d = asdict(self)
        prompt = d.pop("prompt")
        if d["model"] is None:
            del d["model"]
        return {**d, **prompt}

    def to_json(self) -> str:
        return json_text(self.to_dict())

    @classmethod
    def from_json(cls, line: str) -> "FrameResult":
        """Raises ValueError (json.JSONDecodeError is one), KeyError or TypeError on a bad line."""
        obj = json.loads(line)
        return cls(str(obj["source"]), int(obj["index"]), float(obj["pts"]), str(obj["text"]),
                   [int(t) for t in obj.get("token_ids", [])], str(obj.get("finish_reason", "stop")),
                   {str(k): float(v) for k, v in obj.get("timings_ms", {}).items()},
                   {k: str(obj[k]) for k in PROMPT_KEYS if k in obj},
                   obj["model"] if isinstance(obj.get("model"), str) else None)

    def key(self) -> tuple:
        """What --resume finds this answer by (`done_frames`)."""
        return source_key(self.source), self.index, prompt_key(self.prompt)


def source_key(source: str) -> str:
    """A source as --resume matches it: a local path made absolute, so that clip.mp4, ./clip.mp4
    and /home/me/clip.mp4 (a folder given as vids or /home/me/vids) are one file (spelt otherwise,
    every frame was asked again and appended twice); a URL as written (its credentials ***)."""
    if "://" in source or source == "-":
        return source
    return os.path.abspath(os.path.expanduser(source))


def frame_text(results: list[FrameResult]) -> str:
    return answers_text([r.prompt for r in results], [r.text for r in results])


class JsonlSink:
    """One JSON object per processed frame; appends (a resumed run continues the file) or, with
    `append=False`, starts the file afresh.
    Thread-safe: several files captioned at once share one JSONL."""

    holds_done = True  # a resumed run's recorded frames are already in it: not written again

    def __init__(self, path: str | Path | TextIO, append: bool = True):
        self._lock = threading.Lock()
        self._failed = False  # a write failed (a full disk): said then, not again at close
        if not isinstance(path, (str, Path)):  # an open stream (standard output): written, not closed
            self.path, self._f, self._own = None, path, False
            return
        self.path, self._own = Path(path), True
        self._f = open_output(self.path, "a" if append else "w")
        if append:  # drop a line an interruption cut short: its frame is redone
            try:
                cut_partial_line(self.path)
            except BaseException:
                self._f.close()
                raise

    def write(self, r: FrameResult, rgb: np.ndarray | None = None) -> None:
        self.write_frame([r], rgb)

    def write_frame(self, results: list[FrameResult], rgb: np.ndarray | None = None) -> None:
        self.write_records([r.to_dict() for r in results])

    def write_records(self, records: list[dict]) -> None:
        text = "".join(json_text(x) + "\n" for x in records)
        with self._lock:
            try:
                self._f.write(text)
                self._f.flush()
            except OSError as e:
                self._failed = True
                name_write_error(e, self.path)
                raise

    def close(self, end: float | None = None) -> None:
        """end: where the video ends (the other sinks' argument; lines need none)."""
        if self._own:
            try:
                self._f.close()  # the fd is closed even when its last flush fails
            except OSError:
                if not self._failed:
                    raise


def done_frames(path: str | Path, default_prompt: dict[str, str] | None = None,
                warn: Callable[[str], None] | None = None) -> dict[tuple, FrameResult]:
    """Every answer a previous run wrote to this JSONL, by `FrameResult.key()` (for --resume): a
    resumed run does not ask again, and replays them into its other outputs (subtitles, annotated
    MP4). Lines without a prompt (written before lines named theirs) count as `default_prompt`'s.
    What follows the last newline is what an interruption cut short, whole-looking or not:
    JsonlSink drops it, so its frame is asked again (counted done, a whole last line without its
    newline was lost). Other lines that are no answer are skipped, and `warn` says how many. A
    JSONL of the answers that changed (`--changes`) is a VlmstreamError: it holds no frame's in between."""
    done: dict[tuple, FrameResult] = {}
    p = Path(path)
    if not p.exists():
        return done
    bad, where, changes = 0, {}, False
    # Each line's source, model and prompt are one of a few: held once. A resumed run holds every
    # answer of its JSONL, and with a copy of each, a line took 2.3 KB (1.7 now): 2.7 GB for a
    # 10-hour video at 30 fps.
    names: dict = {}  # sources and models
    prompts: dict = {}  # the prompt dicts and their keys, by their items
    beside = os.path.dirname(os.path.abspath(p))

    def key(r: FrameResult) -> tuple:
        # A relative source is a path from where the first run ran, unknown now. From here, or
        # else from the JSONL's folder (a run that wrote `-o out.jsonl` where it ran): resumed
        # from another folder, every frame had been asked again and appended twice.
        k = r.key()
        if r.source not in where:
            at = k[0]
            if "://" not in r.source and not os.path.isabs(os.path.expanduser(r.source)) and not os.path.exists(at):
                there = os.path.normpath(os.path.join(beside, os.path.expanduser(r.source)))  # ../clip.mp4
                at = there if os.path.exists(there) else at
            where[r.source] = at
        return where[r.source], k[1], prompts.setdefault(k[2], k[2])

    with open(p, "rb") as f:  # a line at a time: read whole, a 10-hour run's JSONL was 400 MB more at once
        for raw in f:
            if not raw.endswith(b"\n"):  # what an interruption cut short
                break
            if not raw.strip():
                continue
            try:  # a byte cut mid-character is a UnicodeDecodeError (a ValueError); an index of 1e999 an OverflowError
                text = raw.decode("utf-8")
                r = FrameResult.from_json(text)
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
                bad += 1
                continue
            if not r.prompt and default_prompt:
                r.prompt = prompt_of(default_prompt)  # the task may carry a constraint: not a field
            r.source, r.model = names.setdefault(r.source, r.source), names.setdefault(r.model, r.model)
            r.prompt = prompts.setdefault(tuple(r.prompt.items()), r.prompt)
            changes = changes or '"since"' in text and {"previous", "since"} <= json.loads(text).keys()
            done[key(r)] = r
    if changes:  # its frames in between are not there: all would be asked again, and appended out of order
        from engine.errors import VlmstreamError

        raise VlmstreamError(f"{p} holds the answers that changed (written with --changes), not every frame's: "
                             "--resume cannot continue it; write to another file")
    if bad and warn is not None:
        warn(f"{p}: {bad} line(s) that are not answers skipped")
    return done


def _timestamp(seconds: float, sep: str) -> str:
    ms = max(0, int(round(seconds * 1000)))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


class SubtitleSink:
    """SRT (`fmt="srt"`) or WebVTT (`fmt="vtt"`) cues from per-frame captions."""

    def __init__(self, path: str | Path, fmt: str, frame_duration: float):
        """frame_duration: how long a frame's answer stands for, the time between the frames
        processed (every frame's, or a sample's); the last cue lasts that long."""
        self.fmt, self.frame_duration, self.path = fmt, frame_duration, Path(path)
        self._f = open_output(path, "w")
        if fmt == "vtt":
            self._f.write("WEBVTT\n\n")
        self._cue: list = []  # [start, text, last_pts]
        self._n = 0

    def write(self, r: FrameResult, rgb: np.ndarray | None = None) -> None:
        self.write_frame([r], rgb)

    def write_frame(self, results: list[FrameResult], rgb: np.ndarray | None = None) -> None:
        self.write_text(results[0].pts, frame_text(results))

    def write_text(self, pts: float, text: str) -> None:
        """The text of the frame at `pts` (frames in order): one cue while it stays the same."""
        if self._f.closed:  # it had been kept, then lost without a word
            raise ValueError("the subtitle file is closed")
        if self._cue and text == self._cue[1]:
            self._cue[2] = pts
            return
        if self._cue:
            self._emit(self._cue[0], pts, self._cue[1])
        self._cue = [pts, text, pts]

    def _emit(self, start: float, end: float, text: str) -> None:
        text = cue_text(text, self.fmt)
        if not text:
            return
        self._n += 1
        sep = "," if self.fmt == "srt" else "."
        head = f"{self._n}\n" if self.fmt == "srt" else ""
        try:
            self._f.write(f"{head}{_timestamp(start, sep)} --> {_timestamp(max(end, start + 0.001), sep)}\n{text}\n\n")
            self._f.flush()
        except OSError as e:
            name_write_error(e, self.path)
            raise

    def close(self, end: float | None = None) -> None:
        """end: where the video ends, if known: the last cue stops there rather than a whole
        sample's time after its frame (sampled every 0.5 s of a 16 s clip, it ended at 15.53 s)."""
        try:
            if self._cue:
                stop = self._cue[2] + self.frame_duration
                if end is not None and end > self._cue[2]:
                    stop = min(stop, end)
                cue, self._cue = self._cue, []
                self._emit(cue[0], stop, cue[1])
        finally:  # the file goes whatever its last cue did (a full disk): a server had kept it open
            try:
                self._f.close()
            except OSError:  # what was left to flush: the write above said it already, if it failed
                pass


def cue_text(text: str, fmt: str) -> str:
    """An answer as a cue's text. A blank line would end the cue, and a line holding "-->" reads
    as a timing line (players dropped it): blank lines go, and in WebVTT &, < and > are escaped
    (a "<b>" in an answer was applied as bold, a bare & is not allowed); SRT has no escapes, so
    its "-->" (or "--->"...) becomes "->"."""
    lines = [line for line in text.splitlines() if line.strip()]
    if fmt == "vtt":
        lines = [line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") for line in lines]
    else:
        lines = [re.sub(r"--+>", "->", line) for line in lines]  # one pass of "-->" left "--->" as "-->"
    return "\n".join(lines)


def file_label(text: str, limit: int = 60) -> str:
    """A source (path, URL without credentials, session id) as part of a file name: runs of other
    characters than letters (of any script: 会議.mp4 had become '_'), digits, '.' and '-' become
    '_', and the last `limit` are kept, never starting with a dot (../clip.mp4's snapshots were
    hidden files, .._clip_0000000.jpg)."""
    return re.sub(r"[^\w.-]+", "_", text).strip("_")[-limit:].lstrip("._")


def close_all(sinks, end: float | None = None) -> None:
    """Close every sink (None: none made), whatever the others do, and raise the first error
    after: one whose close raised (a full disk) had left the rest open, an annotated MP4
    unfinished and its file held."""
    first = None
    for sink in sinks:
        if sink is None:
            continue
        try:
            sink.close(end)
        except Exception as e:
            first = first or e
    if first is not None:
        raise first


def save_snapshot(folder: Path, source: str, index: int, rgb: np.ndarray) -> Path:
    """A change's frame as a JPEG named by its video and frame index, so that names sort by
    video, then time (`video --changes --snapshots`, with captions or places). Where the name
    is not the path as given (a folder's '/', a space, a long path cut), a short hash of the path
    keeps two videos apart: a/b.mp4 and a_b.mp4 (as clip.mp4 and clip.mkv, and any two names of
    other scripts, before) had written one file, each line naming the other's picture."""
    import hashlib

    label = file_label(source, 80) or "video"
    if label != source:
        label += "_" + hashlib.sha1(source.encode("utf-8", "surrogateescape")).hexdigest()[:6]
    return save_jpeg(folder / f"{label}_{index:07d}.jpg", rgb)


def save_jpeg(path: Path, rgb: np.ndarray) -> Path:
    """A change's picture. One the disk had no room for is removed: a cut-off JPEG (its lower
    half grey) was left among the pictures, named as one, though its line said no snapshot."""
    from PIL import Image

    try:
        Image.fromarray(np.ascontiguousarray(rgb)).save(path, quality=90)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    return path
