"""Where per-frame results go: JSONL, SRT, WebVTT, annotated MP4.

Every sink writes incrementally and flushes, so an interrupted run keeps what it finished.
Subtitles merge identical consecutive captions into one cue spanning their frames; a cue ends
where the next processed frame starts (the last one a frame duration after its start).
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import numpy as np

from .prompts import PROMPT_KEYS, answers_text, prompt_key, prompt_of

_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(obj) -> str:
    """One JSON line as every output writes it: UTF-8 text as it is, except a file name's bytes
    that are not UTF-8 (Python's surrogate escapes), written as \\udcXX escapes that read back as
    the same name. Raw, they were a UnicodeEncodeError traceback in a JSONL file, and a line a
    strict UTF-8 reader refused on standard output."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(obj, ensure_ascii=False))


@dataclass
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


def cut_partial_line(path: str | Path) -> None:
    """Cut a file of lines back to its last whole one: a last line a kill or a full disk left
    without its newline, appended to, joins the next run's first into one that is no JSON.
    Truncated in place: the file was rewritten, and a rewrite that failed (the disk full again)
    lost every line. Anything but a regular file is left alone."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        end = pos = f.seek(0, os.SEEK_END)
        while pos > 0:
            step = min(pos, 1 << 16)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            if pos + step == end and chunk.endswith(b"\n"):
                return
            i = chunk.rfind(b"\n")
            if i >= 0:
                f.truncate(pos + i + 1)
                return
        f.truncate(0)


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
        if append:  # drop a line an interruption cut short: its frame is redone
            cut_partial_line(self.path)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")

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
            except OSError:
                self._failed = True
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
        return (where[r.source], *k[1:])
    for raw in p.read_bytes().split(b"\n")[:-1]:
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
        self._f = open(path, "w", encoding="utf-8")
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
        self._f.write(f"{head}{_timestamp(start, sep)} --> {_timestamp(max(end, start + 0.001), sep)}\n{text}\n\n")
        self._f.flush()

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


def annotate(rgb: np.ndarray, text: str, info: str) -> np.ndarray:
    """A copy of the frame with its caption (each answer from a new line, wrapped to the frame's
    width, at most half the frame's height) and a line of info drawn in a band at the bottom."""
    h, w = rgb.shape[:2]
    # Sized by the height, and by the width for portrait frames: a phone's 1080x1920 video had
    # 96-px letters, 20 to the line. At most half the frame: a band taller than a small frame
    # (under 36 rows) left no room for the caption and the drawing failed (a 16x16 video).
    # Text that small is unreadable, but the frame is still written.
    band = max(1, min(max(18, min(h // 14, w // 24)), h // 2))
    lines = _wrapped(text, w, band)[: max(1, h // (2 * band))]
    top = h - (len(lines) + 1) * band
    img = np.array(rgb)  # a writable copy
    img[max(top, 0):h - band] = _caption_band(lines, w, band, (255, 255, 255))[max(-top, 0):]
    img[h - band:] = _band((info,), w, band, (255, 220, 0))  # new every frame: not cached
    return img


MAX_WORD = 200  # characters of one word drawn (a 5000-character "word" took 119 ms to lay out)


@functools.lru_cache(maxsize=64)
def _wrapped(text: str, width: int, band: int) -> tuple[str, ...]:
    """The text's lines broken between words to fit `width` pixels in the band's font (a long
    caption ran off the frame's right edge, its end lost). A word wider than that keeps a line.
    Each word is measured once (`_word_px`, cached: captions reuse their words), and a line's
    width is the sum of its words' and spaces'."""
    size, room = max(1, int(band * 0.7)), width - 12
    space = _word_px(" ", size)
    out: list[str] = []
    for answer in text.strip().splitlines():
        line, used = [], 0.0
        for word in answer.split():
            word = word[:MAX_WORD]
            px = _word_px(word, size)
            if line and used + space + px > room:
                out.append(" ".join(line))
                line, used = [], 0.0
            used += (space if line else 0.0) + px
            line.append(word)
        out.append(" ".join(line))
    return tuple(out) or ("",)


@functools.lru_cache(maxsize=4096)
def _word_px(word: str, size: int) -> float:
    return _font(size).getlength(word)


def _band(lines: tuple[str, ...], width: int, band: int, colour: tuple[int, int, int]) -> np.ndarray:
    """Lines of text on black, `band` pixels a line."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, band * len(lines)))
    draw, font = ImageDraw.Draw(img), _font(max(1, int(band * 0.7)))
    for i, line in enumerate(lines):
        draw.text((6, i * band + 2), line, fill=colour, font=font)
    out = np.asarray(img)
    out.flags.writeable = False
    return out


# A video's caption repeats for many frames, and drawing it is most of the cost of annotating one
# (~1 ms of ~2.4 at 640x360).
_caption_band = functools.lru_cache(maxsize=64)(_band)


def file_label(text: str, limit: int = 60) -> str:
    """A source (path, URL without credentials, session id) as part of a file name: runs of other
    characters than letters (of any script: 会議.mp4 had become '_'), digits, '.' and '-' become
    '_', and the last `limit` are kept, never starting with a dot (../clip.mp4's snapshots were
    hidden files, .._clip_0000000.jpg)."""
    return re.sub(r"[^\w.-]+", "_", text).strip("_")[-limit:].lstrip("._")


@functools.lru_cache(maxsize=8)
def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)  # Pillow's embedded scalable font: no system fonts needed


ANNOTATED_COMMENT = "annotated by vlmstream"


class AnnotatedVideoSink:
    """H.264 yuv420p MP4 of the processed frames, caption and latency drawn, original timing."""

    needs_rgb = True  # it draws on the frames (the other sinks write text only)

    def __init__(self, path: str | Path, width: int, height: int, fragmented: bool = False):
        """fragmented: an MP4 that plays up to its last second or so however the process ends
        (killed, out of memory, power lost), for open-ended recordings; otherwise the index goes
        first (it is written at the end), which players and browsers start from soonest."""
        import av

        self._av = av
        # yuv420p wants even sizes, 2x2 at least (a 1x1 video's came out 0 wide: the encoder refused it)
        self.width, self.height = max(2, width - width % 2), max(2, height - height % 2)
        self.path = Path(path)
        # A fragment a second, keyframe or not (decoding starts from the first one anyway), each
        # handed to the OS as it is cut.
        options = ({"movflags": "+empty_moov+default_base_moof", "frag_duration": "1000000", "flush_packets": "1"}
                   if fragmented else {"movflags": "+faststart"})
        # The file is ours to close: PyAV kept the descriptor of a file it had opened itself once
        # writing it failed (a full disk), one a failed recording, for the life of the server.
        self._file = open(path, "w+b", buffering=0)  # +: the index moved to the front is read back
        try:
            self._container = av.open(self._file, mode="w", options=options)
        except BaseException:
            self._file.close()
            raise
        # What tells our output from someone's video of the same name (app/outputs.py: a run
        # writes over the one, not the other)
        self._container.metadata["comment"] = ANNOTATED_COMMENT
        self._failed: BaseException | None = None  # the first write that failed
        self._stream = self._container.add_stream("libx264", rate=1000)
        self._stream.width, self._stream.height, self._stream.pix_fmt = self.width, self.height, "yuv420p"
        self._stream.time_base = __import__("fractions").Fraction(1, 1000)
        # One encoder thread: x264's own threads cost more CPU in all (3.6 against 2.2 ms a 640x360
        # frame here), taken from the engine's cores, beside which this sink always runs.
        self._stream.options = {"crf": "23", "preset": "veryfast", "threads": "1"}
        # No B-frames: a fragmented file has no edit list to start reordered frames at 0 s, and
        # without reordering the last packet is the last frame, which close(end) lengthens.
        self._stream.options["bf"] = "0"
        self._last_pts = -1
        self._held = None  # the newest packet (see _mux)
        self._closed = False

    def write(self, r: FrameResult, rgb: np.ndarray | None = None) -> None:
        self.write_frame([r], rgb)

    def write_frame(self, results: list[FrameResult], rgb: np.ndarray | None = None) -> None:
        if rgb is None:
            return
        r = results[0]
        info = f"#{r.index} {r.pts:.3f}s  {max(x.timings_ms.get('total', 0) for x in results):.0f} ms"
        self.write_image(rgb, frame_text(results), info, r.pts)

    def write_image(self, rgb: np.ndarray, text: str, info: str, seconds: float) -> None:
        """One frame with `text` and `info` drawn, shown from `seconds` on (until the next one)."""
        if self._failed is not None:  # the file is lost: a caller that goes on is told again
            raise self._failed
        img = annotate(self._fit(rgb), text, info)
        frame = self._av.VideoFrame.from_ndarray(img, format="rgb24")
        pts = max(int(round(seconds * 1000)), self._last_pts + 1)  # strictly increasing
        frame.pts, self._last_pts = pts, pts
        try:
            self._mux(self._stream.encode(frame))
        except BaseException as e:
            self._failed = e
            raise

    def _fit(self, rgb: np.ndarray) -> np.ndarray:
        """The frame at the video's size: a stream can change resolution on the way (an HLS
        rendition, a camera switching streams), and such frames were cropped to the first one's
        size. Scaled whole to fit, with black bars where the shape differs."""
        h, w = rgb.shape[:2]
        if h - h % 2 == self.height and w - w % 2 == self.width:
            return rgb[: self.height, : self.width]
        import cv2

        scale = min(self.width / w, self.height / h)
        fw, fh = max(1, round(w * scale)), max(1, round(h * scale))
        out = np.zeros((self.height, self.width, 3), np.uint8)
        top, left = (self.height - fh) // 2, (self.width - fw) // 2
        out[top: top + fh, left: left + fw] = cv2.resize(rgb, (fw, fh), interpolation=cv2.INTER_AREA)
        return out

    def close(self, end: float | None = None) -> None:
        """end: where the video ends, if known: the last frame is shown until then, as the last
        cue of the subtitles is (it lasted a millisecond, so a sampled video's annotated copy was
        shorter than the video, and a one-frame video's lasted 0.001 s)."""
        if self._closed:  # a second close: the file is whole already (it raised EOFError)
            return
        self._closed = True
        try:
            if self._failed is None:  # after a failed write, muxing again crashed the process (SIGSEGV)
                self._mux(self._stream.encode())
                last, self._held = self._held, None
                if last is not None:
                    if end is not None:
                        last.duration = max(last.duration or 0, round(end * 1000) - self._last_pts)
                    self._container.mux(last)
        finally:
            try:
                self._container.close()
            except Exception:
                if self._failed is None:
                    raise
            finally:
                try:
                    self._file.close()
                except OSError:  # what was left to flush: the failure was said already
                    if self._failed is None:
                        raise

    def _mux(self, packets) -> None:
        """Mux all but the newest packet, which is held: close() may lengthen it."""
        for packet in packets:
            if self._held is not None:
                self._container.mux(self._held)
            self._held = packet


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

    from PIL import Image

    label = file_label(source, 80) or "video"
    if label != source:
        label += "_" + hashlib.sha1(source.encode("utf-8", "surrogateescape")).hexdigest()[:6]
    path = folder / f"{label}_{index:07d}.jpg"
    Image.fromarray(np.ascontiguousarray(rgb)).save(path, quality=90)
    return path
