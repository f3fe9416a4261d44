"""The engine: continuous batching with pipelined decoding.

Callers (any thread) post messages to a bounded inbox; one engine thread owns all host state and
runs the loop:

    drain the inbox -> plan a step (pure) -> launch it -> commit the oldest step once
    `pipeline_depth` steps are in flight (or nothing else can be planned)

With depth 2 the device runs step t+1 while the host commits step t (appends tokens,
detokenizes, streams, finalizes); depth 1 commits right after each launch: the blocking
baseline, same code. A sequence that stops (EOS) or is cancelled is finalized at once and
released (pages, slot, image) when no launched step includes it any more.
"""

from __future__ import annotations

import atexit
import itertools
import numbers
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import EngineConfig
from .constraints import Choice, ConstraintError, compile_constraint
from .detokenizer import WordStreamer
from .device import Executor, Pending, graph_mode, script_mode, use_triton_kernels
from .errors import ConfigError, EngineClosedError, RequestError
from .kv_cache import PagePool
from .models.loader import load_model
from .models.prompt import prompt_ids
from .models.tiling import overlap_crops
from .request import ImageRef, RequestHandle, as_rgb
from .runner import Runner, StepResult, _Slot
from .scheduler import Budget, StepPlan, own_pages, plan
from .sequence import Image, Sequence
from .vision_stage import VisionStage, vision_thread_mode
from .types import EngineStats, SamplingParams


CONSTRAINT_CACHE_BYTES = 256 << 20  # compiled constraints kept for reuse, least recently used dropped first


@dataclass
class _InFlight:
    plan: StepPlan
    pending: Pending
    slot: _Slot


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        cfg = config or EngineConfig(**overrides)
        if config is not None and overrides:
            from dataclasses import replace
            cfg = replace(config, **overrides)
        self.config = cfg
        self.loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
        mc = self.loaded.config
        self.model_config = mc
        ps = cfg.page_size
        self._prefix_pages = -(-mc.prefix_len // ps)
        per_seq = -(-mc.text.max_context // ps)
        n_pages = cfg.kv_pages or cfg.max_batch_size * (per_seq + self._prefix_pages)
        need = self._prefix_pages + per_seq - mc.prefix_len // ps
        if n_pages < need:
            raise ConfigError(f"kv_pages={n_pages} cannot hold one full-context request ({need} pages)")
        self._reserve_pages = need
        _check_kv_fits(n_pages, ps, self.loaded, cfg)
        self.pool = PagePool(n_pages, ps)
        # Each flag checked before a thread starts: an Engine that failed to start left its
        # executor's thread running, one a try.
        device = self.loaded.device
        kernels = use_triton_kernels(cfg.triton_kernels, device)
        graphs, script = graph_mode(cfg.cuda_graphs, device), script_mode(cfg.cpu_script, device, kernels)
        staged = vision_thread_mode(cfg.vision_thread, device)
        self._executor = Executor(device)
        self._vision = None
        try:
            self.runner = Runner(self.loaded, n_pages, ps, cfg.max_batch_size, self._executor, kernels=kernels,
                                 graphs=graphs, script=script,
                                 draft_rows=min(cfg.prefill_token_budget, cfg.max_batch_size * cfg.max_draft))
            self._vision = VisionStage(self.runner.vision_prefix, self._wake, device) if staged else None
        except BaseException:
            self._executor.close()
            raise
        self._free_slots = list(range(cfg.max_batch_size - 1, -1, -1))
        self._max_draft = cfg.max_draft if self.runner.draft_rows else 0

        self._inbox: queue.Queue = queue.Queue(maxsize=cfg.max_queue)
        self._ids = itertools.count(1)
        self._closing = threading.Event()
        self._closed = False
        self._error: BaseException | None = None
        self._post_lock = threading.Lock()
        self._posting = 0  # posts past their checks, their message not yet in the inbox
        self._stopped = False  # the engine thread has ended (or failed) and reads no more messages
        self._automata: OrderedDict = OrderedDict()  # least recently used first

        # Engine-thread state.
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._pending_images: list[Image] = []
        self._images: dict[int, Image] = {}
        self._seqs: dict[int, Sequence] = {}
        self._inflight: deque[_InFlight] = deque()
        self._steps = 0
        self._tokens = 0
        self._started = time.perf_counter()
        self._busy_base = 0.0
        self._depth = cfg.pipeline_depth
        self._draft_proposed = self._draft_accepted = 0
        self._prefixes_dropped = 0
        self._higher_run = 0  # admissions of the top priority in a row while a lower one waited

        self._shut = False  # close() has joined every thread
        self._thread = threading.Thread(target=self._loop, name="vlmstream-engine", daemon=True)
        self._thread.start()
        _open_engines.add(self)

    # ------------------------------------------------------------------ public API (any thread)

    def encode_image(self, rgb: np.ndarray, priority: int = 0) -> ImageRef:
        """Preprocess an image (in the calling thread) and queue its prefix for encoding."""
        priority = _priority(priority)
        rgb = as_rgb(rgb)
        t0 = time.perf_counter()
        crops, tiling = overlap_crops(rgb, self.model_config.vision)
        image = Image(id=next(self._ids), crops=crops, tiling=tiling, priority=priority,
                      staged=self._vision is not None, n_crops=len(crops))
        image.timings.preprocess = (time.perf_counter() - t0) * 1000.0
        self._post(("image", image))
        return ImageRef(self, image)

    def submit(self, image: np.ndarray | ImageRef, caption: str | None = None, question: str | None = None,
               params: SamplingParams = SamplingParams(), constraint: Any = None,
               draft: list[int] | None = None, priority: int = 0) -> RequestHandle:
        """draft: token ids the answer will likely repeat, e.g. the previous video frame's answer to
        the same prompt. A greedy request without constraint verifies them several per step and
        gets exactly the answer it would get without (others ignore the draft), unless
        `params.sticky` asks to keep the draft's tokens where the model rates them nearly as high
        (constrained requests too, where the constraint allows the token).
        priority: requests of a higher priority are admitted (and their images encoded) before
        waiting ones of a lower priority, e.g. a live frame before a batch job's (default 0)."""
        if not isinstance(params, SamplingParams):
            raise RequestError("params must be a SamplingParams")
        priority = _priority(priority)
        if draft is not None:
            vocab = self.model_config.text.vocab_size
            try:
                draft = [int(t) for t in draft]
            except (TypeError, ValueError):
                raise RequestError("draft must be a list of token ids") from None
            if any(not 0 <= t < vocab for t in draft):
                raise RequestError(f"draft token ids must be in [0, {vocab})")
        ids = prompt_ids(self.model_config, self.loaded.tokenizer, caption=caption, question=question)
        mc = self.model_config
        room = mc.text.max_context - mc.prefix_len - len(ids) + 1
        if room < 1:
            raise RequestError(f"the prompt ({len(ids)} tokens) does not fit in the context "
                               f"({mc.text.max_context} tokens, {mc.prefix_len} taken by the image)")
        automaton = self._compile(constraint) if constraint is not None else None
        params = params.with_seed()
        own_ref = not isinstance(image, ImageRef)
        ref = self.encode_image(image, priority) if own_ref else image
        if ref._engine is not self:
            raise RequestError("that ImageRef belongs to another engine")
        handle = RequestHandle(self, next(self._ids))
        seq = Sequence(id=handle.id, prompt=ids, params=params, image=ref._image, handle=handle,
                       capacity=min(params.max_tokens, room), constraint=automaton, priority=priority,
                       waits_vision=not (ref._image.ready or ref._image.embeds is not None))
        # A constrained answer is verified a token a step (its automaton's state lives on the
        # device): its draft serves stickiness alone.
        if draft and params.temperature == 0 and (params.sticky or self._max_draft and automaton is None):
            # Past twice the answer's room a draft can only cost lookups.
            seq.set_draft(draft[: 2 * seq.capacity], mc.tokenizer.eos_id)
        try:
            with ref._lock:
                if ref._released:
                    raise RequestError("that ImageRef was released")
                self._post(("request", seq))
        except BaseException:
            # The image encoded for this request alone goes too: refused (a full queue), it had
            # kept its prefix's pages until the engine closed.
            if own_ref:
                try:
                    ref.release()
                except Exception:  # the refusal is what the caller is to hear of
                    pass
            raise
        if own_ref:
            ref.release()
        return handle

    def check_constraint(self, constraint: Any) -> None:
        """Compile a constraint now (kept for the requests that use it): one that cannot compile
        raises ConstraintError here, before any request is made with it."""
        self._compile(constraint)

    def _compile(self, constraint: Any):
        """Compiled automata are cached per constraint (many frames ask the same thing)."""
        try:
            hash(constraint)
        except TypeError:  # a dict or list given as the constraint, or a Choice holding a list
            if isinstance(constraint, Choice):
                raise ConstraintError("Choice needs a non-empty list of non-empty strings") from None
            raise ConstraintError(f"a constraint is a Regex, Choice or JsonSchema, got a {type(constraint).__name__}"
                                  ) from None
        with self._post_lock:
            automaton = self._automata.get(constraint)
            if automaton is not None:
                self._automata.move_to_end(constraint)
        if automaton is None:
            automaton = compile_constraint(constraint, self.loaded.tokenizer, self.model_config.text.vocab_size,
                                           self.model_config.tokenizer.eos_id, self.loaded.device)
            with self._post_lock:
                self._automata[constraint] = automaton
                # Bounded: choices that change with every frame had kept every table (at Moondream
                # 2's vocabulary, 12 MB each). A request holds its own automaton, evicted or not.
                held = sum(a.nbytes for a in self._automata.values())
                while held > CONSTRAINT_CACHE_BYTES and len(self._automata) > 1:
                    held -= self._automata.popitem(last=False)[1].nbytes
        return automaton

    def stats(self) -> EngineStats:
        wall = max(time.perf_counter() - self._started, 1e-9)
        busy = self._executor.busy_seconds() - self._busy_base
        return EngineStats(
            kv_pages_total=self.pool.n_pages, kv_pages_free=self.pool.n_free, kv_pages_in_use=self.pool.n_used,
            running=sum(1 for s in self._running if not s.finalized), waiting=len(self._waiting),
            images=len(self._images), steps=self._steps, tokens=self._tokens,
            device_busy_fraction=min(busy / wall, 1.0), tokens_per_s=self._tokens / wall,
            busy_seconds=busy, wall_seconds=wall, draft_proposed=self._draft_proposed,
            draft_accepted=self._draft_accepted,
            vision_queue=sum(1 for i in list(self._pending_images) if i.awaits_vision and i.holders),
            vision_busy_seconds=self._vision.busy_seconds() if self._vision is not None else 0.0,
            prefixes_dropped=self._prefixes_dropped,
        )

    def set_pipeline_depth(self, depth: int) -> None:
        """Switch between pipelined (2) and blocking (1) between steps; for benchmarks."""
        if depth not in (1, 2):
            raise RequestError(f"pipeline depth must be 1 or 2, got {depth}")
        self._post(("depth", depth))

    def reset_stats(self) -> None:
        """Restart the counters behind tokens/s and the busy fraction (for benchmarks)."""
        self._post(("reset_stats", None))

    def close(self, cancel: bool = False, timeout: float = 600.0) -> None:
        """Finish (or with cancel=True, cancel) all requests, free every page, join the threads.
        After a TimeoutError, a second call waits again (it had returned at once, the engine still
        running). From a done callback, which runs on the engine thread, it starts the closing and
        returns: the engine ends once the callback returns and the requests are done."""
        with self._post_lock:
            self._closed = True
        if self._shut:  # closed and joined already (by a with block, then by hand, then at exit)
            return
        if cancel and self._thread.is_alive():
            self._inbox.put(("cancel_all", None), timeout=10.0)
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
        _open_engines.discard(self)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(cancel=exc_type is not None)

    def _post(self, message: tuple, block: bool = True) -> None:
        with self._post_lock:
            new = message[0] in ("image", "request", "depth", "reset_stats")
            if self._error is not None and new:  # a release or cancel after a failure is moot: not an error
                raise EngineClosedError(f"the engine failed: {self._error}") from self._error
            if self._closed and new:
                raise EngineClosedError("the engine is closed")
            if self._stopped:  # a late release or cancel: the engine thread let everything go
                return
            # Counted until the message is in the inbox: the engine thread does not end (nor
            # fail everything) while a message that passed the checks above is on its way.
            if block:
                self._posting += 1
        if not block:  # from the engine thread itself (a done callback): never wait on ourselves
            self._handle(*message)
            return
        try:
            self._inbox.put(message, timeout=10.0)
        except queue.Full:
            raise RequestError(f"the engine's queue is full ({self.config.max_queue} messages)") from None
        finally:
            with self._post_lock:
                self._posting -= 1

    def _quiet(self) -> bool:
        """No message is in the inbox or on its way there (called with _post_lock held)."""
        return self._posting == 0 and self._inbox.empty()

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            stalled = False
            while True:
                # Block on the inbox when idle, or when work exists but none can be planned
                # (e.g. the pool is full of pages that ImageRefs hold): no busy spinning.
                self._drain(block=stalled or not self._has_work())
                if self._closing.is_set() and not self._has_work() and self._inbox.empty():
                    with self._post_lock:
                        self._stopped = self._quiet()
                    if self._stopped:
                        self._drop_images()
                        break
                turn = self._lower_turn()
                if self._vision is not None:  # images encoded on the vision thread; start the next
                    self._vision.collect()
                    self._vision.feed(self._pending_images, turn.image if turn is not None else None)
                step = self._plan(turn)
                stalled = step.empty and not self._inflight
                if stalled and self._waiting and self._drop_idle_prefixes():
                    continue  # plan again with the pages those prefixes gave back
                if not step.empty:
                    self._launch(step)
                if step.empty and self._inflight:
                    self._commit(self._inflight.popleft())
                while len(self._inflight) >= self._depth:
                    self._commit(self._inflight.popleft())
                if self.config.debug_checks:
                    self._check_invariants()
            self._executor.close()  # here too for a close() from a done callback, which cannot join
            if self._vision is not None:
                self._vision.close()
        except BaseException as e:  # a device or engine bug: fail every request, keep the cause
            with self._post_lock:
                self._error = e
            self._fail_all(e)

    def _has_work(self) -> bool:
        # Once closing, an image no request waits for is not worth encoding (and may not fit: close
        # would wait on it forever).
        return bool(self._waiting or self._inflight or any(not s.finalized for s in self._running)
                    or not self._closing.is_set()
                    and any(i.holders and not i.launched for i in self._pending_images))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                message = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            self._handle(*message)

    def _wake(self) -> None:
        """From the vision thread: an encoding is done (a full inbox is being drained anyway)."""
        try:
            self._inbox.put_nowait(("wake", None))
        except queue.Full:
            pass

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "image":
            self._images[item.id] = item
            self._pending_images.append(item)
        elif kind == "request":
            item.image.holders += 1
            item.image.waiting += 1
            item.image.priority = max(item.image.priority, item.priority)
            self._seqs[item.id] = item
            self._waiting.append(item)
        elif kind == "release":
            item.holders -= 1
            item.ref_held = False
            self._maybe_drop_crops(item)
            self._maybe_release_image(item)
        elif kind == "cancel":
            seq = self._seqs.get(item)
            if seq is not None and not seq.finalized:
                self._finalize(seq, "cancelled")
                if not seq.admitted:
                    self._waiting.remove(seq)
                    seq.image.waiting -= 1
                    self._maybe_drop_crops(seq.image)
                self._maybe_release(seq)
        elif kind == "cancel_all":
            for seq in list(self._seqs.values()):
                self._handle("cancel", seq.id)
        elif kind == "depth":
            self._depth = item
        elif kind == "reset_stats":
            self._started, self._tokens = time.perf_counter(), 0
            self._draft_proposed = self._draft_accepted = 0
            self._busy_base = self._executor.busy_seconds()

    def _lower_turn(self) -> Sequence | None:
        """The oldest waiting request below the top priority, when it is its turn: after
        `lower_turn` - 1 admissions of the top priority in a row while it waited. With strict
        priority, a live view that always has a frame waiting stopped a video job beside it (its
        frames, a sticky group at a time, queued for seconds: 13x the job's time alone)."""
        n = self.config.lower_turn
        if not n or self._higher_run < n - 1 or not self._waiting:
            return None
        top = max(s.priority for s in self._waiting)
        lower = [s for s in self._waiting if s.priority < top]
        return max(lower, key=lambda s: s.priority) if lower else None  # max: the first, FIFO

    def _count_turns(self, admitted: list[Sequence], waited: deque[Sequence]) -> None:
        if not admitted or not self.config.lower_turn:
            return
        top = max(s.priority for s in waited)
        lower_waited = any(s.priority < top for s in waited)
        for seq in admitted:
            if seq.priority < top:
                self._higher_run = 0
            elif lower_waited:
                self._higher_run += 1

    def _plan(self, first: Sequence | None = None) -> StepPlan:
        budget = Budget(free_pages=self.pool.n_free, free_slots=len(self._free_slots),
                        prefill_tokens=self.config.prefill_token_budget,
                        prefix_len=self.model_config.prefix_len, prefix_pages=self._prefix_pages,
                        max_draft=self._max_draft, draft_rows=self.runner.draft_rows,
                        reserve_pages=self._reserve_pages)
        return plan(self._waiting, self._running, self._pending_images, budget, self.config.page_size, first)

    def _launch(self, step: StepPlan) -> None:
        P, ps = self.model_config.prefix_len, self.config.page_size
        self._count_turns(step.admit, self._waiting)  # before the admitted leave it
        for img in step.images:
            img.pages = self.pool.allocate(self._prefix_pages)
            self._pending_images.remove(img)
        for seq in step.admit:
            self._waiting.remove(seq)  # by priority, then FIFO: not always the first
            seq.image.waiting -= 1
            seq.slot = self._free_slots.pop()
            seq.pages = self.pool.allocate(own_pages(seq, P, ps))
            shared = seq.image.pages[: P // ps]
            self.pool.incref(shared)
            seq.page_table = shared + seq.pages
            seq.kv_slots = self.runner.kv_slots(seq.page_table)
            seq.admitted_at = time.perf_counter()
            self._running.append(seq)
        self._steps += 1
        pending, slot = self.runner.launch(step, self._steps)
        for img in step.images:
            img.launched = True
            img.inflight += 1
        for img in {id(i): i for i in step.images + [s.image for s in step.admit]}.values():
            self._maybe_drop_crops(img)  # the step has them
        for seq in self._members(step):
            seq.inflight += 1
        for ch in step.prefills:
            ch.seq.prefilled += ch.length
            if ch.last:
                ch.seq.launched += 1 + len(ch.draft)
                ch.seq.drafted |= bool(ch.draft)
        for seq, d in zip(step.decodes, step.drafts):
            seq.launched += 1 + len(d)
            seq.drafted |= bool(d)
        self._inflight.append(_InFlight(step, pending, slot))

    @staticmethod
    def _members(step: StepPlan) -> list[Sequence]:
        return list({id(s): s for s in [c.seq for c in step.prefills] + step.decodes}.values())

    def _commit(self, record: _InFlight) -> None:
        result: StepResult = record.pending.wait(timeout=600.0)
        record.slot.busy = False
        step = record.plan
        now = time.perf_counter()
        crops = sum(img.n_crops for img in step.images) or 1
        for img in step.images:
            img.inflight -= 1
            img.ready = True
            # its share of the encoder's time in this step, by crops (each image had been given
            # the whole of it); after the vision stage's part, if any
            img.timings.vision += result.busy_ms.get("images", 0.0) * img.n_crops / crops
            self._maybe_release_image(img)
        for seq in self._members(step):
            seq.inflight -= 1
        drafts = {id(s): d for s, d in zip(step.decodes, step.drafts) if s.draft is not None}
        drafts.update((id(ch.seq), ch.draft) for ch in step.prefills if ch.draft)
        rows: dict[int, list] = {}  # per drafting sequence: [rows seen, still keeping, rows kept]
        for seq, token in zip(result.rows, result.tokens.tolist()):
            d = drafts.get(id(seq))
            if d is None:
                if not seq.finalized:
                    self._accept(seq, token, now)
                continue
            # Row j of a drafting sequence was fed d[j - 1]: its token is the greedy one only if
            # every earlier row's token was kept and equals the proposal fed to the next row.
            r = rows.setdefault(id(seq), [0, True, 0])
            j, r[0] = r[0], r[0] + 1
            if r[1] and not seq.finalized:
                self._accept(seq, token, now)
                r[2] += 1
                r[1] = j < len(d) and d[j] == token
            else:
                r[1] = False
        for seq in self._members(step):
            d = drafts.get(id(seq))
            if d is not None:
                self._draft_done(seq, d, rows[id(seq)][2] - 1)
            self._maybe_release(seq)

    def _draft_done(self, seq: Sequence, proposed: list[int], accepted: int) -> None:
        """After a step of a drafting sequence: launched back to what was kept; a draft that
        proposed nothing or had nothing kept twice running is dropped (the sequence pipelines again)."""
        self._draft_proposed += len(proposed)
        self._draft_accepted += max(accepted, 0)
        if not seq.finalized:
            seq.launched = len(seq.tokens)
        # A sticky sequence keeps its draft while it repeats it, one row a step or more.
        seq.draft_misses = 0 if accepted > 0 or seq.sticky else seq.draft_misses + 1
        if seq.draft_misses >= 2 or seq.constraint is not None and not seq.sticky:
            seq.draft = seq.draft_index = None

    def _accept(self, seq: Sequence, token: int, now: float) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = now
        self._tokens += 1
        if token == self.model_config.tokenizer.eos_id and not seq.params.ignore_eos:
            self._finalize(seq, "stop")
            return
        seq.keep(token)
        if seq.streamer is None:
            seq.streamer = WordStreamer(self.loaded.tokenizer.decode)
        delta = seq.streamer.push(token)
        if delta:
            seq.text_parts.append(delta)
            seq.handle._emit(delta)
        if len(seq.tokens) >= seq.capacity:
            self._finalize(seq, "length")

    def _finalize(self, seq: Sequence, reason: str) -> None:
        seq.finalized = True
        seq.finish_reason = reason
        if seq.streamer is not None and reason in ("stop", "length"):
            rest = seq.streamer.flush()
            if rest:
                seq.text_parts.append(rest)
                seq.handle._emit(rest)
        seq.handle._finish(seq.output(reason, time.perf_counter()))

    def _maybe_release(self, seq: Sequence) -> None:
        if not seq.finalized or seq.inflight or seq.id not in self._seqs:
            return
        del self._seqs[seq.id]
        if seq.admitted:
            self.pool.decref(seq.page_table)
            self._free_slots.append(seq.slot)
            self._running.remove(seq)
        seq.image.holders -= 1
        self._maybe_release_image(seq.image)

    def _maybe_release_image(self, img: Image) -> None:
        if not img.releasable or img.id not in self._images:
            return
        del self._images[img.id]
        if img in self._pending_images:
            self._pending_images.remove(img)
        if img.pages:
            self.pool.decref(img.pages)
            img.pages = []

    def _maybe_drop_crops(self, img: Image) -> None:
        """An encoded image that no ImageRef holds and no request waits for will not be encoded
        again: its crops (or embeds) can go."""
        if img.launched and not img.ref_held and not img.waiting:
            img.crops = img.embeds = None

    def _drop_idle_prefixes(self) -> bool:
        """Nothing runs and the first waiting request does not fit: the prefixes that no admitted
        request uses give their pages back, those of images no request waits for first, oldest
        first, until it fits; each is encoded again when a request comes to it. Without this, a
        pool full of prefixes that ImageRefs or waiting requests hold (more refs kept than the
        pool has room for; prompts on earlier images queued behind new ones) waits forever. True
        if any was dropped."""
        P, ps = self.model_config.prefix_len, self.config.page_size
        head = max(self._waiting, key=lambda s: s.priority)  # the planner's first: the earliest of the highest
        need = own_pages(head, P, ps) + (0 if head.image.launched else self._prefix_pages)
        idle = [img for img in self._images.values()  # in the order they came
                if img.ready and not img.inflight and img.pages and img.holders == img.ref_held + img.waiting
                and (img.crops is not None or img.embeds is not None)]
        dropped = False
        for img in sorted(idle, key=lambda i: i.waiting > 0):
            if self.pool.n_free >= need:
                break
            self.pool.decref(img.pages)
            img.pages, img.launched, img.ready = [], False, False
            self._pending_images.append(img)
            self._prefixes_dropped += 1
            dropped = True
        return dropped

    def _drop_images(self) -> None:
        """At close: images still held by unreleased ImageRefs give their pages back too."""
        for img in list(self._images.values()):
            img.holders = 0
            self._maybe_release_image(img)

    def _fail_all(self, error: BaseException) -> None:
        """After a fatal error: every request ends with "error", every page goes back."""
        self._inflight.clear()
        for slot in self.runner.slots:
            slot.busy = False
        deadline = time.monotonic() + 15.0  # a post waits 10 s at most for room in the inbox
        while True:
            try:
                kind, item = self._inbox.get(timeout=0.05)
            except queue.Empty:
                with self._post_lock:
                    if self._quiet() or time.monotonic() > deadline:
                        self._stopped = True
                        break
                continue
            if kind in ("image", "request", "release"):
                self._handle(kind, item)
        for seq in list(self._seqs.values()):
            if not seq.finalized:
                self._finalize(seq, "error")
            if not seq.admitted and seq in self._waiting:
                self._waiting.remove(seq)
                seq.image.waiting -= 1
            seq.inflight = 0
            self._maybe_release(seq)
        for img in list(self._images.values()):
            img.inflight = 0
            self._maybe_release_image(img)

    def _check_invariants(self) -> None:
        """After the commits (debug_checks): fewer than `pipeline_depth` steps in flight, and the
        count of in-flight steps each sequence and image keeps (what releases them) is exactly
        the number of those steps that include it."""
        assert len(self._inflight) < self._depth, (len(self._inflight), self._depth)
        seqs: dict[int, int] = {}
        images: dict[int, int] = {}
        for record in self._inflight:
            for seq in self._members(record.plan):
                assert seq.id in self._seqs, f"request {seq.id} released while a step holds it"
                seqs[seq.id] = seqs.get(seq.id, 0) + 1
            for img in record.plan.images:
                assert img.id in self._images, f"image {img.id} released while a step holds it"
                images[img.id] = images.get(img.id, 0) + 1
        for seq in self._seqs.values():
            assert seq.inflight == seqs.get(seq.id, 0), (seq.id, seq.inflight, seqs.get(seq.id, 0))
        for img in self._images.values():
            assert img.inflight == images.get(img.id, 0), (img.id, img.inflight, images.get(img.id, 0))
        waiting: dict[int, int] = {}
        for seq in self._waiting:
            waiting[id(seq.image)] = waiting.get(id(seq.image), 0) + 1
        for img in self._images.values():
            assert img.waiting == waiting.get(id(img), 0) and img.holders >= img.ref_held + img.waiting
            assert not (img.staged and img.launched and not img.encoding), "launched before the vision stage"


_open_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """A program that ends without close(): its requests are cancelled and the engine's threads
    joined before the interpreter goes down under them (a TorchScript call still running then had
    aborted the process: "terminate called without an active exception", exit 134)."""
    for engine in list(_open_engines):
        try:
            engine.close(cancel=True, timeout=30.0)
        except Exception:  # a failed or stuck engine: nothing more to do at exit
            pass


def _priority(priority: Any) -> int:
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
        raise RequestError(f"priority must be an integer, got {priority!r}")
    return int(priority)


def _check_kv_fits(n_pages: int, page_size: int, loaded, cfg: EngineConfig) -> None:
    """The KV cache is allocated whole at start: one that cannot fit is a ConfigError, not the
    allocator's RuntimeError (max_batch_size=100000 asked for 81 GB) or, on a CPU whose memory
    is overcommitted, the process killed while zeroing it."""
    t = loaded.config.text
    need = 2 * t.n_layers * (n_pages + 1) * page_size * t.n_kv_heads * t.head_dim * loaded.dtype.itemsize
    if loaded.device.type == "cuda":
        import torch

        room = torch.cuda.mem_get_info(loaded.device)[0]
    else:
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > room:
        raise ConfigError(f"the KV cache for max_batch_size={cfg.max_batch_size} ({n_pages} pages) takes "
                          f"{need / 2**30:.1f} GiB, more than the {room / 2**30:.1f} GiB of "
                          f"{'free GPU memory' if loaded.device.type == 'cuda' else 'memory'}; lower "
                          "max_batch_size or kv_pages")
