"""`vlmstream image` of several images, as a terminal shows its answers beside the progress bar."""

import io
import json
import sys
from pathlib import Path

import pytest

from app.cli import main

SCENE = Path(__file__).resolve().parents[1] / "sample_videos" / "scene.png"


def _shown(text: str) -> list[str]:
    """The lines a terminal shows for `text`: a carriage return goes back to the line's start."""
    shown = []
    for line in text.split("\n"):
        cur = ""
        for piece in line.split("\r"):
            cur = piece + cur[len(piece):]
        shown.append(cur.rstrip())
    return shown


@pytest.mark.parametrize("json_lines", [False, True])
def test_answers_are_not_glued_onto_the_progress_bar(tmp_path, small_folder, monkeypatch, json_lines):
    """Standard output and standard error on one terminal: each answer had been written where the
    bar's line ended ("images:   0%|...| 0/2 [...]a.png: a red circle")."""
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(SCENE.read_bytes())
    b.write_bytes(SCENE.read_bytes())
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    argv = ["image", str(a), str(b), "--model", str(small_folder), "--max-tokens", "4"]
    assert main(argv + (["--json"] if json_lines else [])) == 0
    answers = [line for line in _shown(terminal.getvalue()) if str(tmp_path) in line]
    assert len(answers) == 2, terminal.getvalue()
    if json_lines:
        assert [json.loads(line)["image"] for line in answers] == [str(a), str(b)]
    else:
        assert [line.split(": ", 1)[0] for line in answers] == [str(a), str(b)]


def test_ctrl_c_says_how_many_images_were_answered_and_keeps_their_lines(tmp_path, small_folder, monkeypatch,
                                                                         capsys):
    """Ctrl-C in a folder of images said "interrupted" alone, where eval-tiny and bench say
    what they had done; the answers written stay written."""
    import app.image

    for name in "abcd":
        (tmp_path / f"{name}.png").write_bytes(SCENE.read_bytes())
    reads = []
    real = app.image._timed_read

    def read_then_ctrl_c(path):
        reads.append(path)
        if len(reads) == 4:  # the fourth image being read: the three before are answered by then
            raise KeyboardInterrupt
        return real(path)

    monkeypatch.setattr(app.image, "_timed_read", read_then_ctrl_c)
    monkeypatch.setattr(app.image, "IMAGES_IN_FLIGHT", 0)  # each answered before the next is read
    assert main(["image", str(tmp_path), "--model", str(small_folder), "--max-tokens", "4"]) == 130
    out, err = capsys.readouterr()
    assert [line.split(": ", 1)[0] for line in out.splitlines()] == [str(tmp_path / f"{n}.png") for n in "abc"]
    assert err.splitlines()[-1] == "vlmstream: interrupted: 3 of 4 images answered", err
