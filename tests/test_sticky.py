"""Sticky greedy (SamplingParams.sticky): while an answer repeats its draft, the draft's next
token is kept unless the best token beats it by more than the margin. The engine must give the
reference decoder's answer for every draft, margin, batch and pipeline depth."""

import numpy as np
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import RequestError
from engine.models.loader import load_model
from engine.reference import ReferenceDecoder

IMAGES = [np.random.default_rng(20 + i).integers(0, 256, size=(40 + 20 * i, 60 + 30 * i, 3), dtype=np.uint8)
          for i in range(3)]
MARGINS = [0.05, 0.3, 1.0, 1e6]


@pytest.fixture(scope="module")
def reference(small_folder):
    return ReferenceDecoder(load_model(small_folder))


@pytest.fixture(scope="module")
def greedy(reference):
    return [reference.generate(img, caption="short", params=SamplingParams(max_tokens=12)).token_ids
            for img in IMAGES]


def _cases(greedy):
    """(image, draft, margin): each image's answer with another image's answer (and variants) as its draft."""
    cases = []
    for i in range(len(IMAGES)):
        other = greedy[(i + 1) % len(IMAGES)]
        mixed = greedy[i][:4] + other[4:]
        for draft in (other, mixed, other[:5], greedy[i]):
            cases.extend((i, draft, m) for m in MARGINS)
    return cases


@pytest.mark.parametrize("depth,max_draft,budget", [(2, 16, 64), (1, 16, 512), (2, 1, 64), (2, 0, 24)])
def test_the_engine_keeps_what_the_reference_keeps(small_folder, reference, greedy, depth, max_draft, budget):
    cases = _cases(greedy)
    want = [reference.generate(IMAGES[i], caption="short", params=SamplingParams(max_tokens=12, sticky=m),
                               draft=d).token_ids for i, d, m in cases]
    # the margins matter: some answers are the greedy ones, some the draft, some neither
    assert any(w == greedy[i] for w, (i, _, _) in zip(want, cases))
    assert any(w != greedy[i] and w != d[:12] for w, (i, d, _) in zip(want, cases))
    assert all(w == d[:12] for w, (_, d, m) in zip(want, cases) if m == 1e6 and len(d) >= 12)
    with Engine(EngineConfig(model=str(small_folder), pipeline_depth=depth, max_draft=max_draft,
                             max_batch_size=8, prefill_token_budget=budget, debug_checks=True)) as eng:
        handles = [eng.submit(IMAGES[i], caption="short", params=SamplingParams(max_tokens=12, sticky=m), draft=d)
                   for i, d, m in cases]
        got = [h.result(timeout=60).token_ids for h in handles]
    assert eng.stats().kv_pages_in_use == 0  # after close: pages go back just after the results come
    assert got == want


@pytest.fixture(scope="module")
def constrained(reference):
    """(image, constraint, draft, margin) cases and the reference's sticky answers to them."""
    from engine import Choice, Regex

    choice, regex = Choice(["red", "green", "blue", "yellow"]), Regex(r"(one|two|three)( shapes)?")
    tok = reference.loaded.tokenizer
    cases = [(i, c, tok.encode(word), m) for i in range(len(IMAGES)) for m in (0.5, 3.0, 1e6)
             for c, word in [(choice, "green"), (choice, "yellow"), (choice, "blue star"), (regex, "two shapes"),
                             (regex, "four")]]
    want = [reference.generate(IMAGES[i], question="What is it?", params=SamplingParams(max_tokens=6, sticky=m),
                               constraint=c, draft=d).text for i, c, d, m in cases]
    plain = [reference.generate(IMAGES[i], question="What is it?", params=SamplingParams(max_tokens=6),
                                constraint=c).text for i, c, _, _ in cases]
    assert want != plain and all(w in ("red", "green", "blue", "yellow") for w, (_, c, _, _) in zip(want, cases)
                                 if c is choice)
    # a margin nothing beats keeps an allowed draft; a draft the constraint forbids cannot be kept
    assert all(w == "green" for w, (_, c, d, m) in zip(want, cases) if m == 1e6 and d == tok.encode("green"))
    assert "four" not in want
    return cases, want


@pytest.mark.parametrize("kernels", [False, True])
def test_constrained_answers_are_sticky_where_the_constraint_allows(small_folder, constrained, kernels, monkeypatch):
    import engine.engine as engine_module

    cases, want = constrained
    if kernels:  # the Triton path masks a copy of the logits: stick must see the constraint too
        monkeypatch.setattr(engine_module, "use_triton_kernels", lambda flag, device: True)
        keep = [k for k, (i, _, _, m) in enumerate(cases) if i == 0 and m > 0.5]  # the interpreter is slow
        cases, want = [cases[k] for k in keep], [want[k] for k in keep]
    with Engine(EngineConfig(model=str(small_folder), max_batch_size=8)) as eng:
        handles = [eng.submit(IMAGES[i], question="What is it?", params=SamplingParams(max_tokens=6, sticky=m),
                              constraint=c, draft=d) for i, c, d, m in cases]
        assert [h.result(timeout=120).text for h in handles] == want
    assert eng.stats().kv_pages_in_use == 0 and eng.stats().draft_proposed == 0  # no draft rows


def test_a_sticky_answer_that_repeats_its_draft_ends_where_the_draft_ends(small_folder, greedy):
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        short = greedy[1][:5]  # the draft's end proposes EOS, which the margin keeps
        out = eng.submit(IMAGES[0], caption="short", params=SamplingParams(max_tokens=12, sticky=1e6),
                         draft=short).result(timeout=60)
        assert out.token_ids == short and out.finish_reason == "stop"
        # without a draft, or with sticky 0, the draft changes nothing
        assert eng.submit(IMAGES[0], caption="short", params=SamplingParams(max_tokens=12, sticky=1e6)
                          ).result(timeout=60).token_ids == greedy[0]
        assert eng.submit(IMAGES[0], caption="short", params=SamplingParams(max_tokens=12),
                          draft=short).result(timeout=60).token_ids == greedy[0]


def test_a_sticky_answer_that_ignores_eos_goes_on_past_the_draft(small_folder, greedy):
    """The draft ends with EOS; with ignore_eos the answer repeats it whole and goes on: past the
    draft's end it is simply not sticky any more (reading past the draft had failed the engine)."""
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        short, eos = greedy[1][:5], eng.model_config.tokenizer.eos_id
        params = SamplingParams(max_tokens=9, sticky=1e6, ignore_eos=True)
        out = eng.submit(IMAGES[0], caption="short", params=params, draft=short).result(timeout=60)
        assert out.finish_reason == "length" and out.token_ids[:6] == short + [eos] and len(out.token_ids) == 9


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "1", True])
def test_a_bad_margin_is_a_request_error(bad):
    with pytest.raises(RequestError, match="sticky"):
        SamplingParams(sticky=bad)


def test_sticky_needs_greedy_decoding():
    with pytest.raises(RequestError, match="greedy"):
        SamplingParams(temperature=0.5, sticky=1.0)


def _live_answers(folder, frames: list, sticky: float) -> list:
    from pipelines.live import LiveSession
    from pipelines.sources import Frame

    with Engine(EngineConfig(model=str(folder))) as eng:
        answers = []
        session = LiveSession(eng, {"caption": "short"}, SamplingParams(max_tokens=12, sticky=sticky), max_inflight=1,
                              on_result=lambda r: answers.append(r.output.token_ids))
        for i, rgb in enumerate(frames):  # one frame at a time: each drafts from the one before
            assert session.offer(Frame("cam", i, i / 30, rgb))
            while session.in_flight:
                pass
        session.close()
    return answers


@pytest.mark.parametrize("sticky", [0.0, 1e6])
def test_a_live_session_keeps_its_answer_while_the_model_allows(small_folder, reference, greedy, sticky):
    # the same scene, a patch of it changed in every other frame (no cut): their greedy answers differ
    moved = IMAGES[2].copy()
    moved[0:12, 20:32] = (255, 0, 0)
    other = reference.generate(moved, caption="short", params=SamplingParams(max_tokens=12)).token_ids
    assert other != greedy[2]
    answers = _live_answers(small_folder, [IMAGES[2], moved] * 2, sticky)
    # plain greedy follows each frame; a margin no reading beats keeps the first frame's answer
    assert answers == ([greedy[2], other] * 2 if sticky == 0 else [greedy[2]] * 4)


def test_after_a_scene_cut_a_live_frame_is_asked_afresh(small_folder, greedy):
    from pipelines.cuts import CutDetector

    cuts = CutDetector()
    assert [cuts.is_cut(rgb) for rgb in [IMAGES[0], IMAGES[0], IMAGES[1], IMAGES[0]]] == [False, False, True, True]
    # two unrelated pictures in turn: every frame a cut, so even a margin nothing beats keeps nothing
    assert _live_answers(small_folder, [IMAGES[0], IMAGES[1]] * 2, 1e6) == [greedy[0], greedy[1]] * 2


def test_only_another_scene_is_a_cut_not_a_small_change_in_this_one():
    """A cut costs the next frame its stickiness: a light dimmed a little, a small object moving
    across, or a low-light camera's noise are the same scene and must not count (each one, a cut,
    made every frame of a dim or busy scene be asked afresh). The sample clip's three cuts are
    found, and nothing else."""
    import json
    from pathlib import Path

    import av

    from pipelines.cuts import CutDetector

    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:360, 0:640]
    scene = np.stack([60 + x // 8, 80 + y // 6, np.full_like(x, 140)], -1).astype(np.uint8)
    moved_from, moved_to = scene.copy(), scene.copy()
    moved_from[20:60, 20:60] = 255
    moved_to[300:340, 580:620] = 255
    noisy = [np.clip(scene + rng.normal(0, 20, scene.shape), 0, 255).astype(np.uint8) for _ in range(2)]
    other = np.ascontiguousarray(scene[::-1, ::-1, ::-1])
    # (a camera's exposure steps a frame by 12 grey levels or so; a new scene, by 27 and more)
    for before, after, cut in [(scene, scene - 12, False), (scene - 12, scene, False), (moved_from, moved_to, False),
                               (noisy[0], noisy[1], False), (scene, other, True)]:
        cuts = CutDetector()
        assert [cuts.is_cut(before), cuts.is_cut(after)] == [False, cut]

    root = Path(__file__).resolve().parents[1] / "sample_videos"
    truth = json.loads((root / "cuts_640x360_30fps.json").read_text())["frames"]
    cuts = CutDetector()
    with av.open(str(root / "cuts_640x360_30fps.mp4")) as c:
        found = [i for i, f in enumerate(c.decode(video=0)) if cuts.is_cut(f.to_ndarray(format="rgb24"))]
    assert found == [f["index"] for f in truth if f["cut"] and f["index"] > 0] == [120, 240, 360]


def test_live_and_the_ui_default_to_the_same_margin():
    from app.service import Settings
    from pipelines.live import LIVE_STICKY

    assert Settings().sticky == LIVE_STICKY > 0


@pytest.mark.parametrize("margin", [0.3, 1e6])  # 1e6: every answer is its draft, but after a cut
def test_a_video_is_asked_a_group_at_a_time_drafting_from_the_group_before(small_folder, margin):
    import json
    from pathlib import Path

    from pipelines.batch import Sampling, caption_file, sticky_group
    from pipelines.prompts import prompt_key
    from pipelines.sources import FileSource

    clip = str(Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4")
    sampling, task = Sampling(fps=11), {"caption": "short"}
    params = SamplingParams(max_tokens=8, sticky=margin)
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        def run(params, done=None):
            got = []
            src = FileSource(clip)
            caption_file(eng, src, [], task, params, sampling, done=done, on_frame=got.append)
            return src, got

        src, got = run(params)
        group = sticky_group(sampling, src.fps, 32)
        assert group == 3  # 11 frames a second: a quarter second
        # the same, one request at a time: each frame drafts from the last frame of the group
        # before, except from a scene cut on (the clip's ground truth says where its cuts are)
        frames = list(FileSource(clip).frames(pick=sampling.picker()))
        cut_at = [f["index"] for f in json.loads(Path(clip).with_suffix(".json").read_text())["frames"] if f["cut"]]
        after_cut = [any(a.index < c <= b.index for c in cut_at) for a, b in zip(frames, frames[1:])]
        assert sum(after_cut) == 3 and any(after_cut[g] for g in range(0, len(after_cut), group))  # one mid-group
        want, draft = [], None
        for g in range(0, len(frames), group):
            fresh = False
            for k in range(g, min(g + group, len(frames))):
                fresh |= k > 0 and after_cut[k - 1]
                want.append(eng.submit(frames[k].rgb, params=params, draft=None if fresh else draft,
                                       **task).result(timeout=60).token_ids)
            draft = want[-1]
        assert [r.token_ids for r in got] == want and [r.index for r in got] == [f.index for f in frames]
        assert want != [r.token_ids for r in run(SamplingParams(max_tokens=8))[1]]  # the margin matters here
        # resumed in the middle of a group: the same answers
        half = len(got) // 2 + 1
        done = {(r.source, r.index, prompt_key(task)): r for r in got[:half]}
        assert [r.token_ids for r in run(params, done)[1]] == want
    assert eng.stats().kv_pages_in_use == 0


def test_a_resumed_video_reads_only_the_pixels_that_decide_its_new_answers(small_folder, monkeypatch):
    """A resumed run converted every recorded frame to RGB to look for scene cuts in it: 100 s
    before the first new answer of a file with 60,000 done. Now only the frames of groups that
    ask (and the one before such a group) are converted, and cut wherever, around a scene cut
    too, the run still gives a full run's answers."""
    import json
    from pathlib import Path

    import pipelines.frame
    from pipelines.batch import Sampling, caption_file, sticky_group
    from pipelines.prompts import prompt_key
    from pipelines.sources import FileSource

    clip = str(Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4")
    sampling, task = Sampling(fps=11), {"caption": "short"}
    params = SamplingParams(max_tokens=8, sticky=1e6)  # every answer its draft, but after a cut
    converted = [0]
    as_shown = pipelines.frame.as_shown

    def counted(*args):
        converted[0] += 1
        return as_shown(*args)

    monkeypatch.setattr(pipelines.frame, "as_shown", counted)
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        def run(done=None) -> list:
            got = []
            converted[0] = 0
            caption_file(eng, FileSource(clip), [], task, params, sampling, done=done, on_frame=got.append)
            return got

        full = run()
        assert converted[0] == len(full)
        group = sticky_group(sampling, FileSource(clip).fps, 32)
        cuts = [f["index"] for f in json.loads(Path(clip).with_suffix(".json").read_text())["frames"] if f["cut"]]
        at = [next(k for k, r in enumerate(full) if r.index >= c) for c in cuts[1:]]  # the frames after a cut
        mid = next(k for k in at if k % group)  # in a group's middle: found in a recorded frame, asks the next
        first = next(k for k in at if k % group == 0)  # a group's first, asked or replayed: against the group before
        for k in (mid, mid + 1, first, first + 1, len(full) - 1):
            done = {(r.source, r.index, prompt_key(task)): r for r in full[:k]}
            assert [r.token_ids for r in run(done)] == [r.token_ids for r in full], k
            assert converted[0] <= len(full) - k + 2 * group, (k, converted[0])
    assert eng.stats().kv_pages_in_use == 0
