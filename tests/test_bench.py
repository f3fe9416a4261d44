import json
import re
import statistics
import time

import pytest

from app.cli import main
from engine.bench import BenchConfig, format_table


def test_bench_json_report(capsys, small_folder):
    argv = ["bench", "--model", str(small_folder), "--streams", "1,3", "--tokens", "6", "--repeats", "2",
            "--frames", "6", "--seconds", "0.5", "--json", "--device", "cpu:0"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [r["streams"] for r in report["results"]] == [1, 3]
    # each timed run counted to the total; the runs that fill --seconds said once, not counted
    counted = re.findall(r"^\[(\d+)/9\] ", err, re.M)
    assert counted == [str(k) for k in range(1, 10)] or counted[-1] == "9", err
    more = [r["streams"] for r in report["results"] if r["runs_per_mode"] > 2]
    assert re.findall(r"streams=(\d+) more runs, until each mode has run 0.5 s", err) == [str(n) for n in more], err
    assert report["device"] == "cpu"  # the device loaded, as image and eval-tiny say it: not as typed
    for r in report["results"]:
        assert r["identical_tokens"] is True
        for mode in ("pipelined", "blocking"):
            assert r[mode]["tokens_per_s"] > 0 and 0 < r[mode]["device_busy_fraction"] <= 1
            assert r[mode]["ttft_ms_p50"] > 0
        # the ratio pairs back-to-back runs, so that load drifting between runs cancels out
        assert len(r["pair_ratios"]) == r["runs_per_mode"] >= 2 and all(x > 0 for x in r["pair_ratios"])
        assert r["ratio"] == statistics.median(r["pair_ratios"])
        assert r["runs_per_mode"] > 2  # on past --repeats, until each mode had run --seconds
        # ... or until max_repeats (60): then the table says how long they ran, below the ">= 0.5 s"
        assert r["seconds_per_mode"] >= 0.5 or r["runs_per_mode"] == 60
    assert report["min_seconds"] == 0.5
    short = {**report, "results": [{**report["results"][0], "seconds_per_mode": 0.2, "runs_per_mode": 60}]}
    assert "(streams=1: 60 runs per mode, the most there are, took 0.2 s of the 0.5 s asked)" in format_table(short)
    assert "the most there are" not in format_table({**report, "results": [{**report["results"][0],
                                                                              "seconds_per_mode": 0.5}]})
    assert report["frame_rate"]["frames"] == 6 and report["frame_rate"]["frames_per_s"] > 0
    assert "6 frames in flight" in format_table(report)  # 8 at most, never more than it captioned
    assert all(r["tokens_made"] == 6 for r in report["results"])
    assert report["decode"] == "torchscript"  # the CPU default
    # which machine made the figures: the CPU's name and its bf16 instructions, no GPU here
    assert report["cpu"] and report["gpu"] is None


def test_bench_can_decode_eagerly_for_comparison(capsys, small_folder):
    argv = ["bench", "--model", str(small_folder), "--streams", "2", "--tokens", "4", "--repeats", "1",
            "--frames", "0", "--seconds", "0", "--no-script"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "decode=eager" in out and "True" in out.splitlines()[-1]  # tokens identical across modes
    assert "answers stopped" not in out
    # more tokens than the context holds: the table says how many each answer really had
    assert main(["bench", "--model", str(small_folder), "--streams", "1", "--tokens", "100000", "--repeats", "1",
                 "--frames", "0", "--seconds", "0"]) == 0
    assert "answers stopped at" in capsys.readouterr().out


def test_bench_bad_arguments(capsys):
    assert main(["bench", "--streams", "1,x"]) == 2
    assert main(["bench", "--streams", "0"]) == 2
    assert "error" in capsys.readouterr().err
    # one token has no decode rate (it divided by zero); 100000 streams' images filled 10 GB
    for flag, value, says in (("--tokens", "1", "--tokens must be >= 2"), ("--streams", "1,100000", "between 1 and 1024"),
                              ("--repeats", "0", "--repeats must be >= 1"),
                              ("--streams", "1,8,1", "--streams names 1 more than once"),
                              ("--frames", "-1", "--frames >= 0")):  # else BenchConfig's traceback
        assert main(["bench", flag, value]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="tokens must be >= 2"):
        BenchConfig(tokens=1)
    for bad in ("-1", "nan", "1e9"):
        assert main(["bench", f"--seconds={bad}"]) == 2
        err = capsys.readouterr().err
        assert "--seconds must be between 0 and 3600" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:  # argparse's own one line
        main(["bench", "--seconds", "soon"])
    assert e.value.code == 2 and "invalid float" in capsys.readouterr().err


def test_bench_json_says_what_was_asked(capsys, small_folder):
    """--no-vision-thread and --tokens reach the report (dropped, no test failed: the audit's
    survivors B12 and E3), one JSON object ending its line."""
    assert main(["bench", "--model", str(small_folder), "--streams", "1", "--tokens", "3", "--repeats", "1",
                 "--frames", "0", "--seconds", "0", "--no-vision-thread", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("}\n") and out.count("\n") == 1
    report = json.loads(out)
    assert report["vision_thread"] is False and report["tokens_per_request"] == 3


def test_bench_leaves_each_batch_size_s_first_run_out_of_its_figures(small_folder, monkeypatch):
    """A batch size's first steps are slow for reasons the modes share (TorchScript specialises on
    new shapes, the allocator grows): timed, they went to whichever mode ran first and skewed the
    ratio. Here a cold run reports no throughput at all; none may reach the figures."""
    from engine import bench

    real, seen = bench._run, set()

    def run(engine, depth, images, tokens):
        out = real(engine, depth, images, tokens)
        if (depth, len(images)) not in seen:
            seen.add((depth, len(images)))
            out = {**out, "tokens_per_s": 0.0, "device_busy_fraction": 0.0}
        return out

    monkeypatch.setattr(bench, "_run", run)
    report = bench.run_bench(bench.BenchConfig(model=str(small_folder), streams=(1, 3), tokens=4, repeats=1,
                                               frames=0, min_seconds=0.0))
    assert seen == {(2, 1), (1, 1), (2, 3), (1, 3)}
    for r in report["results"]:
        assert all(x > 0 for x in r["pair_ratios"])
        assert r["pipelined"]["tokens_per_s"] > 0 and r["blocking"]["tokens_per_s"] > 0


def test_an_interrupted_bench_reports_what_it_measured(small_folder, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) in a long bench (32 streams of Moondream 2 on a CPU: minutes) printed
    "vlmstream: interrupted" alone: the concurrencies measured by then were lost. They are printed
    now, said to be all there is, with the exit still 130; before any, it is the one line."""
    from engine import bench
    from engine.types import SamplingParams

    real = bench._run

    def run(engine, depth, images, tokens):
        if len(images) == 3:  # Ctrl-C while the second concurrency's requests decode
            for img in images:
                engine.submit(img, caption="normal", params=SamplingParams(max_tokens=100000, ignore_eos=True))
            raise KeyboardInterrupt
        return real(engine, depth, images, tokens)

    monkeypatch.setattr(bench, "_run", run)
    argv = ["bench", "--model", str(small_folder), "--streams", "1,3,5", "--tokens", "4", "--repeats", "1",
            "--frames", "0", "--seconds", "0"]
    assert main(argv + ["--json"]) == 130
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [r["streams"] for r in report["results"]] == [1] and report["results"][0]["identical_tokens"]
    assert report["interrupted"] is True and report["not_measured"] == [3, 5]
    assert err.splitlines()[-1] == "vlmstream: interrupted: streams=3,5 not measured"
    assert main(argv) == 130
    assert "(interrupted: streams=3,5 not measured)" in capsys.readouterr().out
    assert main([*argv[:4], "3", *argv[5:]]) == 130  # nothing measured yet: the one line
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == "vlmstream: interrupted"


def test_a_runs_window_starts_after_the_vision_thread_has_encoded_its_images(small_folder, monkeypatch):
    # The window (the busy fraction's, time to first token's) is meant to start once the images
    # are encoded; the wait for that read a count the engine thread fills only when it takes the
    # images from its inbox, so it could end at once and leave the encoding inside the window.
    from engine import Engine, EngineConfig
    from engine.bench import _images, _run
    from engine.runner import Runner

    slow = Runner.vision_prefix

    def vision_prefix(self, crops, tiling):
        time.sleep(0.3)
        return slow(self, crops, tiling)

    monkeypatch.setattr(Runner, "vision_prefix", vision_prefix)
    with Engine(EngineConfig(model=str(small_folder), vision_thread=True)) as engine:
        for depth in (2, 1):
            run = _run(engine, depth, _images(1, (120, 160)), 4)
            assert run["wall_s"] < 0.3 and run["ttft_ms_p50"] < 300


def test_the_frame_rate_of_a_model_slower_than_any_fixed_limit_is_measured(small_folder, monkeypatch):
    """Each frame's wait had a fixed 600 s: a slow model (Moondream 2 in fp32 on a CPU, 8 frames a
    batch) ended the run in a TimeoutError. Here every wait on a request runs 1000x fast (600 s:
    0.6 s) and each engine step takes 0.1 s: a frame's answer takes more steps than that."""
    from engine import Engine, EngineConfig
    from engine.batch import Batch
    from engine.bench import frame_rate
    from engine.request import RequestHandle

    commit, result = Batch.commit, RequestHandle.result
    monkeypatch.setattr(Batch, "commit", lambda self, record: (time.sleep(0.1), commit(self, record))[1])
    monkeypatch.setattr(RequestHandle, "result",
                        lambda self, timeout=None: result(self, None if timeout is None else timeout / 1000))
    with Engine(EngineConfig(model=str(small_folder))) as engine:
        assert frame_rate(engine, 4, (120, 160), inflight=4)["frames"] == 4


def test_decode_throughput_counts_requests_that_decode_in_turn_once():
    """Two requests of 101 tokens, the second decoding after the first (admitted in turn): the
    engine made 200 decode tokens in 2 s, 100 a second. Each request's own rate is 100 a second,
    and their sum had said 200, as if they had decoded side by side."""
    import types

    from engine.bench import _run
    from engine.types import RequestOutput, StageTimings

    spans = iter([(0.0, 1000.0), (1000.0, 2000.0)])  # (first token, last) ms after submission

    def submit(ref, **_):
        first, last = next(spans)
        out = RequestOutput("x", list(range(101)), "length",
                            StageTimings(decode=last - first, total=last, first_token=first))
        return types.SimpleNamespace(result=lambda timeout=None: out)

    ref = types.SimpleNamespace(_image=types.SimpleNamespace(awaits_vision=False), release=lambda: None)
    engine = types.SimpleNamespace(set_pipeline_depth=lambda d: None, encode_image=lambda img: ref,
                                   reset_stats=lambda: None, submit=submit,
                                   stats=lambda: types.SimpleNamespace(device_busy_fraction=1.0))
    run = _run(engine, 2, [None, None], 101)
    assert run["tokens_per_s"] == pytest.approx(100.0, rel=0.2)  # the two submissions are ms apart at most
