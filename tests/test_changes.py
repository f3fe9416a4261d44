"""`live --changes`: answers reported when they change, after holding for --hold frames."""

import json
import re
import shutil
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.cli import main
from engine.types import RequestOutput
from pipelines.changes import AnswerChanges
from pipelines.live import LiveResult
from pipelines.sources import Frame

CLIP = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
PROMPTS = [{"question": "Is the door open?"}, {"question": "How many people?"}]


def results(answers: list[tuple[str, str]]):
    for i, texts in enumerate(answers):
        yield LiveResult(Frame("cam", i, i / 10, None), [RequestOutput(t, [], "stop") for t in texts], 5.0, PROMPTS)


def events(hold: int, answers):
    tracker = AnswerChanges(hold)
    out = [(r.frame.index, c.prompt, c.text, c.previous, c.since_pts, c.previous_since_pts)
           for r in results(answers) for c in tracker.update(r)]
    assert tracker.count == len(out)
    return out


def test_every_change_is_reported_once_with_what_it_replaced():
    answers = [("no", "one"), ("no", "one"), ("yes", "one"), ("yes ", "two"), ("no", "two")]
    assert events(1, answers) == [
        (0, 0, "no", None, 0.0, None), (0, 1, "one", None, 0.0, None),
        (2, 0, "yes", "no", 0.2, 0.0),
        (3, 1, "two", "one", 0.3, 0.0),
        (4, 0, "no", "yes", 0.4, 0.2),
    ]


def test_a_new_answer_counts_once_it_has_held():
    answers = [("no", "one"), ("no", "one"), ("no", "one"), ("yes", "one"), ("no", "one"),  # a one-frame flicker
               ("yes", "one"), ("yes", "one"), ("yes", "one"), ("yes", "two"), ("yes", "three"), ("yes", "three"),
               ("yes", "three")]
    assert events(3, answers) == [
        (2, 0, "no", None, 0.0, None), (2, 1, "one", None, 0.0, None),
        (7, 0, "yes", "no", 0.5, 0.0),  # dated from the first of its three frames in a row
        (11, 1, "three", "one", 0.9, 0.0),  # "two" never held
    ]
    with pytest.raises(ValueError):
        AnswerChanges(0)


def test_the_same_things_named_in_another_order_are_no_change():
    """Captions list objects in no fixed order; a watcher wants to hear when what is named
    changes, not the order. Swapped colours, a changed part or another count still change."""
    caption = "a red circle, a green circle and a red star"
    answers = [(caption, "Yes"), ("a red star, a green circle and a red circle", "yes."),
               ("a green circle and a red star, a red circle", " YES"),
               ("a red circle, a green star and a red star", "yes"),  # a shape changed
               ("a green circle, a red circle and a red star", "no"),
               ("a green star, a red circle and a red star", "no")]  # the star and circle swap colours
    assert [(i, p, t) for i, p, t, *_ in events(1, answers)] == [
        (0, 0, caption), (0, 1, "Yes"), (3, 0, "a red circle, a green star and a red star"),
        (4, 0, "a green circle, a red circle and a red star"), (4, 1, "no"),
        (5, 0, "a green star, a red circle and a red star")]
    # with --hold, a reordered answer continues the run it reorders; the event has the wording
    # of the frame that completed it, and dates from the run's first frame
    held = events(2, [("a cat and a dog", "x"), ("a dog and a cat", "x"), ("a dog, a bird", "x"),
                      ("a bird and a dog", "x"), ("a cat and a dog", "x")])
    assert [(i, p, t, prev, since) for i, p, t, prev, since, _ in held] == [
        (1, 0, "a dog and a cat", None, 0.0), (1, 1, "x", None, 0.0),
        (3, 0, "a bird and a dog", "a dog and a cat", 0.2)]


def test_a_constrained_answers_order_is_its_own():
    """A constrained answer's format is the user's (`--regex '[0-9]+,[0-9]+'`, a JSON list): `1,2`
    then `2,1` is a change, where a caption naming the same things in another order is none."""
    from pipelines.changes import ChangedAnswersSink
    from pipelines.caption_log import extend_log
    from pipelines.sinks import FrameResult

    answers = [("a cat and a dog", "1,2"), ("a dog and a cat", "2,1"), ("a dog and a cat", "2, 1.")]
    tracker = AnswerChanges()
    got = [(r.frame.index, c.prompt, c.text) for r in results(answers) for c in tracker.update(r, in_order={1})]
    assert got == [(0, 0, "a cat and a dog"), (0, 1, "1,2"), (1, 1, "2,1")]  # spacing and end punctuation aside
    plain = AnswerChanges()
    assert [c.prompt for r in results(answers) for c in plain.update(r)] == [0, 1]  # as captions

    class Lines:
        def __init__(self):
            self.rows = []

        def write_records(self, records):
            self.rows += records

    lines = Lines()
    sink = ChangedAnswersSink(lines, in_order={(None, "Q")})  # video --changes: the constrained prompts' keys
    for i, text in enumerate(["1,2", "2,1", "2,1"]):
        sink.write_frame([FrameResult("clip.mp4", i, i / 10, text, [], "stop", {}, {"question": "Q"})])
    assert [r["text"] for r in lines.rows] == ["1,2", "2,1"]
    log: deque = deque()  # the web UI's log: a run of the same answers
    assert [extend_log(log, 0.0, i, i, t, 5.0, in_order=True) for i, t in enumerate(["1,2", "2,1"])] == [True, True]
    log.clear()
    assert [extend_log(log, 0.0, i, i, t, 5.0) for i, t in enumerate(["1,2", "2,1"])] == [True, False]


def test_video_changes_of_a_constrained_caption_keep_its_reorders(tmp_path, capsys):
    """`video --changes` with a constraint: a reordered answer is an event (the clip's captions
    name the same shapes in a new order on several frames), end to end."""
    from pipelines.changes import answer_key

    common = [str(CLIP), "--caption", "short", "--regex", "[a-z ,]+"]
    full, events = tmp_path / "all.jsonl", tmp_path / "events.jsonl"
    assert main(["video", *common, "-o", str(full)]) == 0
    rows = [json.loads(line) for line in full.read_text().splitlines()]
    exact = [r["index"] for a, r in zip([None, *rows], rows) if a is None or answer_key(a["text"], True)
             != answer_key(r["text"], True)]
    reorders = [r["index"] for a, r in zip(rows, rows[1:]) if answer_key(a["text"]) == answer_key(r["text"])
                and answer_key(a["text"], True) != answer_key(r["text"], True)]
    assert reorders  # what this test is about: without the constraint, no event
    assert main(["video", *common, "--changes", "-o", str(events)]) == 0
    assert [json.loads(line)["index"] for line in events.read_text().splitlines()] == exact
    capsys.readouterr()


def test_live_changes_follow_the_constrained_prompts_in_their_order(tmp_path, capsys, monkeypatch):
    """`live --changes` tells its trackers which prompts are constrained (here the second)."""
    asked = []
    update = AnswerChanges.update
    monkeypatch.setattr(AnswerChanges, "update", lambda self, r, in_order=(): asked.append(set(in_order))
                        or update(self, r, in_order))
    assert main(["live", str(CLIP), "--duration", "1", "--caption", "short", "--question", "How many shapes are there?",
                 "--regex", "one|two|three|four", "--changes", "-o", str(tmp_path / "events.jsonl")]) == 0
    assert asked and all(a == {1} for a in asked)
    capsys.readouterr()


def test_an_answers_parts_are_whole_words_and_events_carry_it_trimmed():
    """"and" splits an answer only as a word: inside "candle" or "sand" it had cut the caption into
    pieces, and two captions that differ only in those pieces' places read as the same. An
    answer's surrounding spaces (a model's leading space) are not part of the event or of what it
    replaced."""
    from pipelines.changes import answer_key

    assert answer_key("A candle and a sand castle.") == (("a candle", "a sand castle"),)
    assert answer_key("a sandy cat and a dog") != answer_key("a dog and a s, y cat")
    tracker = AnswerChanges()
    assert tracker.observe("door", " open\n", 0.0).text == "open"
    change = tracker.observe("door", " closed ", 0.5)
    assert (change.text, change.previous) == ("closed", "open")


def test_a_live_events_line_is_its_own_prompts_since_its_first_frames_own_time():
    """Of a frame's prompts, the line of a change is the prompt that changed, and its `since` is
    the pts of the frame the answer began on to the microsecond, as `pts` is: at 30 fps, rounded
    to the millisecond, it matched no frame's time."""
    tracker = AnswerChanges()
    rows = []
    for i, texts in enumerate([("no", "one"), ("no", "two")]):
        result = LiveResult(Frame("cam", i, round(i / 30, 6), None), [RequestOutput(t, [], "stop") for t in texts],
                            5.0, PROMPTS)
        rows.append(AnswerChanges.records(result, tracker.update(result)))
    assert [r["question"] for r in rows[0]] == [p["question"] for p in PROMPTS]
    ((row,),) = rows[1:]
    assert (row["question"], row["text"], row["previous"]) == ("How many people?", "two", "one")
    assert row["since"] == row["pts"] == 0.033333


def test_live_changes_log_is_a_chain_of_events(tmp_path, capsys):
    log = tmp_path / "events.jsonl"
    assert main(["live", str(CLIP), "--duration", "6", "--question", "How many shapes are there?",
                 "--choices", "one,two,three,four", "--changes", "--hold", "3", "-o", str(log), "--json",
                 "--snapshots", str(tmp_path / "shots")]) == 0
    stats = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    # the clip cuts from four shapes to one at 4 s: at least that change, each event replacing the last
    assert len(rows) == stats["changes"] >= 2 and stats["completed"] > 3 * len(rows)
    assert rows[0]["previous"] is None and rows[0]["text"] == "four"
    assert all(b["previous"] == a["text"] != b["text"] and b["since"] >= a["since"] for a, b in zip(rows, rows[1:]))
    assert all(r["since"] <= r["pts"] for r in rows)
    assert set(rows[0]) == {"source", "index", "pts", "text", "token_ids", "finish_reason", "timings_ms", "question",
                            "time", "previous", "since", "snapshot", "model"}
    # each change's frame, as a picture named so that names sort in time order
    shots = [Path(r["snapshot"]) for r in rows]
    assert sorted(shots) == shots == sorted((tmp_path / "shots").iterdir())
    with Image.open(shots[-1]) as im:
        assert im.format == "JPEG" and im.size == (640, 360)
    # the frame the new answer began on, as the web UI's pictures (it was the one that confirmed
    # it, two frames later with --hold 3); the clip is 30 fps
    assert all(p.name.endswith(f"_{round(r['since'] * 30)}.jpg") and r["since"] < r["pts"] for p, r in zip(shots, rows))
    assert main(["live", str(CLIP), "--hold", "2"]) == 2
    assert main(["live", str(CLIP), "--snapshots", str(tmp_path / "s")]) == 2
    (tmp_path / "file").write_text("")
    assert main(["live", str(CLIP), "--changes", "--snapshots", str(tmp_path / "file" / "s")]) == 2
    err = capsys.readouterr().err
    assert "--hold N goes with --changes" in err and "--snapshots goes with --changes" in err
    assert "cannot create the output folder" in err


def test_several_sources_name_their_snapshots_as_their_recordings(tmp_path, capsys):
    """With several sources, a snapshot's name says which source it is from, by the name its
    recording has (the file's name): it had carried the file's whole path."""
    other = tmp_path / "door cam.mp4"
    other.write_bytes(CLIP.read_bytes())
    log = tmp_path / "events.jsonl"
    assert main(["live", str(CLIP), str(other), "--duration", "3", "--max-tokens", "4", "--changes",
                 "-o", str(log), "--snapshots", str(tmp_path / "shots"), "--annotate", str(tmp_path / "rec") + "/"]) == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    names = {Path(r["source"]).name: Path(r["snapshot"]).name for r in rows}
    assert set(names) == {CLIP.name, other.name}
    recorded = sorted(p.stem.split("_", 1)[1] for p in (tmp_path / "rec").iterdir())
    assert recorded == ["cuts_640x360_30fps", "door_cam"]
    for source, name in [(CLIP.name, recorded[0]), (other.name, recorded[1])]:
        assert re.fullmatch(rf"\d{{8}}T\d{{6}}\.\d{{3}}Z_{name}_\d+\.jpg", names[source]), names


def test_a_snapshot_that_cannot_be_written_stops_the_run_but_keeps_the_change(tmp_path, capsys, monkeypatch):
    import app.live_files

    def disk_full(folder, label, r):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(app.live_files, "save_change_frame", disk_full)
    log = tmp_path / "events.jsonl"
    assert main(["live", str(CLIP), "--duration", "20", "--question", "How many shapes are there?", "--changes",
                 "--snapshots", str(tmp_path / "shots"), "-o", str(log)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write a snapshot in {tmp_path / 'shots'}: No space left on device" in err
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["snapshot"] is None and rows[0]["previous"] is None


def test_a_snapshot_the_disk_had_no_room_for_leaves_no_cut_off_picture(tmp_path, capsys, monkeypatch):
    """A JPEG cut off by a full disk was left among the pictures, named as one (its lower half
    grey), though its line said `"snapshot": null`; `video --changes` left one too."""
    from pipelines.sinks import save_snapshot

    def disk_full_midway(self, fp, *args, **kwargs):
        Path(fp).write_bytes(b"\xff\xd8\xff\xe0" + bytes(4096))  # what fitted
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", disk_full_midway)
    shots, log = tmp_path / "shots", tmp_path / "events.jsonl"
    assert main(["live", str(CLIP), "--duration", "20", "--question", "How many shapes are there?", "--changes",
                 "--snapshots", str(shots), "-o", str(log)]) == 1
    assert f"cannot write a snapshot in {shots}: No space left on device" in capsys.readouterr().err
    assert [json.loads(line)["snapshot"] for line in log.read_text().splitlines()] == [None]
    assert list(shots.iterdir()) == []
    with pytest.raises(OSError, match="No space left"):
        save_snapshot(shots, str(CLIP), 7, np.zeros((8, 8, 3), np.uint8))
    assert list(shots.iterdir()) == []


def expected_changes(rows: list[dict], hold: int) -> list[tuple]:
    """What `video --changes --hold N` should keep of a full run's lines: written here afresh from
    the definition (per source and prompt, N lines in a row naming the same things in any order,
    dated from the first)."""
    def same(text):
        return sorted(p.strip(" .") for p in text.lower().replace(" and ", ",").split(","))

    out, current, pending = [], {}, {}
    for r in rows:
        key, text = (r["source"], r.get("question") or r.get("caption")), r["text"].strip()
        if key in current and same(current[key][0]) == same(text):
            pending.pop(key, None)
            continue
        first, n = pending[key][1:] if key in pending and same(pending[key][0]) == same(text) else (r["pts"], 0)
        n += 1
        if n < hold:
            pending[key] = (text, first, n)
            continue
        pending.pop(key, None)
        out.append((r["source"], r["index"], key[1], text, current.get(key, (None,))[0], first))
        current[key] = (text, first)
    return out


def test_video_changes_keeps_exactly_the_changed_answers_of_a_full_run(tmp_path, capsys):
    """Two files into one JSONL, two prompts each: the lines of `--changes` are those of a full run
    whose answer differs from its file's and prompt's last one, each with what it replaced."""
    other = tmp_path / "other.mp4"
    other.write_bytes(CLIP.read_bytes())  # a second source with the same answers: followed on its own
    common = [str(CLIP), str(other), "--fps", "3", "--question", "How many shapes are there?",
              "--choices", "one,two,three,four", "--caption", "short"]
    full, events = tmp_path / "all.jsonl", tmp_path / "events.jsonl"
    assert main(["video", *common, "-o", str(full)]) == 0
    rows = [json.loads(line) for line in full.read_text().splitlines()]
    kept = []
    for hold in (1, 2):
        assert main(["video", *common, "--changes", "--hold", str(hold), "-o", str(events)]) == 0
        got = [json.loads(line) for line in events.read_text().splitlines()]
        # the files run side by side: their lines interleave in the JSONL, each file's in frame order
        assert sorted([(r["source"], r["index"], r.get("question") or r.get("caption"), r["text"].strip(),
                        r["previous"], r["since"]) for r in got], key=lambda x: x[:2]) \
            == sorted(expected_changes(rows, hold), key=lambda x: x[:2])
        by_key = {(r["source"], r["index"], r.get("question") or r.get("caption")): r for r in rows}
        assert all({k: v for k, v in r.items() if k not in ("previous", "since", "timings_ms")}
                   == {k: v for k, v in by_key[r["source"], r["index"], r.get("question") or r.get("caption")].items()
                       if k != "timings_ms"} for r in got)
        assert f", {len(got)} changes," in capsys.readouterr().err
        kept.append(len(got))
    assert kept[1] < kept[0]  # some answers flickered for a single frame
    # the clip cuts from four shapes to one at 4 s and to three at 8: both files report both cuts
    counts = [(r["source"], r["text"], r["since"]) for r in got if "question" in r]
    for source in (str(CLIP), str(other)):
        assert [(t, s) for src, t, s in counts if src == source][:2] == [("four", 0.0), ("one", 4.0)]
    assert len(got) < len(rows) / 3


def test_video_changes_on_the_terminal_and_its_mistakes(tmp_path, capsys):
    assert main(["video", str(CLIP), "--fps", "2", "--question", "How many shapes are there?", "--changes"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[0].split() == ["0.000", "four"] and lines[1].split() == ["4.000", "one", "(was:", "four)"]
    assert all("(was: " in line for line in lines[1:])
    # with --hold 2 each line still says when its answer began, not the frame that held it
    assert main(["video", str(CLIP), "--fps", "2", "--question", "How many shapes are there?", "--changes",
                 "--hold", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[0].split() == ["0.000", "four"] and lines[1].split() == ["4.000", "one", "(was:", "four)"]
    events, shots = tmp_path / "events.jsonl", tmp_path / "shots"
    assert main(["video", str(CLIP), "--fps", "2", "--question", "How many shapes are there?", "--changes",
                 "-o", str(events), "--snapshots", str(shots)]) == 0
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    paths = [Path(r["snapshot"]) for r in rows]
    assert len(rows) >= 2 and sorted(shots.iterdir()) == sorted(paths) == paths  # names sort in time order
    with Image.open(paths[1]) as im:
        assert im.format == "JPEG" and im.size == (640, 360)
    assert all(p.name.endswith(f"_{r['index']:07d}.jpg") for p, r in zip(paths, rows))
    # with --hold 2, the picture is the frame the answer began on, a sampled frame before the line's
    shutil.rmtree(shots)
    assert main(["video", str(CLIP), "--fps", "2", "--question", "How many shapes are there?", "--changes",
                 "--hold", "2", "-o", str(events), "--snapshots", str(shots)]) == 0
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    assert len(rows) >= 2 and all(r["index"] - round(r["since"] * 30) == 15 for r in rows)
    assert [Path(r["snapshot"]).name[-11:] for r in rows] == [f"{round(r['since'] * 30):07d}.jpg" for r in rows]
    for bad, message in [(["--snapshots", str(shots)], "--snapshots goes with --changes"),
                         (["--changes", "--snapshots", str(shots)], "--snapshots needs a JSONL output"),
                         (["--hold", "2"], "--hold N goes with --changes"),
                         (["--changes", "--hold", "0"], "--hold N goes with --changes"),
                         (["--changes", "--resume", "-o", str(tmp_path / "a.jsonl")], "--resume could not tell"),
                         (["--changes", "-o", str(tmp_path / "a.srt")], "--changes reports in JSONL"),
                         (["--changes", "-o", f"{tmp_path}/", "--format", "vtt"], "--changes reports in JSONL"),
                         (["--sticky", "-1"], "--sticky must be a number >= 0")]:
        assert main(["video", str(CLIP), *bad]) == 2
        assert message in capsys.readouterr().err


def test_sources_keep_their_own_file_names_where_they_can(tmp_path, monkeypatch):
    """door_2.mp4 beside a/door.mp4 and b/door.mp4: b's recording and snapshots had been named
    door_2, and door_2.mp4's door_2_3."""
    from app.live_files import file_names

    for name in ("door_2.mp4", "a/door.mp4", "b/door.mp4"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    for sources, want in [(["a/door.mp4", "b/door.mp4", "door_2.mp4"], ["door_1", "door_3", "door_2"]),
                          (["door_2.mp4", "a/door.mp4", "b/door.mp4"], ["door_2", "door_1", "door_3"]),
                          (["a/door.mp4", "b/door.mp4"], ["door_1", "door_2"]),
                          (["-", "door_2.mp4"], ["stdin", "door_2"])]:  # standard input: not "-"
        assert file_names(sources, sources) == want


def test_every_video_gets_its_own_snapshot_names(tmp_path):
    """Two videos of a run wrote one picture where their names met once cut to ASCII: 会議.mp4 and
    講義.mp4 (both '_'), clip.mp4 and clip.mkv (the extension dropped), 'a b' and 'a_b'; each JSONL
    line then named a picture of the other video."""
    from pipelines.sinks import save_snapshot

    rgb = np.zeros((8, 8, 3), np.uint8)
    sources = ["jp/会議.mp4", "jp/講義.mp4", "c/clip.mp4", "c/clip.mkv", "a b.mp4", "a_b.mp4", "c_clip.mp4",
               "x/" + "long" * 40 + "1.mp4", "y/" + "long" * 40 + "1.mp4"]
    names = [save_snapshot(tmp_path, s, 7, rgb).name for s in sources]
    assert len(set(names)) == len(names) and len(list(tmp_path.iterdir())) == len(names), names
    assert names[5] == "a_b.mp4_0000007.jpg" and names[0].startswith("jp_会議.mp4_")  # readable, sorted by video
    assert all(n.endswith("_0000007.jpg") for n in names)
    # a long path keeps its end, the video's own name (its start, the folders, is what goes)
    assert all("long1.mp4_" in n for n in names[7:]), names[7:]


def test_detect_snapshots_of_listed_sources_are_named_as_their_recordings(tmp_path, small_folder):
    """`live --sources cams.txt --detect OBJECT --changes --snapshots DIR`: a snapshot carried the
    source's label as it was (`Front door_7.jpg`, where its recording is Front_door.mp4), and a
    label with a slash (a name `Gate/North`, a URL's `rtsp://***@cam/live`) made a path into folders
    that are not there: "cannot write a snapshot", and the run stopped at its first change."""
    cams = tmp_path / "cams.txt"
    other, third = tmp_path / "gate.mp4", tmp_path / "side.mp4"
    other.write_bytes(CLIP.read_bytes())
    third.write_bytes(CLIP.read_bytes())
    # two names that make one file name: numbered, the snapshots as the recordings
    cams.write_text(f"Front door = {CLIP}\nGate/North = {other}\nFront_door = {third}\n")
    shots, log = tmp_path / "shots", tmp_path / "log.jsonl"
    assert main(["live", "--sources", str(cams), "--detect", "circle", "--model", str(small_folder),
                 "--duration", "2", "--changes", "-o", str(log), "--snapshots", str(shots),
                 "--annotate", str(tmp_path / "rec") + "/"]) == 0
    recorded = sorted(p.stem.split("_", 1)[1] for p in (tmp_path / "rec").iterdir())
    assert recorded == ["Front_door_1", "Front_door_2", "Gate_North"]
    saved = sorted(p.name for p in shots.iterdir())
    assert {re.fullmatch(r"\d{8}T\d{6}\.\d{3}Z_(.+)_\d+\.jpg", n).group(1) for n in saved} == set(recorded), saved
