"""The README's Python examples run as written: a user copies them first (the pipelines example
had used `Choice` without importing it). Only what needs a camera is replaced: the example's
stream URL by a short clip."""

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image

from engine import Engine, EngineConfig
from pipelines.sources import FileSource

ROOT = Path(__file__).resolve().parent.parent


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_python_examples_run_as_written(tmp_path, capsys):
    engine_api, pipelines_api = _blocks()
    rgb = np.asarray(Image.open(ROOT / "sample_videos" / "scene.png").convert("RGB"))
    scope = {"rgb_uint8_HxWx3": rgb, "rgb": rgb, "next_rgb": rgb[::-1].copy()}
    exec(compile(engine_api, "README.md (Engine API)", "exec"), scope)
    assert scope["out"].finish_reason in ("stop", "length") and scope["out"].text
    assert scope["b"].result(timeout=60).text.isdigit() and scope["nxt"].done()
    printed = capsys.readouterr().out
    assert scope["out"].text in printed and "kv_pages_total" in printed

    clip = tmp_path / "door.mp4"
    subprocess.run([shutil.which("ffmpeg"), "-y", "-loglevel", "error", "-i",
                    str(ROOT / "sample_videos" / "cuts_640x360_30fps.mp4"), "-t", "1", "-c", "copy", str(clip)],
                   check=True)
    assert '"rtsp://cam/door"' in pipelines_api
    with Engine(EngineConfig(model="tiny")) as engine:
        scope = {"engine": engine}
        # A change holds after 5 answers: a loaded machine answered only 4 of the second's frames
        # offered at decoding speed (the rest dropped at intake), and nothing was printed
        code = pipelines_api.replace('"rtsp://cam/door"', repr(str(clip))).replace("AnswerChanges(hold=5)",
                                                                                  "AnswerChanges(hold=1)")
        exec(compile(code, "README.md (pipelines)", "exec"), scope)
    stats = scope["session"].stats()
    with FileSource(clip) as src:
        assert stats["completed"] >= 1 and stats["frames_in"] == len(list(src.frames(lazy=True)))
    assert re.search(r"^(yes|no) was None$", capsys.readouterr().out, re.M)  # the first answer is a change


def test_the_names_the_readme_says_to_import_are_where_it_says():
    """`A`, `B` and `C` from `module`: each name imports from that module (AnnotatedVideoSink had
    moved to pipelines.annotated and the README still sent users to pipelines.sinks)."""
    import importlib

    text = (ROOT / "README.md").read_text()
    said = re.findall(r"((?:`\w+`(?:,\s+|\s+and\s+))*`\w+`)\s+from\s+`([\w.]+)`", text)
    assert said
    missing = [f"{module}.{name}" for names, module in said for name in re.findall(r"`(\w+)`", names)
               if not hasattr(importlib.import_module(module), name)]
    assert not missing, missing


def _command_lines() -> list[tuple[str, str]]:
    """(command, text) of every `vlmstream COMMAND ...` the README shows: each synopsis line in a
    code block with the lines indented under it (a `# comment` left off), and each inline example."""
    text = (ROOT / "README.md").read_text()
    spans, fenced, command = [], False, None
    for line in text.splitlines():
        if line.startswith("```"):
            fenced, command = not fenced, None
            continue
        if fenced:
            m = re.match(r"vlmstream ([\w-]+)", line)
            command = m[1] if m else command if line.startswith(" ") else None
            if command:
                spans.append((command, line.split("  #")[0]))
    spans += re.findall(r"`vlmstream ([\w-]+) ([^`]*)`", text)
    return spans


def test_the_flags_the_readme_shows_are_the_commands_own_with_their_defaults():
    """A user copies a synopsis or an example: every --flag in it is one its command takes, and a
    `[--flag VALUE]` there shows the default (the parser's, or, where that is None because the
    default is decided later, the one its --help states)."""
    import argparse

    from app.parser import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    spans = _command_lines()
    assert {command for command, _ in spans} >= {"image", "video", "live", "ui", "bench", "train-tiny", "eval-tiny"}
    wrong = []
    for command, text in spans:
        flags = {o: a for a in commands[command]._actions for o in a.option_strings}
        wrong += [f"{command} {flag}: no such flag" for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text)
                  if flag not in flags]
        for flag, value in re.findall(r"\[(--[\w-]+) ([0-9][\w.,]*)\]", text):
            action = flags.get(flag)
            if action is None:
                continue
            if action.default is None:
                shown = f"default {value}" in (action.help or "")
            else:
                shown = (action.type(value) if action.type else value) == action.default
            if not shown:
                wrong.append(f"{command} [{flag} {value}]: the default is {action.default!r} ({action.help})")
    assert not wrong, wrong
