"""The engine: continuous batching with pipelined decoding.

Callers (any thread) post messages to a bounded inbox (engine/inbox.py); one engine thread owns
all host state (the running batch: engine/batch.py) and runs the loop:

    drain the inbox -> plan a step (pure) -> launch it -> commit the oldest step once
    `pipeline_depth` steps are in flight (or nothing else can be planned)

With depth 2 the device runs step t+1 while the host commits step t (appends tokens,
detokenizes, streams, finalizes); depth 1 commits right after each launch: the blocking
baseline, same code. A sequence that stops (EOS) or is cancelled is finalized at once and
released (pages, slot, image) when no launched step includes it any more.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence as Seq

import numpy as np

from .arguments import check_cancel, check_depth, checked_draft, checked_priority
from .batch import Batch
from .engine_config import EngineConfig
from .constraint_cache import ConstraintCache
from .device import graph_mode, script_mode, use_triton_kernels
from .executor import Executor
from .errors import ConfigError, RequestError
from .inbox import Inbox
from .kv_cache import PagePool
from .kv_memory import pool_pages
from .models.loader import load_model
from .models.prompt import prompt_ids
from .models.tiling import overlap_crops
from .open_engines import open_engines
from .request import ImageRef, RequestHandle, as_rgb
from .runner import Runner
from .sequence import Image, Sequence
from .vision_stage import VisionStage, vision_thread_mode
from .timeouts import seconds
from .types import EngineStats, SamplingParams

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        if config is not None and not isinstance(config, EngineConfig):  # Engine("tiny"): an AttributeError
            raise ConfigError(f"config must be an EngineConfig (or None, with its fields as keywords), "
                              f"got {type(config).__name__}: Engine(model=...) or Engine(EngineConfig(...))")
        cfg = config or EngineConfig(**overrides)
        if config is not None and overrides:
            from dataclasses import replace
            cfg = replace(config, **overrides)
        self.config = cfg
        self.loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
        mc = self.loaded.config
        self.model_config = mc
        ps = cfg.page_size
        n_pages, prefix_pages, need = pool_pages(cfg, self.loaded)
        self.pool = PagePool(n_pages, ps)
        # Each flag checked before a thread starts: an Engine that failed to start left its
        # executor's thread running, one a try.
        device = self.loaded.device
        kernels = use_triton_kernels(cfg.triton_kernels, device)
        graphs, script = graph_mode(cfg.cuda_graphs, device), script_mode(cfg.cpu_script, device, kernels)
        staged = vision_thread_mode(cfg.vision_thread, device)
        self._inbox = Inbox(cfg.max_queue)  # before the vision stage, which wakes the engine through it
        self._executor = Executor(device)
        self._vision = None
        try:
            self.runner = Runner(self.loaded, n_pages, ps, cfg.max_batch_size, self._executor, kernels=kernels,
                                 graphs=graphs, script=script,
                                 draft_rows=min(cfg.prefill_token_budget, cfg.max_batch_size * cfg.max_draft))
            self._vision = VisionStage(self.runner.vision_prefix, self._inbox.wake, device) if staged else None
        except BaseException:
            self._executor.close()
            raise
        self._max_draft = cfg.max_draft if self.runner.draft_rows else 0
        # Engine-thread state: the requests, images, pages and slots, and the steps in flight.
        self._batch = Batch(cfg, mc, self.loaded.tokenizer.decode, self.pool, self.runner,
                            prefix_pages=prefix_pages, reserve_pages=need, max_draft=self._max_draft)

        self._ids = itertools.count(1)
        self._closing = threading.Event()
        self._cancelling = False  # close(cancel=True): every request is cancelled, those to come too
        self._constraints = ConstraintCache(self.loaded.tokenizer, self.model_config.text.vocab_size,
                                            self.model_config.tokenizer.eos_id, self.loaded.device)

        self._started = time.perf_counter()
        self._busy_base = 0.0
        self._depth = cfg.pipeline_depth

        self._shut = False  # close() has joined every thread
        self._thread = threading.Thread(target=self._loop, name="vlmstream-engine", daemon=True)
        self._inbox.owner = self._thread
        self._thread.start()
        open_engines.add(self)

    # ------------------------------------------------------------------ public API (any thread)

    def encode_image(self, rgb: np.ndarray | PILImage, priority: int = 0) -> ImageRef:
        """Preprocess an image (in the calling thread) and queue its prefix for encoding. rgb: a
        uint8 array, RGB (H, W, 3), RGBA, grey or grey with alpha, or a Pillow image (engine.request.as_rgb)."""
        self._inbox.check_open()
        image = self._image(rgb, checked_priority(priority))
        self._post(("image", image))
        return ImageRef(self, image)

    def _image(self, rgb: np.ndarray, priority: int, held: bool = True) -> Image:
        """held: by an ImageRef (encode_image); otherwise by its request alone (submit)."""
        rgb = as_rgb(rgb)
        t0 = time.perf_counter()
        crops, tiling = overlap_crops(rgb, self.model_config.vision)
        image = Image(id=next(self._ids), crops=crops, tiling=tiling, priority=priority,
                      staged=self._vision is not None, n_crops=len(crops), holders=int(held), ref_held=held)
        image.timings.preprocess = (time.perf_counter() - t0) * 1000.0
        return image

    def submit(self, image: np.ndarray | PILImage | ImageRef, caption: str | None = None, question: str | None = None,
               params: SamplingParams = SamplingParams(), constraint: Any = None,
               draft: Seq[int] | None = None, priority: int = 0) -> RequestHandle:
        """draft: token ids the answer will likely repeat, e.g. the previous video frame's answer to
        the same prompt. A greedy request without constraint verifies them several per step and
        gets exactly the answer it would get without (others ignore the draft), unless
        `params.sticky` asks to keep the draft's tokens where the model rates them nearly as high
        (constrained requests too, where the constraint allows the token).
        priority: requests of a higher priority are admitted (and their images encoded) before
        waiting ones of a lower priority, e.g. a live frame before a batch job's (default 0)."""
        self._inbox.check_open()
        if not isinstance(params, SamplingParams):
            raise RequestError("params must be a SamplingParams")
        priority = checked_priority(priority)
        if draft is not None:
            draft = checked_draft(draft, self.model_config.text.vocab_size)
        ids = prompt_ids(self.model_config, self.loaded.tokenizer, caption=caption, question=question)
        mc = self.model_config
        room = mc.text.max_context - mc.prefix_len - len(ids) + 1
        if room < 1:
            raise RequestError(f"the prompt ({len(ids)} tokens) does not fit in the context "
                               f"({mc.text.max_context} tokens, {mc.prefix_len} taken by the image)")
        automaton = self._constraints.get(constraint) if constraint is not None else None
        params = params.with_seed()
        if isinstance(image, ImageRef):
            ref, img = image, image._image
            if ref._engine is not self:
                raise RequestError("that ImageRef belongs to another engine")
        else:
            # The image goes in the request's message, held by the request alone: one message,
            # taken or refused whole. Posted apart (image, request, then the image's release),
            # a refused request left an image to release, and a refused release (the queue
            # full) left it held until close, and the request, queued already, unreported.
            ref, img = None, self._image(image, priority, held=False)
        handle = RequestHandle(self, next(self._ids))
        seq = Sequence(id=handle.id, prompt=ids, params=params, image=img, handle=handle,
                       capacity=min(params.max_tokens, room), constraint=automaton, priority=priority,
                       waits_vision=not (img.ready or img.embeds is not None))
        # A constrained answer is verified a token a step (its automaton's state lives on the
        # device): its draft serves stickiness alone.
        if draft and params.temperature == 0 and (params.sticky or self._max_draft and automaton is None):
            # Past twice the answer's room a draft can only cost lookups.
            seq.set_draft(draft[: 2 * seq.capacity], mc.tokenizer.eos_id)
        if ref is None:
            self._post(("request", seq))
            return handle
        ref._submitting()
        try:
            self._post(("request", seq))
        finally:
            if ref._submitted():  # released meanwhile: its release goes after this request
                self._post(("release", ref._image))
        return handle

    def check_constraint(self, constraint: Any) -> None:
        """Compile a constraint now (kept for the requests that use it): one that cannot compile
        raises ConstraintError here, before any request is made with it."""
        self._constraints.get(constraint)

    @property
    def error(self) -> BaseException | None:
        """What failed the engine (every request then finished "error"), or None."""
        return self._inbox.error

    def stats(self) -> EngineStats:
        wall = max(time.perf_counter() - self._started, 1e-9)
        busy = self._executor.busy_seconds() - self._busy_base
        b = self._batch
        return EngineStats(
            kv_pages_total=self.pool.n_pages, kv_pages_free=self.pool.n_free, kv_pages_in_use=self.pool.n_used,
            running=sum(1 for s in list(b.running) if not s.finalized), waiting=len(b.waiting),
            images=len(b.images), steps=b.steps, tokens=b.tokens,
            device_busy_fraction=min(busy / wall, 1.0), tokens_per_s=b.tokens / wall,
            busy_seconds=busy, wall_seconds=wall, draft_proposed=b.draft_proposed,
            draft_accepted=b.draft_accepted,
            vision_queue=sum(1 for i in list(b.pending_images) if i.awaits_vision and i.holders),
            vision_busy_seconds=self._vision.busy_seconds() if self._vision is not None else 0.0,
            prefixes_dropped=b.prefixes_dropped,
        )

    def set_pipeline_depth(self, depth: int) -> None:
        """Switch between pipelined (2) and blocking (1) between steps; for benchmarks."""
        check_depth(depth)
        self._post(("depth", depth))

    def reset_stats(self) -> None:
        """Restart the counters behind tokens/s and the busy fraction (for benchmarks)."""
        self._post(("reset_stats", None))

    def close(self, cancel: bool = False, timeout: float | None = 600.0) -> None:
        """Finish (or with cancel=True, cancel) all requests, free every page, join the threads.
        After a TimeoutError, a second call waits again (it had returned at once, the engine still
        running). From a done callback, which runs on the engine thread, it starts the closing and
        returns: the engine ends once the callback returns and the requests are done.
        timeout None (or math.inf): no limit."""
        timeout = seconds(timeout)  # before anything closes: a bad one leaves the engine as it was
        check_cancel(cancel)
        self._inbox.close()
        if self._shut:  # closed and joined already (by a with block, then by hand, then at exit)
            return
        if cancel:
            # A flag, not a message: posted to a full inbox it had raised queue.Full after 10 s
            # (from a done callback, always, the engine thread waiting on itself), closing
            # nothing. Requests still on their way to the inbox are cancelled as they come.
            self._cancelling = True
        self._closing.set()
        if threading.current_thread() is self._thread:
            return  # joining would wait on ourselves
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"engine did not drain within {timeout} s")
        self._executor.close()
        if self._vision is not None:
            self._vision.close()
        self._shut = True
        open_engines.discard(self)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(cancel=exc_type is not None)

    def _post(self, message: tuple) -> None:
        self._inbox.post(message)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        batch = self._batch
        try:
            stalled = False
            while True:
                # Block on the inbox when idle, or when work exists but none can be planned
                # (e.g. the pool is full of pages that ImageRefs hold): no busy spinning.
                self._drain(block=stalled or not batch.has_work(self._closing.is_set()))
                if self._cancelling:  # close(cancel=True): what is running, and what comes
                    batch.cancel_all()
                if self._closing.is_set() and not batch.has_work(True) and not self._inbox.holds():
                    if self._inbox.stop_if_quiet():
                        batch.drop_images()
                        break
                turn = batch.lower_turn()
                if self._vision is not None:  # images encoded on the vision thread; start the next
                    self._vision.collect()
                    self._vision.feed(batch.pending_images, turn.image if turn is not None else None)
                step = batch.plan(turn)
                stalled = step.empty and not batch.inflight
                if stalled and batch.waiting and batch.drop_idle_prefixes():
                    continue  # plan again with the pages those prefixes gave back
                if not step.empty:
                    batch.launch(step)
                if step.empty and batch.inflight:
                    batch.commit(batch.inflight.popleft())
                while len(batch.inflight) >= self._depth:
                    batch.commit(batch.inflight.popleft())
                if self.config.debug_checks:
                    batch.check_invariants(self._depth)
            self._executor.close()  # here too for a close() from a done callback, which cannot join
            if self._vision is not None:
                self._vision.close()
        except BaseException as e:  # a device or engine bug: fail every request, keep the cause
            self._inbox.fail(e)
            self._fail_all(e)

    def _drain(self, block: bool) -> None:
        while True:
            message = self._inbox.next(block)
            if message is None:
                return
            block = False
            self._handle(*message)

    def _handle(self, kind: str, item: Any) -> None:
        batch = self._batch
        if kind == "image":
            batch.add_image(item)
        elif kind == "request":
            batch.add_request(item)
        elif kind == "release":
            batch.release_ref(item)
        elif kind == "cancel":
            batch.cancel(item)
        elif kind == "depth":
            self._depth = item
        elif kind == "reset_stats":
            self._started, batch.tokens = time.perf_counter(), 0
            batch.draft_proposed = batch.draft_accepted = 0
            self._busy_base = self._executor.busy_seconds()

    def _fail_all(self, error: BaseException) -> None:
        """After a fatal error: the messages on their way are taken in, then every request ends
        with "error" and every page goes back."""
        deadline = time.monotonic() + 15.0  # a post waits 10 s at most for room in the inbox
        while True:
            message = self._inbox.next(block=True)
            if message is None:
                if self._inbox.stop_if_quiet(force=time.monotonic() > deadline):
                    break
                continue
            if message[0] in ("image", "request", "release"):
                self._handle(*message)
        self._batch.fail()
        # ImageRefs still held give their pages back too: their release is moot now (_post), and
        # they had kept their prefixes' pages after the failure, and after close.
        self._batch.drop_images()
