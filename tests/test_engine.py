"""The engine against the reference decoder, and its lifecycle (threads, pages, handles)."""

import gc
import os
import threading
import time

import numpy as np
import pytest

from engine import ConfigError, Engine, EngineClosedError, EngineConfig, ImageError, RequestError, SamplingParams
from engine.models.loader import load_model
from engine.reference import ReferenceDecoder
from engine.request import as_rgb

GREEDY = SamplingParams(max_tokens=10)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, size=(40 + 30 * i, 60 + 50 * i, 3), dtype=np.uint8) for i in range(4)]


@pytest.fixture(scope="module")
def reference(small_folder):
    return ReferenceDecoder(load_model(small_folder))


def _engine(folder, depth=2, **kw):
    return Engine(EngineConfig(model=str(folder), pipeline_depth=depth, debug_checks=True, **kw))


def _assert_clean(engine):
    s = engine.stats()
    assert s.kv_pages_in_use == 0 and s.running == 0 and s.waiting == 0 and s.images == 0
    assert not engine._thread.is_alive()
    assert engine._executor._thread is None or not engine._executor._thread.is_alive()
    assert engine._vision is None or not engine._vision._executor._thread.is_alive()


TASKS = [{"caption": "short"}, {"caption": "long"}, {"question": "What color is the star?"},
         {"question": "Is there a small blue circle in the top left corner of the frame?"}]


@pytest.mark.parametrize("depth, vision_thread", [(1, True), (2, True), (2, False)])
def test_matches_the_reference_decoder(small_folder, reference, images, depth, vision_thread):
    jobs = []  # images encoded on the CPU's vision thread, or in the steps (as on CUDA): the same answers
    with _engine(small_folder, depth, vision_thread=vision_thread) as eng:
        assert (eng._vision is not None) == vision_thread
        shared = eng.encode_image(images[1])
        for i, img in enumerate(images):
            for j, task in enumerate(TASKS):
                params = SamplingParams(max_tokens=3 + i + 2 * j, temperature=(0.0 if j % 2 else 0.9), seed=i * 7 + j)
                source = shared if i == 1 else img
                jobs.append((img, task, params, eng.submit(source, params=params, **task)))
        shared.release()
        outs = [(img, task, params, h.result(timeout=60)) for img, task, params, h in jobs]
    _assert_clean(eng)
    for img, task, params, out in outs:
        expected = reference.generate(img, params=params, **task)
        assert out.token_ids == expected.token_ids, (task, params)
        assert out.text == expected.text and out.finish_reason == expected.finish_reason
        assert out.seed == params.seed


def test_image_crops_reach_the_device_before_their_step(small_folder, images, monkeypatch):
    """A step's function runs in the compute stream's context on CUDA, where copying the crops
    would wait for the step in flight: they are copied when the step is launched, by the engine
    thread. On CPU the step runs on the device worker, so the thread tells where the copy is."""
    import engine.step_inputs as inputs_module

    threads = []
    stage = inputs_module.stage_crops

    def recording(crops, device):
        threads.append(threading.current_thread().name)
        return stage(crops, device)

    monkeypatch.setattr(inputs_module, "stage_crops", recording)
    with _engine(small_folder, vision_thread=False) as eng:
        outs = [eng.submit(img, caption="short", params=GREEDY) for img in images[:3]]
        assert all(h.result(timeout=60).finish_reason in ("stop", "length") for h in outs)
        worker = eng._executor._thread.name
    assert threads and worker not in threads


def test_gqa_model_and_chunked_prefill(gqa_folder, images):
    ref = ReferenceDecoder(load_model(gqa_folder))
    question = "Where is the red circle and what color is the large square next to it?"
    with _engine(gqa_folder, prefill_token_budget=5) as eng:  # prompts prefilled 5 tokens a step
        handles = [eng.submit(img, question=question, params=GREEDY) for img in images]
        outs = [h.result(timeout=60) for h in handles]
    for img, out in zip(images, outs):
        assert out.token_ids == ref.generate(img, question=question, params=GREEDY).token_ids
    _assert_clean(eng)


def test_stream_yields_the_text_in_words(small_folder, images):
    with _engine(small_folder) as eng:
        h = eng.submit(images[0], caption="long", params=SamplingParams(max_tokens=20))
        pieces = list(h.stream(timeout=30))
        out = h.result(timeout=1)
    assert "".join(pieces) == out.text
    assert set(out.timings_ms) >= {"queue", "preprocess", "vision", "prefill", "first_token", "decode", "total"}
    assert out.timings_ms["total"] >= out.timings_ms["first_token"] > 0


def test_every_stream_reads_the_whole_text_even_after_the_end(small_folder, images):
    """A second stream() (another reader, or one after the request finished) waited forever: the
    first had taken the words."""
    import threading

    with _engine(small_folder) as eng:
        h = eng.submit(images[0], caption="long", params=SamplingParams(max_tokens=20))
        readers = [[] for _ in range(3)]
        threads = [threading.Thread(target=lambda r=r: r.extend(h.stream(timeout=30))) for r in readers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        out = h.result(timeout=1)
        late = list(h.stream(timeout=5))
        cancelled = eng.submit(images[1], caption="long")
        cancelled.cancel()
        assert cancelled.result(timeout=30).finish_reason in ("cancelled", "stop", "length")
        assert "".join(cancelled.stream(timeout=5)) == cancelled.result().text
    assert out.text and all("".join(r) == out.text for r in readers) and "".join(late) == out.text
    _assert_clean(eng)


def test_a_request_timings_count_from_its_preprocessing_to_its_end():
    """Vision in the admission step (no vision thread): it comes out of the prefill; the first
    token and the total count from the start of preprocessing; a request cancelled after its
    admission, before its first token, spent the rest in prefill."""
    from engine.sequence import Image, Sequence

    img = Image(id=1, crops=None, tiling=(1, 1))
    img.timings.vision, img.timings.preprocess = 5.0, 2.0
    seq = Sequence(id=1, prompt=[3, 4, 5], params=SamplingParams(max_tokens=5), image=img, handle=None, capacity=5)
    seq.submitted_at, seq.admitted_at, seq.first_token_at = 100.0, 100.010, 100.030
    t = seq.output("stop", 100.050).timings
    assert (t.preprocess, t.queue, t.vision, t.prefill, t.decode) == pytest.approx((2.0, 10.0, 5.0, 15.0, 20.0))
    assert t.first_token == pytest.approx(32.0) and t.total == pytest.approx(52.0)
    cut = Sequence(id=2, prompt=[3, 4, 5], params=SamplingParams(max_tokens=5), image=img, handle=None, capacity=5)
    cut.submitted_at, cut.admitted_at = 100.0, 100.010
    t = cut.output("cancelled", 100.040).timings
    assert (t.queue, t.vision, t.prefill, t.decode, t.total) == pytest.approx((10.0, 5.0, 25.0, 0.0, 42.0))
    assert t.first_token is None


def test_a_ping_pong_slot_is_not_reused_before_its_step_is_committed(small_folder):
    """Its host buffer still holds the tokens of the step that the engine has not committed."""
    from engine.runner import Runner
    from engine.scheduler import StepPlan

    runner = Runner(load_model(small_folder), n_pages=8, page_size=16, max_batch=2, executor=None)
    runner.slots[1].busy = True  # step 1 launched, not committed
    with pytest.raises(AssertionError, match="reused before its step was committed"):
        runner.launch(StepPlan(), 3)


def test_known_stops_cost_no_extra_step(small_folder, images):
    for depth in (1, 2):
        with _engine(small_folder, depth) as eng:
            n = 7
            out = eng.submit(images[0], caption="short",
                             params=SamplingParams(max_tokens=n, ignore_eos=True)).result(timeout=30)
            assert len(out.token_ids) == n and out.finish_reason == "length"
            # one step encodes the image, prefills the prompt and samples token 1; then n - 1 decodes
            assert eng.stats().steps == n


def test_cancel_before_and_during(small_folder, images):
    with _engine(small_folder) as eng:
        blocker = [eng.submit(images[i % 4], caption="long", params=SamplingParams(max_tokens=60, ignore_eos=True))
                   for i in range(6)]
        h = eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=60, ignore_eos=True))
        h.cancel()
        h.cancel()  # idempotent
        out = h.result(timeout=30)
        assert out.finish_reason == "cancelled"
        live = blocker[0]
        for _ in live.stream(timeout=30):
            live.cancel()
            break
        out = live.result(timeout=30)
        assert out.finish_reason == "cancelled" and len(out.token_ids) < 60
        for b in blocker[1:]:
            assert b.result(timeout=60).finish_reason == "length"
        b.cancel()  # after the end: nothing happens
        assert b.result().finish_reason == "length"
    _assert_clean(eng)


def test_a_cancel_the_engine_could_not_take_is_sent_again(small_folder, images, monkeypatch):
    """A cancel whose message did not reach the engine (its queue stayed full then; an interrupt
    now) raised, and every later cancel() returned at once, sending nothing: the request ran to
    its end."""
    with _engine(small_folder) as eng:
        h = eng.submit(images[0], caption="long", params=SamplingParams(max_tokens=200, ignore_eos=True))
        real = eng._post

        def full(message, block=True):
            raise RequestError("the engine's queue is full (test)")

        monkeypatch.setattr(eng, "_post", full)
        with pytest.raises(RequestError, match="queue is full"):
            h.cancel()
        monkeypatch.setattr(eng, "_post", real)
        h.cancel()
        out = h.result(timeout=30)
        assert out.finish_reason == "cancelled" and len(out.token_ids) < 200
    _assert_clean(eng)


def test_the_device_busy_time_is_counted_once_from_several_threads():
    """On CUDA the busy time comes from finished steps' events, read by stats() on any thread:
    two readers at once counted a step twice (6 s for 3), and a launch could be lost."""
    from engine.executor import Executor

    class Event:
        def query(self):
            time.sleep(0.01)  # a reader is inside the list while the other comes
            return True

        def elapsed_time(self, end):
            return 1000.0  # ms: each step took 1 s

    ex = Executor.__new__(Executor)  # CUDA's bookkeeping without a GPU
    ex._thread, ex._lock, ex.busy_s = None, threading.Lock(), 0.0
    ex._cuda_pending = [(Event(), Event()) for _ in range(3)]
    readers = [threading.Thread(target=ex.busy_seconds) for _ in range(4)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert ex.busy_seconds() == 3.0


def test_shared_image_pages_live_until_the_last_user(small_folder, images):
    with _engine(small_folder) as eng:
        ref = eng.encode_image(images[2])
        hs = [eng.submit(ref, caption=c, params=GREEDY) for c in ("short", "normal", "long")]
        for h in hs:
            h.result(timeout=30)
        time.sleep(0.1)
        assert eng.stats().images == 1 and eng.stats().kv_pages_in_use > 0  # the ref still holds it
        again = eng.submit(ref, caption="short", params=GREEDY).result(timeout=30)
        assert again.token_ids == hs[0].result().token_ids
        ref.release()
        ref.release()
        deadline = time.time() + 10
        while eng.stats().kv_pages_in_use and time.time() < deadline:
            time.sleep(0.01)
        assert eng.stats().kv_pages_in_use == 0 and eng.stats().images == 0
        with pytest.raises(RequestError, match="released"):
            eng.submit(ref, caption="short")
    _assert_clean(eng)


def test_close_frees_images_whose_refs_were_never_released(small_folder, images):
    eng = _engine(small_folder)
    ref = eng.encode_image(images[0])
    eng.submit(ref, caption="short", params=GREEDY).result(timeout=30)
    assert eng.stats().kv_pages_in_use > 0
    eng.close()
    _assert_clean(eng)
    # images no request asked about, that do not fit beside a request's pages: never encoded,
    # and close does not wait for them
    eng = _engine(small_folder, max_batch_size=1)
    refs = [eng.encode_image(img) for img in images]
    t0 = time.perf_counter()
    eng.close(timeout=30)
    assert time.perf_counter() - t0 < 10 and all(not r.released for r in refs)
    _assert_clean(eng)


def test_bad_input_leaves_the_engine_serving(small_folder, images):
    with _engine(small_folder) as eng:
        good = eng.submit(images[0], caption="short", params=GREEDY)
        with pytest.raises(RequestError):
            eng.submit(images[0], question="   ")
        with pytest.raises(RequestError):
            eng.submit(images[0], caption="huge")
        with pytest.raises(RequestError, match="does not fit"):
            eng.submit(images[0], question="star " * 300)
        with pytest.raises(ImageError, match="empty"):
            eng.submit(np.zeros((0, 10, 3), np.uint8), caption="short")
        with pytest.raises(ImageError):
            eng.submit(np.zeros((10, 10, 3), np.float32), caption="short")
        with pytest.raises(ImageError):
            eng.encode_image("not an image")
        with pytest.raises(ImageError, match=r"\(H, W, 3\)"):
            eng.submit(np.zeros((10, 10, 5), np.uint8), caption="short")
        with pytest.raises(RequestError):
            eng.submit(images[0], caption="short", params=SamplingParams(temperature=-1.0))
        # Temperatures that float32 turns into 0 or inf: one such request stopped the engine
        # for everyone (the sampler indexed past the vocabulary).
        for t in (1e-40, 1e39):
            with pytest.raises(RequestError, match="temperature must be 0"):
                eng.submit(images[0], caption="short", params=SamplingParams(temperature=t, top_p=1.0))
        with pytest.raises(RequestError, match="must be a string"):
            eng.submit(images[0], question=b"What color is the star?")
        with pytest.raises(RequestError, match="params must be a SamplingParams"):  # not an AttributeError
            eng.submit(images[0], caption="short", params={"max_tokens": 3})
        with pytest.raises(RequestError, match="not valid text"):
            eng.submit(images[0], question="What \ud800 is it?")
        for priority in ("high", None, 1.5, True):
            with pytest.raises(RequestError, match="priority must be an integer"):
                eng.encode_image(images[0], priority=priority)
        with pytest.raises(RequestError, match="ignore_eos must be True or False"):
            SamplingParams(ignore_eos="no")  # was taken as yes: the caption ran to max_tokens
        for depth in (True, 1.0, 2.0, 0, 3):
            with pytest.raises(RequestError, match="pipeline depth must be 1 or 2"):
                eng.set_pipeline_depth(depth)
            with pytest.raises(ConfigError, match="pipeline_depth must be 1"):
                EngineConfig(model=str(small_folder), pipeline_depth=depth)
        assert good.result(timeout=30).finish_reason in ("stop", "length")
        # numpy numbers, as read from an array, are numbers
        params = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), seed=np.uint32(7))
        assert len(eng.submit(images[1], caption="short", params=params).result(timeout=30).token_ids) <= 3
        assert eng.submit(images[1], caption="short", params=GREEDY, priority=np.int8(1)).result(timeout=30).token_ids
    with pytest.raises(EngineClosedError):
        eng.submit(images[0], caption="short")
    with pytest.raises(EngineClosedError):
        eng.encode_image(images[0])
    with pytest.raises(EngineClosedError):
        eng.set_pipeline_depth(1)
    with pytest.raises(EngineClosedError):
        eng.reset_stats()
    _assert_clean(eng)


def test_an_image_ref_dropped_unreleased_lets_its_image_go(small_folder, images):
    """An ImageRef collected without release() (forgotten, or an exception past it) had held
    its image, prefix pages and embeddings, until close: in a long-running process each one
    leaked, and the pool filled. Its requests still finish first."""
    with _engine(small_folder) as eng:
        ref = eng.encode_image(images[1])
        h = eng.submit(ref, caption="long", params=GREEDY)
        del ref
        assert h.result(timeout=30).finish_reason in ("stop", "length")
        for img in images:
            eng.encode_image(img)  # never kept
        in_cycle = [eng.encode_image(images[0])]
        in_cycle.append(in_cycle)  # collected by the cycle collector, on its own time
        del in_cycle
        gc.collect()
        deadline = time.time() + 10
        while eng.stats().images and time.time() < deadline:
            time.sleep(0.05)
        s = eng.stats()
        assert s.images == 0 and s.kv_pages_in_use == 0
        assert eng.submit(images[1], caption="long", params=GREEDY).result(timeout=30).token_ids == h.result().token_ids
    _assert_clean(eng)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork only")
def test_an_engine_used_in_a_forked_child_is_a_clear_error(small_folder, images):
    """A process forked after the engine started (multiprocessing's "fork", a preforking
    server's workers after a preload) has none of its threads: a submit there had been taken
    and never answered, result() waiting for ever. The parent's engine serves on."""
    with _engine(small_folder) as eng:
        h = eng.submit(images[0], caption="short", params=GREEDY)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            try:
                try:
                    eng.submit(images[0], caption="short", params=GREEDY).result(timeout=5)
                    said = "answered"
                except BaseException as e:
                    said = f"{type(e).__name__}: {e}"
                eng.close(timeout=5)
                os.write(write, said.encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            said = f.read().decode()
        assert os.waitpid(pid, 0)[1] == 0
        assert said.startswith("EngineClosedError") and "fork" in said, said
        assert h.result(timeout=30).finish_reason in ("stop", "length")
        assert eng.submit(images[1], caption="short", params=GREEDY).result(timeout=30).token_ids
    _assert_clean(eng)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork only")
def test_requests_unfinished_at_a_fork_end_in_the_child(small_folder, images):
    """A handle submitted before the fork and waited on in the child (a worker given the parent's
    handles) had waited for ever: no engine thread there answers it. It ends "error" in the
    child, admitted or still in the inbox; the parent's requests are answered as ever."""
    with _engine(small_folder) as eng:
        hold, held = threading.Event(), threading.Event()

        def stall(_):  # the engine thread waits here: what follows stays unfinished at the fork
            held.set()
            hold.wait(30)

        first = eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=1))
        running = eng.submit(images[1], caption="long", params=SamplingParams(max_tokens=200, ignore_eos=True))
        first.add_done_callback(stall)
        assert held.wait(30)
        queued = eng.submit(images[2], caption="short", params=GREEDY)  # into the inbox, unread
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            try:
                try:
                    said = " ".join(h.result(timeout=5).finish_reason for h in (first, running, queued))
                except BaseException as e:
                    said = f"{type(e).__name__}: {e}"
                os.write(write, said.encode())
            finally:
                os._exit(0)
        os.close(write)
        hold.set()
        with os.fdopen(read, "rb") as f:
            said = f.read().decode()
        assert os.waitpid(pid, 0)[1] == 0
        assert said == "length error error", said
        assert running.result(timeout=60).finish_reason == "length"
        assert queued.result(timeout=30).finish_reason in ("stop", "length")
    _assert_clean(eng)


def test_a_kv_cache_larger_than_memory_is_a_config_error(small_folder):
    """It was the allocator's RuntimeError (bench --streams 100000: 81 GB), or worse, a process
    killed while zeroing an overcommitted allocation."""
    with pytest.raises(ConfigError, match=r"the KV cache for max_batch_size=32 \(1000000000 pages\) .* GiB, more than"):
        Engine(EngineConfig(model=str(small_folder), kv_pages=10**9))  # a default pool is sized to fit
    # a default pool has a page for each request at least: 10**8 of them do not fit either
    with pytest.raises(ConfigError, match="the KV cache for max_batch_size=100000000 .* GiB, more than"):
        Engine(EngineConfig(model=str(small_folder), max_batch_size=10**8))
    # slots that a pool asked for cannot fill (each had its buffers: the allocator's error)
    with pytest.raises(ConfigError, match=r"^max_batch_size=64 is more requests than the KV pool's 60 pages"):
        Engine(EngineConfig(model=str(small_folder), max_batch_size=64, kv_pages=60))


def test_a_request_posted_while_the_engine_closes_is_answered(small_folder, images):
    """submit() checks that the engine is open, then puts the request in its inbox: a close() in
    between let the engine thread end first, and the request waited forever."""
    eng = _engine(small_folder)
    ref = eng.encode_image(images[0])
    put, posted = eng._inbox.queue.put, threading.Event()

    def slow_put(message, *args, **kwargs):
        if message[0] == "request":
            posted.set()
            time.sleep(0.5)  # past its checks, not yet in the inbox: close() runs now
        return put(message, *args, **kwargs)

    eng._inbox.queue.put = slow_put
    handles = []
    poster = threading.Thread(target=lambda: handles.append(eng.submit(ref, caption="short", params=GREEDY)))
    poster.start()
    assert posted.wait(10)
    eng.close(timeout=30)
    poster.join(10)
    assert handles[0].result(timeout=10).finish_reason in ("stop", "length")
    ref.release()  # after close: a no-op, not a message nobody reads
    _assert_clean(eng)


def test_grey_and_alpha_arrays_are_read_as_the_rgb_they_show(small_folder, images):
    """Arrays as OpenCV and PIL give them: grey (H, W) or (H, W, 1), grey + alpha, RGBA. What is
    transparent shows mid grey, not the colour left under it (dropped, the alpha had shown a
    logo's black background as black circles, and an erased drawing as if it were there)."""
    grey = images[0][:, :, 1]
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    opaque = np.full_like(grey, 255)
    with _engine(small_folder) as eng:
        ask = lambda img: eng.submit(img, caption="short", params=GREEDY).result(timeout=30).token_ids  # noqa: E731
        want = ask(rgb)
        assert ask(grey) == ask(grey[:, :, None]) == ask(np.dstack([grey, opaque])) == want
        hidden = np.zeros_like(images[1])  # what lies under transparent pixels: black, or anything
        hidden[10:30, 20:50] = images[1][10:30, 20:50]
        shown = np.full_like(images[1], 128)
        shown[10:30, 20:50] = images[1][10:30, 20:50]
        mask = np.zeros(images[1].shape[:2], np.uint8)
        mask[10:30, 20:50] = 255
        assert ask(np.dstack([hidden, mask])) == ask(shown)
    half = as_rgb(np.dstack([np.full((2, 2, 3), 200, np.uint8), np.full((2, 2), 128, np.uint8)]))
    assert half.shape == (2, 2, 3) and (half == 164).all()  # (200 * 128 + 128 * 127) / 255
    _assert_clean(eng)


def test_pillow_images_are_read_upright_as_the_rgb_they_show(small_folder, images, tmp_path):
    """Moondream's own API takes Pillow images: a caller coming from it passes one, often straight
    from Image.open (a phone photo with an EXIF orientation, a palette GIF, a 16-bit PNG)."""
    from PIL import Image

    stored = Image.fromarray(np.ascontiguousarray(np.rot90(images[2], k=1)))  # turned a quarter left
    exif = stored.getexif()
    exif[0x0112] = 6  # "turn it a quarter right to show it"
    stored.save(tmp_path / "phone.png", exif=exif)
    sideways = Image.open(tmp_path / "phone.png")
    grey16 = Image.fromarray(images[0][:, :, 1].astype(np.uint16) * 257)
    with _engine(small_folder) as eng:
        ask = lambda img: eng.submit(img, caption="short", params=GREEDY).result(timeout=30).token_ids  # noqa: E731
        assert ask(Image.fromarray(images[1])) == ask(images[1])
        assert ask(Image.fromarray(images[1]).convert("RGBA")) == ask(images[1])
        erased = Image.fromarray(np.dstack([images[1], np.zeros(images[1].shape[:2], np.uint8)]), "RGBA")
        assert ask(erased) == ask(np.full_like(images[1], 128))  # all transparent: nothing drawn shows
        assert ask(sideways) == ask(images[2])
        assert ask(grey16) == ask(np.repeat(images[0][:, :, 1:2], 3, axis=2))
        with pytest.raises(ImageError, match="empty"):
            eng.submit(Image.new("RGB", (0, 5)), caption="short")
        with pytest.raises(ImageError, match="numpy array or a Pillow image, got list"):
            eng.submit([[0, 0, 0]], caption="short")
    _assert_clean(eng)


def test_a_done_callback_that_raises_is_logged_and_harms_no_other_request(small_folder, images, caplog):
    """A caller's callback raised on the engine thread was taken for a device failure: every
    request in flight failed, and a second one killed the thread with handles left waiting."""
    eng = _engine(small_folder)
    ref = eng.encode_image(images[3])
    handles = [eng.submit(img, caption="long", params=GREEDY) for img in images[:3]]
    for h in handles:
        h.add_done_callback(lambda h: 1 / 0)
    assert {h.result(timeout=30).finish_reason for h in handles} <= {"stop", "length"}
    logged = lambda: sum("a done callback of request" in r.getMessage() for r in caplog.records)  # noqa: E731
    deadline = time.monotonic() + 10  # a handle is done just before its callbacks run
    while logged() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert logged() == 3
    late = eng.submit(ref, caption="short", params=GREEDY)
    late.result(timeout=30)
    late.add_done_callback(lambda h: 1 / 0)  # after the end: called at once, on this thread, logged too
    assert logged() == 4
    ref.release()
    eng.close(timeout=30)
    _assert_clean(eng)


def test_callbacks_that_post_to_a_full_queue_neither_stall_nor_lose_their_message(small_folder, images):
    """A done callback runs on the engine thread, the one that empties the queue: release(),
    submit() and close(cancel=True) from it waited 10 s on a full queue and were then refused, the
    image (or the request's image) held until close, the queued request unreported, nothing
    closed."""
    eng = _engine(small_folder, max_queue=1)
    ref = eng.encode_image(images[0])
    seen = {}

    def callback(h):
        t0 = time.monotonic()
        seen["own"] = eng.submit(ref, caption="normal", params=SamplingParams(max_tokens=2))  # the queue is full now
        seen["rgb"] = eng.submit(images[1], caption="short", params=SamplingParams(max_tokens=2))
        ref.release()
        eng.close(cancel=True)
        seen["took"] = time.monotonic() - t0

    first = eng.submit(ref, caption="short", params=SamplingParams(max_tokens=2))
    first.add_done_callback(callback)
    first.result(timeout=30)
    eng._thread.join(30)
    assert seen["took"] < 2.0
    assert {seen[k].result(timeout=1).finish_reason for k in ("own", "rgb")} <= {"cancelled", "length", "stop"}
    eng.close(timeout=30)
    _assert_clean(eng)


def test_wait_lasts_while_the_engine_makes_progress_and_ends_on_a_stall():
    """video and image waited 600 s for a frame's answer, then failed: with Moondream 2 on a CPU
    and 32 frames queued the oldest frame's answer takes longer, the engine busy all along."""
    import types

    from engine.request import RequestHandle
    from engine.types import RequestOutput, StageTimings

    steps = [0]
    engine = types.SimpleNamespace(stats=lambda: types.SimpleNamespace(steps=steps[0]))
    working = RequestHandle(engine, 1)

    def progress():  # a step every 0.05 s, the answer after 2 s (four times `stall`)
        for _ in range(40):
            time.sleep(0.05)
            steps[0] += 1
        working._finish(RequestOutput("a red circle", [5], "stop", StageTimings(), 0))

    threading.Thread(target=progress, daemon=True).start()
    assert working.wait(stall=0.5).text == "a red circle"
    assert working.wait(stall=0.01).text == "a red circle"  # finished: at once
    stalled = RequestHandle(engine, 2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="request 2: the engine ran no step for 0.2 s"):
        stalled.wait(stall=0.2)
    assert time.monotonic() - t0 < 5.0


def test_what_a_callback_posts_goes_after_what_is_queued_and_waits_on_no_submit(small_folder, images):
    """Handled at once on the engine thread, a callback's release overtook a request on its image
    still in the queue (the image freed, then taken back without pages: the engine failed), and
    its cancel the request it cancelled (lost: the answer ran to its end). A release also waited
    on another thread's submit on the same image, which waited for a full queue that only the
    engine thread, in the callback, empties."""
    eng = _engine(small_folder, vision_thread=False)
    ref = eng.encode_image(images[0])
    box = {}

    def callback(h):
        def others():
            box["on_ref"] = eng.submit(ref, caption="short", params=SamplingParams(max_tokens=5))
            box["cancelled"] = eng.submit(images[1], caption="long", params=SamplingParams(max_tokens=60, ignore_eos=True))

        t = threading.Thread(target=others)
        t.start()
        t.join()  # both queued, not yet taken in
        ref.release()
        box["cancelled"].cancel()
        called.set()

    called = threading.Event()  # a handle is done just before its callbacks run
    first = eng.submit(ref, caption="short", params=SamplingParams(max_tokens=2))
    first.add_done_callback(callback)
    assert called.wait(timeout=30)
    assert box["on_ref"].result(timeout=30).finish_reason in ("stop", "length") and eng.error is None
    assert box["cancelled"].result(timeout=30).finish_reason == "cancelled"
    eng.close(timeout=30)
    _assert_clean(eng)

    eng = _engine(small_folder, vision_thread=False, max_queue=1)
    ref = eng.encode_image(images[0])

    def blocked_submit():
        eng.submit(images[1], caption="short", params=SamplingParams(max_tokens=2))  # the queue is full now
        box["late"] = eng.submit(ref, caption="short", params=SamplingParams(max_tokens=2))  # waits for room

    def release_meanwhile(h):
        threading.Thread(target=blocked_submit, daemon=True).start()
        time.sleep(0.5)
        t0 = time.monotonic()
        ref.release()
        box["took"] = time.monotonic() - t0

    first = eng.submit(ref, caption="short", params=SamplingParams(max_tokens=2))
    first.add_done_callback(release_meanwhile)
    deadline = time.monotonic() + 30
    while "late" not in box and time.monotonic() < deadline:
        time.sleep(0.01)
    assert box["took"] < 2.0 and box["late"].result(timeout=30).finish_reason in ("stop", "length")
    eng.close(timeout=30)
    _assert_clean(eng)  # the release the late submit carried out: no image left


def test_callbacks_that_post_behind_many_queued_cancels_finish_every_request(small_folder, images, caplog):
    """A callback's post handled the queued messages first, inside the callback: each cancel
    whose request's callback released its image nested a level deeper. 300 of them queued behind
    a slow callback: RecursionError, logged as a callback's error; 64 handles never finished, not
    even after close, and their images kept their pages while the engine ran."""
    eng = _engine(small_folder, vision_thread=False)
    held, go = threading.Event(), threading.Event()

    def slow(h):  # the engine thread waits here while the messages queue up
        held.set()
        go.wait(30)

    first = eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=1))
    first.add_done_callback(slow)
    assert held.wait(30)
    refs, handles = [], []
    for _ in range(200):
        ref = eng.encode_image(images[1])
        h = eng.submit(ref, caption="short", params=SamplingParams(max_tokens=5))
        h.add_done_callback(lambda _h, ref=ref: ref.release())
        refs.append(ref), handles.append(h)
    for h in handles:
        h.cancel()
    go.set()
    assert all(h.result(timeout=30).finish_reason == "cancelled" for h in handles)
    deadline = time.monotonic() + 30
    while (eng._batch.images or eng.stats().kv_pages_in_use) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not eng._batch.images and eng.stats().kv_pages_in_use == 0 and eng.error is None
    assert not [r for r in caplog.records if r.name == "vlmstream"]
    eng.close(timeout=30)
    _assert_clean(eng)


def test_a_done_callback_that_exits_harms_no_other_request(small_folder, images, caplog):
    """sys.exit() in a done callback reached the engine loop as a failure: every other request
    ended with "error" and the engine was dead."""
    import sys

    with _engine(small_folder) as eng:
        other = eng.submit(images[0], caption="long", params=SamplingParams(max_tokens=60, ignore_eos=True))
        h = eng.submit(images[1], caption="short", params=SamplingParams(max_tokens=1))
        h.add_done_callback(lambda h: sys.exit(0))
        assert h.result(timeout=30).finish_reason == "length"
        assert other.result(timeout=30).finish_reason == "length"
        assert eng.submit(images[2], caption="short", params=GREEDY).result(timeout=30).finish_reason in ("stop", "length")
    assert any("a done callback of request" in r.getMessage() for r in caplog.records)
    _assert_clean(eng)


def test_close_from_a_done_callback_and_again_after_a_timeout(small_folder, images):
    """close() in a done callback joined its own thread (RuntimeError); a second close() after a
    TimeoutError returned at once with the engine still running."""
    eng = _engine(small_folder)
    first = eng.submit(images[0], caption="short", params=GREEDY)
    first.add_done_callback(lambda h: eng.close())
    first.result(timeout=30)
    eng._thread.join(30)
    _assert_clean(eng)
    with pytest.raises(EngineClosedError):
        eng.submit(images[0], caption="short")
    eng = _engine(small_folder)
    long = SamplingParams(max_tokens=150, ignore_eos=True)
    handles = [eng.submit(img, caption="long", params=long) for img in images * 2]
    with pytest.raises(TimeoutError):
        eng.close(timeout=0.01)
    eng.close(timeout=60)  # waits, this time
    assert all(h.done() for h in handles)
    _assert_clean(eng)


def test_a_failed_engine_takes_releases_and_cancels_quietly(small_folder, images):
    """After a device failure, `with engine.encode_image(...)` raised again on leaving its block."""
    eng = _engine(small_folder)
    ref = eng.encode_image(images[0])
    eng.submit(ref, caption="short", params=GREEDY).result(timeout=30)

    def lost(*args):
        raise RuntimeError("device lost")

    eng.runner.launch = lost  # the next step fails as on a device error
    h = eng.submit(ref, caption="long", params=GREEDY)
    assert h.result(timeout=30).finish_reason == "error"
    eng._thread.join(30)
    assert isinstance(eng.error, RuntimeError) and str(eng.error) == "device lost"  # the cause, kept
    ref.release()
    h.cancel()
    with pytest.raises(EngineClosedError, match="the engine failed"):
        eng.submit(images[0], caption="short")
    # The ImageRef held through the failure gave its prefix's pages back (they had stayed in
    # use for ever, close or not).
    eng.close(timeout=30)
    _assert_clean(eng)


def test_a_program_that_ends_without_close_exits_cleanly(small_folder):
    """With requests running under TorchScript, the interpreter went down under the engine thread:
    "terminate called without an active exception", exit 134. The requests still going are
    cancelled, not decoded to their ends first (README: "has its requests cancelled")."""
    import subprocess
    import sys

    script = f"""if True:
        import numpy as np, torch
        torch.set_num_threads(1)
        from engine import Engine, EngineConfig, SamplingParams
        eng = Engine(EngineConfig(model={str(small_folder)!r}))
        rng = np.random.default_rng(0)
        long = SamplingParams(max_tokens=150, ignore_eos=True)
        # holds the engine thread until the exit's close has begun: the others cannot end before
        hold = eng.submit(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8), caption="long", params=long)
        hold.add_done_callback(lambda h: eng._closing.wait(60))
        hold.cancel()
        hs = [eng.submit(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8), caption="long", params=long)
              for _ in range(8)]
        for h in hs:
            h.add_done_callback(lambda h: print(h.result().finish_reason, flush=True))
        print("leaving", flush=True)
    """
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0 and run.stdout == "leaving\n" + "cancelled\n" * 8, (run.stdout, run.stderr)


def test_a_program_that_ends_during_a_long_step_waits_for_it(small_folder):
    """At exit an engine left open is closed with its requests cancelled, and its step in flight
    waited for: a slow model's step (Moondream 2 in fp32 on a CPU, over a minute) outlasted the
    30 s the exit gave it, and the interpreter went down under it (an abort, exit 134)."""
    import subprocess
    import sys

    script = f"""if True:
        import time, numpy as np, torch
        torch.set_num_threads(1)
        import engine.engine as em
        import engine.open_engines
        from engine.batch import Batch
        engine.open_engines.EXIT_QUIET_S = 0.2  # the step below outlasts it
        commit = Batch.commit
        def slow(self, record):
            time.sleep(1.5)
            commit(self, record)
        Batch.commit = slow
        eng = em.Engine(em.EngineConfig(model={str(small_folder)!r}))
        h = eng.submit(np.zeros((60, 80, 3), np.uint8), caption="long",
                       params=em.SamplingParams(max_tokens=50, ignore_eos=True))
        h.add_done_callback(lambda h: print("ended:", h.result().finish_reason, flush=True))
        time.sleep(0.5)
        print("leaving", flush=True)
    """
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0 and run.stdout == "leaving\nended: cancelled\n", (run.stdout, run.stderr)
    assert run.stderr == "vlmstream: waiting for the engine's current step to end\n", run.stderr


def test_close_with_cancel_finishes_every_handle(small_folder, images):
    eng = _engine(small_folder)
    handles = [eng.submit(images[i % 4], caption="long", params=SamplingParams(max_tokens=200, ignore_eos=True))
               for i in range(20)]
    eng.close(cancel=True)
    assert all(h.done() for h in handles)
    assert {h.result().finish_reason for h in handles} <= {"cancelled", "length"}
    _assert_clean(eng)


def test_the_default_pool_on_a_cpu_takes_a_quarter_of_the_memory_available(small_folder, images, monkeypatch,
                                                                           tmp_path):
    """Sized for max_batch_size full-context requests, Moondream 2's default pool was 17 GiB in
    bf16, written whole at start (21.5 GB resident for two pictures), and 33 GiB in fp32: refused
    on a 24 GB machine with advice (max_batch_size, kv_pages) the CLI has no option for."""
    import engine.kv_memory as kv_memory

    with _engine(small_folder) as eng:
        full, page = eng.pool.n_pages, kv_memory.page_bytes(eng.config.page_size, eng.loaded)
        need = eng._batch.reserve_pages
        runner = eng._batch.runner
        assert page * full == runner.k.nbytes + runner.v.nbytes  # what a page really takes: K and V
    assert full > 3 * need
    monkeypatch.setattr(kv_memory, "available_memory", lambda: 4 * page * (need + 2))
    with _engine(small_folder, max_batch_size=4) as eng:
        assert eng.pool.n_pages == need + 2  # a quarter of it
        hs = [eng.submit(images[i % 4], caption="long", params=SamplingParams(max_tokens=40, ignore_eos=True))
              for i in range(12)]  # more than fits at once: they wait for pages
        assert all(len(h.result(timeout=60).token_ids) == 40 for h in hs)
    monkeypatch.setattr(kv_memory, "available_memory", lambda: 0)
    with _engine(small_folder, max_batch_size=4) as eng:
        assert eng.pool.n_pages == need  # one full-context request, whatever the memory says
    with _engine(small_folder) as eng:
        assert eng.pool.n_pages == 32  # and a page for each of max_batch_size requests
    with _engine(small_folder, kv_pages=full) as eng:
        assert eng.pool.n_pages == full  # asked for: as asked
    # in a container, its memory limit counts (MemAvailable is the host's)
    monkeypatch.undo()
    host = kv_memory.available_memory(cgroup="/nonexistent")
    limited = tmp_path / "cgroup"
    limited.mkdir()
    (limited / "memory.max").write_text("3000000000\n")
    (limited / "memory.current").write_text("1000000000\n")
    assert host > 2_500_000_000 and kv_memory.available_memory(cgroup=str(limited)) == 2_000_000_000
    (limited / "memory.stat").write_text("anon 700000000\ninactive_file 500000000\n")
    # the file cache the kernel can drop (the weights' memory map, for one) is room
    assert kv_memory.available_memory(cgroup=str(limited)) == 2_500_000_000
    (limited / "memory.max").write_text("max\n")  # no limit: the host's figure (it moves a little)
    assert abs(kv_memory.available_memory(cgroup=str(limited)) - host) < host * 0.2
    # cgroup v1, and a limit on a cgroup above this process's (a systemd slice, say): the
    # tightest counts; /proc/self/cgroup names the process's own
    membership = tmp_path / "membership"
    membership.write_text("not a cgroup line\n4:memory:/slice/service\n0::/\n")  # an odd line skipped, not all
    own, parent = limited / "memory" / "slice" / "service", limited / "memory" / "slice"
    own.mkdir(parents=True)
    (own / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    (own / "memory.usage_in_bytes").write_text("1000000000\n")
    (parent / "memory.limit_in_bytes").write_text("1500000000\n")
    (parent / "memory.usage_in_bytes").write_text("1200000000\n")
    (parent / "memory.stat").write_text("cache 300000000\ntotal_inactive_file 200000000\n")
    assert kv_memory.available_memory(cgroup=str(limited), membership=str(membership)) == 500_000_000
    _assert_clean(eng)


def test_kv_pool_smaller_than_demand_queues_requests(small_folder, images):
    with _engine(small_folder, kv_pages=24, max_batch_size=2) as eng:
        hs = [eng.submit(images[i % 4], caption="short", params=SamplingParams(max_tokens=30, ignore_eos=True))
              for i in range(8)]
        assert all(h.result(timeout=60).finish_reason == "length" for h in hs)
        # a full-context request still fits the pool: the engine refuses pools that cannot hold one
        assert eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=10_000, ignore_eos=True)
                          ).result(timeout=60).finish_reason == "length"
    _assert_clean(eng)
    with pytest.raises(ConfigError, match="kv_pages"):
        _engine(small_folder, kv_pages=8)


@pytest.mark.parametrize("depth", [1, 2])
def test_submit_and_cancel_storm_from_threads(small_folder, images, depth):
    """Thousands of submits and cancels from several threads, a request's cancel often from
    another thread than its submit (a viewer leaving, a newer frame winning), pipelined and
    blocking; the invariants (debug_checks) hold after every step."""
    eng = _engine(small_folder, depth=depth, max_batch_size=8)
    errors, handles, lock, producing = [], [], threading.Lock(), threading.Event()
    producing.set()

    def producer(k):
        rng = np.random.default_rng(k)
        try:
            for _ in range(300):
                h = eng.submit(images[int(rng.integers(4))], caption="short",
                               params=SamplingParams(max_tokens=int(rng.integers(1, 6))))
                with lock:
                    handles.append(h)
                if rng.random() < 0.3:
                    time.sleep(float(rng.random()) * 0.002)
                    h.cancel()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def canceller(k):
        rng = np.random.default_rng(100 + k)
        try:
            while producing.is_set():
                with lock:
                    picked = [handles[int(i)] for i in rng.integers(len(handles), size=4)] if handles else []
                for h in picked:
                    h.cancel()
                time.sleep(0.001)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    producers = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    cancellers = [threading.Thread(target=canceller, args=(k,)) for k in range(2)]
    for t in producers + cancellers:
        t.start()
    for t in producers:
        t.join(120)
    producing.clear()
    for t in cancellers:
        t.join(30)
    eng.close()
    assert not errors
    assert len(handles) == 1200 and all(h.done() for h in handles)
    reasons = [h.result().finish_reason for h in handles]
    assert set(reasons) <= {"stop", "length", "cancelled"} and "cancelled" in reasons and "length" in reasons
    _assert_clean(eng)
    assert eng.pool.n_free == eng.pool.n_pages


def test_worker_error_reaches_the_caller(small_folder, images, monkeypatch):
    eng = _engine(small_folder)

    def boom(*a, **k):
        raise RuntimeError("device exploded")

    monkeypatch.setattr(eng.runner, "_prefix_rows", boom)
    h = eng.submit(images[0], caption="short", params=GREEDY)
    assert h.result(timeout=30).finish_reason == "error"
    with pytest.raises(EngineClosedError, match="device exploded"):
        eng.submit(images[0], caption="short")
    eng.close()
    assert eng.pool.n_free == eng.pool.n_pages


@pytest.mark.parametrize("vision_thread", [True, False])
def test_images_encoded_ahead_leave_pages_for_their_requests(small_folder, images, vision_thread):
    # encode_image for more images than the pool holds besides a request, the requests later: the
    # engine encodes ahead only while a full-context request on a new image still fits (it once
    # filled the pool with prefixes whose ImageRefs waited on requests that could never start)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for kv_pages, ahead in ((None, 0), (14, 2)):  # the default pool for one slot: 10 pages
        with _engine(small_folder, max_batch_size=1, kv_pages=kv_pages, vision_thread=vision_thread) as eng:
            assert (eng.pool.n_pages - eng._batch.reserve_pages) // eng._batch.prefix_pages == ahead
            refs = [eng.encode_image(img) for img in images]
            deadline = time.time() + 30
            while eng.stats().kv_pages_in_use < ahead * eng._batch.prefix_pages and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)  # time enough to encode the other images ahead too, were it allowed
            assert eng.stats().kv_pages_in_use == ahead * eng._batch.prefix_pages
            handles = [eng.submit(refs[i % 4], caption="short", params=params) for i in range(6)]
            for ref in refs:
                ref.release()
            assert [h.result(timeout=30).finish_reason for h in handles] == ["length"] * 6
        _assert_clean(eng)


def _two_prompts_per_image(eng, imgs, first: SamplingParams, second: SamplingParams) -> list[list[int]]:
    """Every image's short caption, then every image's question (queued behind all the captions),
    the ImageRefs released at once: the answers' token ids in that order."""
    refs = [eng.encode_image(img) for img in imgs]
    handles = [eng.submit(r, caption="short", params=first) for r in refs]
    handles += [eng.submit(r, question="How many?", params=second) for r in refs]
    for r in refs:
        r.release()
    return [h.result(timeout=60).token_ids for h in handles]


@pytest.mark.parametrize("vision_thread", [True, False])
def test_more_images_than_the_pool_holds_with_their_refs_kept_or_shared(small_folder, reference, vision_thread):
    # 10 images on a one-slot engine whose pool holds 4 prefixes besides a request's own pages
    rng = np.random.default_rng(11)
    imgs = [rng.integers(0, 256, size=(60, 90, 3), dtype=np.uint8) for _ in range(10)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with _engine(small_folder, max_batch_size=1, vision_thread=vision_thread) as eng:
        # the ImageRefs kept until the results are in, then a second prompt on every image: the
        # prefixes of images no request needs give their pages back and are encoded again
        refs = [eng.encode_image(img) for img in imgs]
        first = [eng.submit(r, caption="short", params=params) for r in refs]
        short = [h.result(timeout=60).token_ids for h in first]
        second = [eng.submit(r, question="How many?", params=params) for r in refs]
        ask = [h.result(timeout=60).token_ids for h in second]
        for r in refs:
            r.release()
        assert eng.stats().prefixes_dropped >= len(imgs) - 4  # the pool holds 4 prefixes beside a request
        # the requests on encoded images go ahead of a new image that lacks pages
        again = _two_prompts_per_image(eng, imgs, params, params)
    _assert_clean(eng)
    want_short = [reference.generate(img, caption="short", params=params).token_ids for img in imgs]
    want_ask = [reference.generate(img, question="How many?", params=params).token_ids for img in imgs]
    assert short == want_short and ask == want_ask and again == want_short + want_ask
    # the smallest pool: one-token answers on four images leave their prefixes waiting for longer
    # second answers that no longer fit beside them; those prefixes give their pages back
    one, longer = SamplingParams(max_tokens=1), SamplingParams(max_tokens=20, ignore_eos=True)
    with _engine(small_folder, max_batch_size=1, kv_pages=9, vision_thread=vision_thread) as eng:
        assert eng._batch.reserve_pages == 9
        outs = _two_prompts_per_image(eng, imgs[:4], one, longer)
        assert eng.stats().prefixes_dropped > 0
    _assert_clean(eng)
    assert outs[4:] == [reference.generate(img, question="How many?", params=longer).token_ids for img in imgs[:4]]


@pytest.mark.parametrize("vision_thread", [True, False])
def test_a_higher_priority_goes_before_waiting_work(small_folder, reference, images, vision_thread):
    # one slot, taken by a batch job: a live frame submitted last is admitted when it frees,
    # before the batch requests that were waiting; within a priority, FIFO
    # The order is read from the requests' ends (one slot: each ends before the next is admitted),
    # not from admission times worked out from the test's clock: those were ~20 ms apart, the
    # same as a busy machine's pause in a submit. The first request is long, and holds the engine
    # at its end until every submit is in (a pause in the submits could let it end and the next
    # batch request in before the live frame came: the test's premise, not the engine, failed).
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    go, ended, test_thread = threading.Event(), [], threading.current_thread()
    with _engine(small_folder, max_batch_size=1, vision_thread=vision_thread) as eng:
        refs = [eng.encode_image(img) for img in images]  # preprocessed up front: the submits are quick
        handles = [eng.submit(refs[0], caption="short", params=SamplingParams(max_tokens=200, ignore_eos=True))]
        handles[0].add_done_callback(lambda h: threading.current_thread() is test_thread or go.wait(30))
        for i in range(1, 6):
            handles.append(eng.submit(refs[i % 4], caption="short", params=params))
        handles.append(eng.submit(refs[0], question="How many?", params=params, priority=1))
        for i, h in enumerate(handles[1:], 1):
            h.add_done_callback(lambda h, i=i: ended.append(i))
        go.set()
        for ref in refs:
            ref.release()
        outs = [h.result(timeout=60) for h in handles]
        with pytest.raises(RequestError, match="priority must be an integer"):
            eng.submit(images[0], caption="short", priority="high")
    _assert_clean(eng)
    assert ended == [6, 1, 2, 3, 4, 5]  # before every batch request still waiting; within a priority, FIFO
    assert outs[6].token_ids == reference.generate(images[0], question="How many?", params=params).token_ids


@pytest.mark.parametrize("vision_thread", [True, False])
@pytest.mark.parametrize("lower_turn", [0, 3])
def test_live_frames_that_keep_coming_slow_batch_work_but_do_not_stop_it(small_folder, reference, images,
                                                                           vision_thread, lower_turn):
    # one slot, held by a long live answer while the rest arrive; then a batch request waits among
    # live frames that keep coming (here: all waiting at once): with strict priority it goes last,
    # with turns after at most lower_turn - 1 of them
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    with _engine(small_folder, max_batch_size=1, vision_thread=vision_thread, lower_turn=lower_turn) as eng:
        # the order of admission as the engine thread makes it (times rebuilt from the requests'
        # timings were off by a step's length on a loaded machine, and the order with them)
        launch, order = eng._batch.launch, []
        eng._batch.launch = lambda step: (order.extend(seq.id for seq in step.admit), launch(step))
        refs = [eng.encode_image(img) for img in images]
        handles = []
        for i in range(9):
            if i == 1:
                handles.append(eng.submit(images[3], caption="short", params=params))  # its image not encoded yet
            else:
                handles.append(eng.submit(refs[i % 3], question="How many?", params=long if i == 0 else params,
                                          priority=1))
        for ref in refs:
            ref.release()
        outs = [h.result(timeout=60) for h in handles]
    _assert_clean(eng)
    admitted = [order.index(h.id) for h in handles]
    live_before = sum(a < admitted[1] for a in admitted[2:])
    # (the long one may be admitted before the batch request arrives, or after: it counts or not)
    assert live_before == 7 if lower_turn == 0 else 0 < live_before < lower_turn, admitted
    live = [a for i, a in enumerate(admitted) if i != 1]
    assert live == sorted(live)  # FIFO among the live frames
    assert outs[1].token_ids == reference.generate(images[3], caption="short", params=params).token_ids
    with pytest.raises(ConfigError, match="lower_turn must be 0"):
        EngineConfig(lower_turn=1)


@pytest.mark.parametrize("vision_thread", [True, False])
def test_stages_add_up_to_the_total(small_folder, images, vision_thread):
    """A chart stacks the stages: both the queue (vision thread) or the prefill (vision in the
    admission step) had held the image's encoding beside `vision`, 13-30 % more than the total;
    and images encoded in one step were each given the whole step's encoder time."""
    with _engine(small_folder, vision_thread=vision_thread) as eng:
        ref = eng.encode_image(images[3])
        ref_first = eng.submit(ref, caption="short", params=GREEDY).result(timeout=30)
        busy = eng.stats().busy_seconds + eng.stats().vision_busy_seconds
        outs = [h.result(timeout=60) for h in [eng.submit(img, caption="long", params=GREEDY) for img in images * 2]]
        busy = eng.stats().busy_seconds + eng.stats().vision_busy_seconds - busy
        again = eng.submit(ref, caption="short", params=GREEDY).result(timeout=30)  # its prefix encoded before
        ref.release()
        # ended before their first token, or in the middle: the stages still add up
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        cut = [eng.submit(img, caption="long", params=long) for img in images * 2]
        eng.close(cancel=True)
    t0 = time.perf_counter()
    eng.close()  # a third close (the with block's was the second)...
    assert time.perf_counter() - t0 < 2  # ...returns at once (it had waited 10 s on a queue nobody read)
    cut = [h.result(timeout=10) for h in cut]
    assert any(not o.token_ids for o in cut)  # some ended before their first token
    for o in [ref_first, *outs, again, *cut]:
        t = o.timings_ms
        parts = t["preprocess"] + t["queue"] + t["vision"] + t["prefill"] + t["decode"]
        assert parts == pytest.approx(t["total"], abs=0.01) and min(t.values()) >= 0, t
    # An image prefix encoded before its request came is no wait of the request's (the first
    # request on `ref` may come before its encoding or after it: 1 run in 5 after, and 0 here)
    assert again.timings_ms["vision"] == 0
    assert 0 < sum(o.timings_ms["vision"] for o in outs) <= busy * 1000


def test_a_request_is_charged_the_encoding_it_waited_for_not_all_of_it():
    """A second prompt on an image whose encoding began before it came waited for only the rest:
    charged the whole, its vision outgrew its wait, its queue went negative and the stages no
    longer made up the total."""
    from engine.sequence import Image, Sequence

    img = Image(id=1, crops=None, tiling=(1, 1), staged=True)  # encoded on the vision thread
    img.timings.vision = 50.0
    seq = Sequence(id=1, prompt=[3, 4, 5], params=SamplingParams(max_tokens=5), image=img, handle=None, capacity=5)
    seq.submitted_at, seq.admitted_at, seq.first_token_at = 100.0, 100.010, 100.020
    t = seq.output("stop", 100.030).timings
    assert t.vision == pytest.approx(10.0) and t.queue == pytest.approx(0.0)
    assert t.preprocess + t.queue + t.vision + t.prefill + t.decode == pytest.approx(t.total)


def test_vision_thread_error_reaches_the_caller(small_folder, images):
    eng = _engine(small_folder)

    def boom(crops, tiling):
        raise RuntimeError("vision exploded")

    eng._vision._encode = boom
    h = eng.submit(images[0], caption="short", params=GREEDY)
    assert h.result(timeout=30).finish_reason == "error"
    with pytest.raises(EngineClosedError, match="vision exploded"):
        eng.submit(images[0], caption="short")
    eng.close()
    assert eng.pool.n_free == eng.pool.n_pages and not eng._vision._executor._thread.is_alive()


def test_releases_and_cancels_get_through_a_full_queue_at_once(small_folder, images):
    """With the engine's queue full (its thread held in a callback), release() waited 10 s, was
    refused, and marked the ImageRef released all the same: a retry did nothing, and the image's
    pages stayed taken until close. cancel() waited 10 s and raised."""
    eng = _engine(small_folder, vision_thread=False, max_queue=1)
    held, go = threading.Event(), threading.Event()
    first = eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=1))
    first.add_done_callback(lambda h: (held.set(), go.wait(30)))
    assert held.wait(30)
    ref = eng.encode_image(images[1])  # the queue is full now
    t0 = time.monotonic()
    ref.release()
    assert time.monotonic() - t0 < 2.0
    go.set()
    h = eng.submit(images[2], caption="long", params=SamplingParams(max_tokens=200, ignore_eos=True))
    held.clear()
    go.clear()
    blocker = eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=1))
    blocker.add_done_callback(lambda b: (held.set(), go.wait(30)))
    assert held.wait(30)
    late = eng.submit(images[3], caption="long", params=SamplingParams(max_tokens=200, ignore_eos=True))
    t0 = time.monotonic()
    late.cancel()  # behind a request in a full queue
    h.cancel()
    assert time.monotonic() - t0 < 2.0
    go.set()
    assert late.result(timeout=30).finish_reason == "cancelled" and not late.result().token_ids
    assert h.result(timeout=30).finish_reason == "cancelled" and len(h.result().token_ids) < 200
    deadline = time.monotonic() + 30
    while (eng.stats().images or eng.stats().kv_pages_in_use) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.stats().images == 0 and eng.stats().kv_pages_in_use == 0 and eng.error is None
    eng.close(timeout=30)
    _assert_clean(eng)


def test_a_refused_request_gives_back_the_image_encoded_for_it(small_folder, images):
    """submit(rgb) encodes the image for the request alone: a request the engine's full queue
    refused left that image, and its prefix's pages, held until the engine closed."""
    import queue

    with _engine(small_folder) as eng:
        real = eng._inbox.queue.put

        def full_for_requests(message, *args, **kwargs):
            if message[0] == "request":
                raise queue.Full
            return real(message, *args, **kwargs)

        eng._inbox.queue.put = full_for_requests
        for _ in range(3):
            with pytest.raises(RequestError, match="queue is full"):
                eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=4))
        eng._inbox.queue.put = real
        deadline = time.monotonic() + 30
        while (eng.stats().images or eng.stats().kv_pages_in_use) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.stats().images == 0 and eng.stats().kv_pages_in_use == 0
        assert eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=4)).result(30).text
    _assert_clean(eng)


def test_an_engine_that_fails_to_start_leaves_no_thread(small_folder):
    """Its flags were checked after its executor's thread had started: each failed try left
    one running, waking ten times a second for the life of the process."""
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(ConfigError, match="cuda_graphs=True needs a CUDA device"):
            Engine(EngineConfig(model=str(small_folder), cuda_graphs=True))
    assert threading.active_count() == before, [t.name for t in threading.enumerate()]


def test_an_engine_whose_runner_fails_to_build_leaves_no_thread(small_folder, monkeypatch):
    """The device worker starts before the runner (its buffers, the script's warm-up) is built:
    a runner that fails there (out of memory) must not leave the worker running."""
    import engine.engine

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("not enough memory for the slots")

    monkeypatch.setattr(engine.engine, "Runner", out_of_memory)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="not enough memory"):
        Engine(EngineConfig(model=str(small_folder)))
    assert threading.active_count() == before, [t.name for t in threading.enumerate()]


def test_vision_thread_is_for_the_cpu():
    import torch

    from engine.vision_stage import vision_thread_mode

    assert vision_thread_mode(None, torch.device("cpu")) and not vision_thread_mode(False, torch.device("cpu"))
    assert not vision_thread_mode(None, torch.device("cuda"))
    with pytest.raises(ConfigError, match="vision_thread=True needs the CPU"):
        vision_thread_mode(True, torch.device("cuda"))


def test_keep_freed_memory_applies_on_glibc_linux():
    import platform
    import sys

    from app.launcher import keep_freed_memory

    expected = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is expected


def test_a_cancelled_close_waits_for_the_encoding_under_way_not_for_those_queued(small_folder):
    """Ctrl-C in a run of Moondream 2 on a CPU: close(cancel=True) waited for every image encoding
    queued on the vision thread (6-8 s each), for requests it had cancelled already."""
    engine = Engine(EngineConfig(model=str(small_folder), vision_thread=True))
    encode, started = engine._vision._encode, []

    def slow(crops, tiling):
        started.append(time.perf_counter())
        time.sleep(1.0)  # a full-size encoder on a CPU, scaled down
        return encode(crops, tiling)

    engine._vision._encode = slow
    handles = [engine.submit(np.full((64, 64, 3), 50 * i, np.uint8), caption="short") for i in range(3)]
    deadline = time.time() + 10
    while not started and time.time() < deadline:
        time.sleep(0.01)
    engine.close(cancel=True)
    assert len(started) == 1  # the one under way finished; the one queued behind it never ran
    assert [h.result(0).finish_reason for h in handles] == ["cancelled"] * 3
    assert not engine._vision._executor._thread.is_alive()


def test_the_vision_thread_encodes_the_highest_priority_first_and_never_a_released_image():
    """A live frame's image (priority 1) is encoded before the batch images waiting (FIFO among
    those), the image whose turn it is (`first`) before all, a released one (no request holds it)
    not at all; each encoding's time is recorded in ms, as every stage's."""
    from types import SimpleNamespace

    import torch

    from engine.types import StageTimings
    from engine.vision_stage import VisionStage

    def run(images, first=None):
        order = []

        def encode(crops, tiling):
            order.append(crops)
            time.sleep(0.02)
            return torch.zeros(1, 1)

        stage = VisionStage(encode, lambda: None, torch.device("cpu"), depth=1)
        try:
            end = time.time() + 20
            while any(i.embeds is None and i.holders for i in images):
                assert time.time() < end
                stage.feed([i for i in images if i.embeds is None], first)
                time.sleep(0.005)
                stage.collect()
        finally:
            stage.close()
        return order

    def image(name, priority, holders=1):
        return SimpleNamespace(crops=name, tiling=(1, 1), priority=priority, encoding=False, embeds=None,
                               holders=holders, staged=True, timings=StageTimings())

    images = [image("batch1", 0), image("batch2", 0), image("gone", 2, holders=0), image("live", 1)]
    assert run(images) == ["live", "batch1", "batch2"]
    assert all(15 <= i.timings.vision < 10_000 for i in images if i.holders)  # ms, as busy as the encoder
    images = [image("batch1", 0), image("batch2", 0), image("live", 1)]
    assert run(images, first=images[1]) == ["batch2", "live", "batch1"]


def test_the_vision_thread_encodes_an_image_once_and_commits_at_most_depth_images():
    """The engine loop feeds the stage at every turn: an image under way is not encoded again, and
    no more than `depth` images are handed to the worker, so that a live frame arriving next waits
    for those (6-8 s each for Moondream 2 on a CPU), not for every batch image waiting."""
    from types import SimpleNamespace

    import torch

    from engine.types import StageTimings
    from engine.vision_stage import VisionStage

    def image(name, priority):
        return SimpleNamespace(crops=name, tiling=(1, 1), priority=priority, encoding=False, embeds=None,
                               holders=1, staged=True, timings=StageTimings())

    gate, started = threading.Event(), []

    def encode(crops, tiling):
        started.append(crops)
        gate.wait(20)
        return torch.zeros(1, 1)

    def drain(stage, images):
        end = time.time() + 20
        while any(i.encoding and i.embeds is None for i in images):
            assert time.time() < end
            time.sleep(0.005)
            stage.collect()

    stage = VisionStage(encode, lambda: None, torch.device("cpu"), depth=2)
    try:
        alone = [image("alone", 0)]
        for _ in range(3):
            stage.feed(alone)
        gate.set()
        drain(stage, alone)
        assert started == ["alone"]
        gate.clear()
        started.clear()
        batch = [image(f"batch{i}", 0) for i in range(4)]
        stage.feed(batch)
        assert [i.encoding for i in batch] == [True, True, False, False]
        gate.set()
        drain(stage, batch)
        live = image("live", 1)
        stage.feed([i for i in batch if i.embeds is None] + [live])
        drain(stage, batch + [live])
        assert started == ["batch0", "batch1", "live", "batch2"]
    finally:
        gate.set()
        stage.close()


def test_set_pipeline_depth_switches_between_pipelined_and_blocking_steps(small_folder, images):
    """A benchmark's blocking baseline must be blocking: after set_pipeline_depth(1) no step is
    launched while another is in flight; at 2 the next step goes out before the last is committed."""
    with _engine(small_folder) as eng:
        batch, launch = eng._batch, eng._batch.launch
        in_flight_at_launch = []

        def recording(step):  # on the engine thread, the only one that launches
            in_flight_at_launch.append(len(batch.inflight))
            launch(step)

        batch.launch = recording
        long = SamplingParams(max_tokens=8, ignore_eos=True)
        eng.submit(images[0], caption="short", params=long).result(timeout=30)
        assert max(in_flight_at_launch) == 1  # pipelined: one step in flight behind each launch
        eng.set_pipeline_depth(1)  # taken before the request posted after it
        in_flight_at_launch.clear()
        eng.submit(images[1], caption="short", params=long).result(timeout=30)
        assert in_flight_at_launch and max(in_flight_at_launch) == 0
        eng.set_pipeline_depth(2)
        in_flight_at_launch.clear()
        eng.submit(images[2], caption="short", params=long).result(timeout=30)
        assert max(in_flight_at_launch) == 1
    _assert_clean(eng)


def test_reset_stats_restarts_every_counter_behind_the_rates(small_folder, images):
    """bench resets the counters between its pipelined and blocking runs: tokens, drafts and the
    device's busy time must count from the reset, and tokens_per_s is tokens over wall time."""
    with _engine(small_folder) as eng:
        first = eng.submit(images[0], caption="short", params=GREEDY).result(timeout=30)
        eng.submit(images[0], caption="short", params=GREEDY, draft=first.token_ids).result(timeout=30)
        before = eng.stats()
        assert before.tokens > 3 and before.draft_proposed > 0 and before.busy_seconds > 0
        busy_before = eng._executor.busy_seconds()
        eng.reset_stats()
        # handled in order: once this request is done the reset was taken before it
        eng.submit(images[1], caption="short", params=SamplingParams(max_tokens=3, ignore_eos=True)).result(timeout=30)
        after = eng.stats()
        assert after.tokens == 3  # this request's alone
        assert after.draft_proposed == after.draft_accepted == 0
        assert after.busy_seconds <= eng._executor.busy_seconds() - busy_before
        assert after.tokens_per_s == pytest.approx(after.tokens / after.wall_seconds, rel=1e-6)
    _assert_clean(eng)


def test_a_finished_request_is_not_counted_as_running(small_folder, images):
    """A request ends (finalized) before its pages go back (a step in flight still holds them):
    stats().running counts the answers still coming, not the finished ones whose pages wait."""
    seen = []
    with _engine(small_folder) as eng:
        h = eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=4, ignore_eos=True))
        # runs on the engine thread as the request ends, before its pages are released
        h.add_done_callback(lambda _: seen.append(eng.stats().running))
        h.result(timeout=30)
    assert seen == [0]
    _assert_clean(eng)


def test_stats_count_the_requests_waiting_for_a_slot(small_folder, images):
    seen = []
    with _engine(small_folder, max_batch_size=1) as eng:
        first = eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=20, ignore_eos=True))
        second = eng.submit(images[1], caption="short", params=GREEDY)
        # as the first ends, on the engine thread: its slot is not free yet, the second still waits
        first.add_done_callback(lambda _: seen.append((eng.stats().running, eng.stats().waiting)))
        assert first.result(timeout=30).finish_reason == "length" and second.result(timeout=30).token_ids
    assert seen == [(0, 1)]
    _assert_clean(eng)


def test_config_overrides_beside_a_config_are_applied(small_folder):
    with Engine(EngineConfig(model=str(small_folder), pipeline_depth=2), pipeline_depth=1, max_batch_size=3) as eng:
        assert eng.config.pipeline_depth == 1 and eng.config.max_batch_size == 3
        assert eng.config.model == str(small_folder)


def test_a_with_block_left_by_an_exception_cancels_its_requests(small_folder, images):
    """`with Engine(...)` ending in an exception closes with cancel=True: a request still queued
    is cancelled, not decoded to its end before the exception may propagate."""
    with pytest.raises(ValueError, match="the caller failed"):
        with _engine(small_folder) as eng:
            # The first request's callback holds the engine thread until close() has begun (its
            # cancel flag is set before that), so the second cannot run to its end before then.
            first = eng.submit(images[0], caption="short", params=SamplingParams(max_tokens=30, ignore_eos=True))
            first.add_done_callback(lambda _: eng._closing.wait(30))
            first.cancel()
            second = eng.submit(images[1], caption="short", params=SamplingParams(max_tokens=30, ignore_eos=True))
            raise ValueError("the caller failed")
    assert first.result(timeout=0).finish_reason == "cancelled"
    assert second.result(timeout=0).finish_reason == "cancelled"
    _assert_clean(eng)


def test_an_image_ref_of_another_engine_is_refused(small_folder, images):
    """Its pages and embeddings live in the other engine's pool: taken, the request had read
    another engine's memory."""
    with _engine(small_folder) as a, _engine(small_folder) as b:
        ref = a.encode_image(images[0])
        with pytest.raises(RequestError, match="belongs to another engine"):
            b.submit(ref, caption="short")
        assert a.submit(ref, caption="short", params=GREEDY).result(timeout=30).token_ids
        ref.release()
    _assert_clean(a)
    _assert_clean(b)


def test_a_draft_token_past_the_vocabulary_is_refused(small_folder, images):
    with _engine(small_folder) as eng:
        vocab = eng.model_config.text.vocab_size
        with pytest.raises(RequestError, match=r"draft token ids must be in \[0, 512\)"):
            eng.submit(images[0], caption="short", draft=[1, vocab])
        with pytest.raises(RequestError, match="draft token ids"):
            eng.submit(images[0], caption="short", draft=[-1])
        assert eng.submit(images[0], caption="short", params=GREEDY, draft=[vocab - 1]).result(timeout=30).token_ids


def test_a_prompt_that_leaves_no_room_for_an_answer_is_refused_and_one_token_less_is_answered(small_folder, images):
    """The context holds the image prefix, the prompt and the answer: a prompt that leaves room
    for no token at all is a RequestError at submit, and one that leaves room for one gets it."""
    from engine.models.prompt import prompt_ids

    with _engine(small_folder) as eng:
        mc = eng.model_config
        fits = mc.text.max_context - mc.prefix_len  # prompt tokens that leave room for one answer token

        def question(n_ids: int) -> str:
            for words in range(1, 400):
                q = " ".join(["star"] * words)
                if len(prompt_ids(mc, eng.loaded.tokenizer, question=q)) == n_ids:
                    return q
            pytest.fail(f"no question of {n_ids} prompt tokens")

        with pytest.raises(RequestError, match="does not fit"):
            eng.submit(images[0], question=question(fits + 1))
        out = eng.submit(images[0], question=question(fits), params=SamplingParams(max_tokens=5, ignore_eos=True)
                         ).result(timeout=30)
        assert len(out.token_ids) == 1 and out.finish_reason == "length"
    _assert_clean(eng)


def test_an_image_ref_released_while_a_submit_on_it_posts_is_released_after_that_request(small_folder, images):
    """The release that comes while a submit on the ref posts its request is posted by that submit,
    after its request: dropped, the image kept its prefix pages until close."""
    with _engine(small_folder) as eng:
        ref = eng.encode_image(images[0])
        post = eng._post

        def released_meanwhile(message):  # another thread's release() lands during the post
            if message[0] == "request":
                ref.release()
            post(message)

        eng._post = released_meanwhile
        h = eng.submit(ref, caption="short", params=GREEDY)
        eng._post = post
        assert ref.released and h.result(timeout=30).token_ids
        # the steps of a later request are committed after the last one that held the image
        eng.submit(images[1], caption="short", params=GREEDY).result(timeout=30)
        assert ref.id not in eng._batch.images
    _assert_clean(eng)


def test_the_smallest_kv_pools_that_serve(small_folder, images):
    """A pool must hold one full-context request (image prefix and context: 9 pages of the small
    model) and a page for each request that may run: at those edges it serves; a page less is
    a ConfigError at start."""
    with pytest.raises(ConfigError, match=r"kv_pages=8 cannot hold one full-context request \(9 pages\)"):
        Engine(EngineConfig(model=str(small_folder), max_batch_size=1, kv_pages=8))
    with pytest.raises(ConfigError, match="max_batch_size=10 is more requests than the KV pool's 9 pages"):
        Engine(EngineConfig(model=str(small_folder), max_batch_size=10, kv_pages=9))
    with _engine(small_folder, max_batch_size=9, kv_pages=9) as eng:
        hs = [eng.submit(images[0], caption="short", params=GREEDY) for _ in range(3)]
        assert all(h.result(timeout=30).token_ids for h in hs)
    _assert_clean(eng)


def test_a_request_finalized_but_not_finished_at_a_fork_ends_in_the_child(monkeypatch):
    """Batch.finalize marks a request finalized, then makes its output and finishes its handle:
    a fork in between had left that handle unfinished in the child, its result() waiting for ever."""
    import types
    import weakref

    from engine import open_engines
    from engine.inbox import Inbox
    from engine.request import RequestHandle

    class Seq:
        def __init__(self, handle):
            self.handle, self.finalized, self.finish_reason = handle, True, "stop"  # finalized, not yet finished

        def output(self, reason, now):
            return types.SimpleNamespace(finish_reason=reason)

    class FakeEngine:  # a WeakSet member
        pass

    eng = FakeEngine()
    handle = RequestHandle(eng, 1)
    eng._inbox, eng._batch, eng._shut = Inbox(8), types.SimpleNamespace(seqs={1: Seq(handle)}), False
    monkeypatch.setattr(open_engines, "open_engines", weakref.WeakSet([eng]))
    open_engines.forked()
    assert handle.result(timeout=1).finish_reason == "error"


def test_close_takes_infinity_for_no_limit_and_refuses_a_bad_timeout_or_cancel_before_closing(small_folder, images):
    """close(timeout=math.inf) was an OverflowError from Thread.join, NaN a ValueError, "5" a
    TypeError, each after the engine had started closing: it then took no more work."""
    import math

    eng = _engine(small_folder)
    for bad in ("5", float("nan")):
        with pytest.raises(RequestError, match="timeout must be a number of seconds or None"):
            eng.close(timeout=bad)
    with pytest.raises(RequestError, match="cancel must be True or False, got 'no'"):
        eng.close(cancel="no")  # had cancelled every request, and closed
    assert eng.submit(images[0], caption="short", params=GREEDY).result(timeout=30).finish_reason in ("stop", "length")
    eng.close(timeout=math.inf)
    _assert_clean(eng)
