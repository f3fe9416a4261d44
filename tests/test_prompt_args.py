"""Constrained answers from the command line: --choices, --regex, --json-schema in image, video
and live, each belonging to the prompt written before it."""

import json
import re
from pathlib import Path

import pytest

from app.cli import main
from app.parser import build_parser
from app.prompt_args import UsageError, prompt_tasks, region_task
from engine import Choice, JsonSchema, Regex
from engine.models.loader import load_model
from engine.reference import ReferenceDecoder
from engine.types import SamplingParams
from pipelines.image_file import read_image

ROOT = Path(__file__).resolve().parents[1]
SCENE = ROOT / "sample_videos" / "scene.png"
CLIP = ROOT / "sample_videos" / "cuts_640x360_30fps.mp4"
SCHEMA = {"type": "object", "properties": {"count": {"enum": ["one", "two", "three"]}}, "required": ["count"]}


def tasks_of(*argv):
    return prompt_tasks(build_parser().parse_args(["video", "clip.mp4", *argv]))


def test_a_constraint_belongs_to_the_prompt_before_it():
    tasks = tasks_of("--caption", "short", "--question", "Is the door open?", "--choices", "yes, no,yes",
                     "--question", "How many?", "--regex", "[0-9]+")
    assert tasks == [{"caption": "short"},
                     {"question": "Is the door open?", "constraint": Choice(["yes", "no"])},
                     {"question": "How many?", "constraint": Regex("[0-9]+")}]
    # with one prompt, the place does not matter; the default caption takes it too
    assert tasks_of("--choices", "a,b", "--question", "Q") == [{"question": "Q", "constraint": Choice(["a", "b"])}]
    assert tasks_of("--regex", "x+") == [{"caption": "short", "constraint": Regex("x+")}]
    assert tasks_of("--caption", "long", "--json-schema", json.dumps(SCHEMA), "--question", "Q")[0] == {
        "caption": "long", "constraint": JsonSchema(SCHEMA)}


@pytest.mark.parametrize("argv, needle", [
    (["--choices", "a,b", "--question", "Q1", "--question", "Q2"], "write --choices after the --question"),
    (["--question", "Q", "--choices", "a", "--regex", "b"], "--choices and --regex given for one prompt"),
    (["--caption", "short", "--caption", "long", "--question", "Q", "--choices", "a,b"], "--caption is given twice"),
    (["--choices", " , "], "--choices needs at least one choice"),
    (["--regex", "("], "--regex is not a valid regular expression"),
    (["--regex", ""], "--regex is empty"),
    # a POSIX class to outlines-core, a '[' and letters to Python: it printed two FutureWarnings
    # with our source lines, and answers (`ayes`) that Python's own match refuses
    (["--regex", "[[:alpha:]]+"], "is ambiguous (possible nested set"),
    (["--regex", "[a-z&&b]+"], "is ambiguous (possible set intersection"),
    # groups 500 deep: Python's regex parser recursed, a RecursionError traceback and exit 1
    (["--regex", "(?:" * 500 + "a" + ")" * 500], "--regex: the regex is nested too deep"),
    (["--json-schema", "missing.json"], "no such file 'missing.json'"),
    (["--json-schema", "/dev/null"], "not a regular file '/dev/null'"),
    # JSON, but no object: it said "no such file '[]'"
    (["--json-schema", "[]"], "--json-schema must be a JSON object (a schema), not []"),
    (["--json-schema", " true"], "--json-schema must be a JSON object (a schema), not true"),
    (["--json-schema", '{"type": '], "--json-schema is not valid JSON"),
    (["--json-schema", '{"type": "object"} [1]'], "--json-schema is not valid JSON"),
    # asked twice, a frame's two lines had one key: --resume took them for one answer
    (["--question", "Q", "--question", "Q"], "a --question is asked twice"),
    # `--question "$Q"` with Q blank: asked of every frame as a question of spaces
    (["--question", "Q", "--question", "  "], "--question is empty"),
])
def test_constraint_mistakes_are_usage_errors(argv, needle):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing but the one line reaches the user
        with pytest.raises(UsageError, match=re.escape(needle)):
            tasks_of(*argv)


def test_a_schema_file_that_holds_no_object_is_a_usage_error(tmp_path):
    for text in ("[1]", "true", '"string"'):
        path = tmp_path / "schema.json"
        path.write_text(text)
        with pytest.raises(UsageError, match="--json-schema must be a JSON object"):
            tasks_of("--json-schema", str(path))


def test_a_json_schema_nested_too_deep_is_one_line_not_a_traceback(tmp_path):
    """`--json-schema deep.json`, arrays of arrays a thousand deep: RecursionError tracebacks,
    exit 1, from Python's JSON reader (a thousand levels) or from the schema's preparation for
    outlines-core (a few hundred: its deepcopy)."""
    from engine.constraints import ConstraintError, to_regex

    def nested(levels):  # as text: json.dumps recurses too
        return '{"type": "array", "items": ' * levels + '{"type": "integer"}' + "}" * levels

    path = tmp_path / "deep.json"
    path.write_text(nested(2000))
    with pytest.raises(UsageError, match="--json-schema is not valid JSON: nested too deep"):
        tasks_of("--json-schema", str(path))
    with pytest.raises(ConstraintError, match="cannot use the JSON schema: it is nested too deep"):
        to_regex(tasks_of("--json-schema", nested(600))[0]["constraint"])


def test_image_answers_within_the_constraint_as_the_reference_decoder_does(capsys, small_folder, tmp_path):
    # random weights: whatever the answer is, the constraint alone makes it one of the choices
    choices = ["red", "green", "blue"]
    assert main(["image", str(SCENE), "--model", str(small_folder), "--question", "What color?",
                 "--choices", ",".join(choices), "--max-tokens", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["text"] in choices and r["finish_reason"] == "stop"
    ref = ReferenceDecoder(load_model(str(small_folder))).generate(
        read_image(SCENE), question="What color?", params=SamplingParams(max_tokens=8), constraint=Choice(choices))
    assert r["token_ids"] == ref.token_ids
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(["image", str(SCENE), "--model", str(small_folder), "--json-schema", str(schema),
                 "--max-tokens", "40", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["finish_reason"] == "stop" and json.loads(r["text"])["count"] in SCHEMA["properties"]["count"]["enum"]


def test_image_constraint_that_cannot_compile_is_one_line(capsys, small_folder):
    assert main(["image", str(SCENE), "--model", str(small_folder), "--regex", "(?=a)a"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlmstream: error: cannot compile") and err.count("\n") == 1


def test_video_questions_each_keep_their_constraint(tmp_path, small_folder, capsys):
    out = tmp_path / "out.jsonl"
    base = ["video", str(CLIP), "--model", str(small_folder), "--fps", "1", "--max-tokens", "6", "-o", str(out)]
    assert main(base + ["--caption", "short", "--question", "Is there a star?", "--choices", "yes,no",
                        "--question", "How many shapes?", "--regex", "[1-4]"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 * 16  # a 16-second clip at one frame a second, three answers each
    stars = [r["text"] for r in rows if r.get("question") == "Is there a star?"]
    counts = [r["text"] for r in rows if r.get("question") == "How many shapes?"]
    assert len(stars) == len(counts) == 16
    assert set(stars) <= {"yes", "no"} and all(re.fullmatch("[1-4]", t) for t in counts)
    assert all("constraint" not in r for r in rows)
    # a pattern that parses but cannot compile stops the run before the JSONL is touched
    before = out.read_text()
    assert main(base + ["--question", "Q", "--regex", "(?=a)a"]) == 2
    assert out.read_text() == before and "cannot compile" in capsys.readouterr().err


def test_live_answers_within_the_constraint(tmp_path, small_folder, capsys):
    log = tmp_path / "log.jsonl"
    assert main(["live", str(CLIP), "--model", str(small_folder), "--duration", "1.5", "--max-tokens", "4",
                 "--question", "Is there a star?", "--choices", "yes,no", "-o", str(log), "--json"]) == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) > 4 and {r["text"] for r in rows} <= {"yes", "no"}


def test_resumed_lines_without_a_prompt_record_the_question_not_its_constraint(tmp_path):
    from pipelines.sinks import done_frames

    old = tmp_path / "old.jsonl"  # a line from before lines named their prompt
    old.write_text(json.dumps({"source": "v.mp4", "index": 0, "pts": 0.0, "text": "yes", "token_ids": [5]}) + "\n")
    (r,) = done_frames(old, {"question": "Q", "constraint": Choice(["yes", "no"])}).values()
    assert r.prompt == {"question": "Q"} and json.loads(r.to_json())["question"] == "Q"


@pytest.mark.parametrize("argv", [
    ["image", "scene.png", "--question", "Is there a star?", "--question", "How many?"],
    ["image", "scene.png", "--caption", "long", "--caption", "short"],
    ["image", "scene.png", "--detect", "star", "--detect", "circle"],
    ["video", "clip.mp4", "--point", "star", "--point", "circle"],
    ["live", "clip.mp4", "--detect", "star", "--detect", "circle"],
])
def test_a_prompt_that_takes_one_value_given_twice_is_a_mistake_not_the_last_one(argv, capsys):
    """`image` asks one prompt (the README: "image asks one"); a second --question had silently
    replaced the first (exit 0, one answer), where a second --choices was already refused."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "given twice" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, needle", [
    (["video", "clip.mp4", "--detect", "  "], "--detect names no object"),
    # a constraint alone beside a region task (no --caption or --question) was ignored without a word
    (["video", "clip.mp4", "--point", "star", "--choices", "a,b"], "--point gives places, not answers"),
    # `--seed 0` is a seed given, though 0 is falsy
    (["image", "scene.png", "--detect", "star", "--seed", "0"],
     "--seed goes with captions and questions, not --detect"),
    (["video", "clip.mp4", "--detect", "star", "--no-vision-thread"],
     "--no-vision-thread goes with captions and questions, not --detect"),
])
def test_region_task_mistakes_are_usage_errors(argv, needle):
    with pytest.raises(UsageError, match=re.escape(needle)):
        region_task(build_parser().parse_args(argv))


def test_a_region_object_is_asked_without_the_spaces_around_it():
    # " star" is another prompt to the model than "star" (the spaces of a quoted shell variable)
    assert region_task(build_parser().parse_args(["video", "clip.mp4", "--detect", " red circle "])) == (
        "detect", "red circle")
