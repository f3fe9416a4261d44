"""The running batch: what the engine thread owns between messages.

Waiting and running requests, the images they read, their KV pages and batch slots, and the
steps in flight. Only the engine thread touches a Batch (engine/engine.py posts every caller's
message to it), so nothing here locks. The life of a request:

    add_request -> admitted by launch() (slot, pages, the image's prefix shared) ->
    tokens accepted by commit() -> finalized (stop, length, cancel, error) -> released once no
    step in flight includes it (pages, slot, its hold on the image)

An image is released when no request or ImageRef holds it and no step in flight encodes it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import ModelConfig
from .engine_config import EngineConfig
from .detokenizer import WordStreamer
from .kv_cache import PagePool
from .invariants import check_invariants
from .scheduler import Budget, StepPlan, members, own_pages, plan
from .sequence import Image, Sequence
from .turns import Turns

if TYPE_CHECKING:  # bookkeeping, no torch: the device half lives in runner.py
    from .executor import Pending
    from .runner import Runner, StepResult, _Slot


@dataclass
class InFlight:
    plan: StepPlan
    pending: Pending
    slot: _Slot


class Batch:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, decode, pool: PagePool, runner: Runner,
                 prefix_pages: int, reserve_pages: int, max_draft: int):
        self.config, self.model_config, self._decode = config, model_config, decode
        self.pool, self.runner = pool, runner
        self.prefix_pages, self.reserve_pages, self.max_draft = prefix_pages, reserve_pages, max_draft
        self.free_slots = list(range(config.max_batch_size - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pending_images: list[Image] = []
        self.images: dict[int, Image] = {}
        self.seqs: dict[int, Sequence] = {}
        self.inflight: deque[InFlight] = deque()
        self.steps = self.tokens = 0
        self.draft_proposed = self.draft_accepted = 0
        self.prefixes_dropped = 0
        self.turns = Turns(config)  # one admission in lower_turn to a lower priority

    def has_work(self, closing: bool) -> bool:
        # Once closing, an image no request waits for is not worth encoding (and may not fit: close
        # would wait on it forever).
        return bool(self.waiting or self.inflight or any(not s.finalized for s in self.running)
                    or not closing and any(i.holders and not i.launched for i in self.pending_images))

    # ------------------------------------------------------------------ callers' messages

    def add_image(self, img: Image) -> None:
        self.images[img.id] = img
        self.pending_images.append(img)

    def add_request(self, seq: Sequence) -> None:
        if seq.image.id not in self.images:  # submitted with the request (held by no ImageRef)
            self.add_image(seq.image)
        seq.image.holders += 1
        seq.image.waiting += 1
        seq.image.priority = max(seq.image.priority, seq.priority)
        self.seqs[seq.id] = seq
        self.waiting.append(seq)

    def release_ref(self, img: Image) -> None:
        """An ImageRef let go of its image."""
        img.holders -= 1
        img.ref_held = False
        self.maybe_drop_crops(img)
        self.maybe_release_image(img)

    def cancel(self, seq_id: int) -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.finalized:
            self.finalize(seq, "cancelled")
            if not seq.admitted:
                self.waiting.remove(seq)
                seq.image.waiting -= 1
                self.maybe_drop_crops(seq.image)
            self.maybe_release(seq)

    def cancel_all(self) -> None:
        for seq_id in list(self.seqs):
            self.cancel(seq_id)

    # ------------------------------------------------------------------ a step: plan, launch, commit

    def lower_turn(self) -> Sequence | None:
        """The oldest waiting request below the top priority when it is its turn, else None (turns.py)."""
        return self.turns.lower(self.waiting)

    def plan(self, first: Sequence | None = None) -> StepPlan:
        budget = Budget(free_pages=self.pool.n_free, free_slots=len(self.free_slots),
                        prefill_tokens=self.config.prefill_token_budget,
                        prefix_len=self.model_config.prefix_len, prefix_pages=self.prefix_pages,
                        max_draft=self.max_draft, draft_rows=self.runner.draft_rows,
                        reserve_pages=self.reserve_pages)
        return plan(self.waiting, self.running, self.pending_images, budget, self.config.page_size, first)

    def launch(self, step: StepPlan) -> None:
        P, ps = self.model_config.prefix_len, self.config.page_size
        self.turns.count(step.admit, self.waiting)  # before the admitted leave it
        for img in step.images:
            img.pages = self.pool.allocate(self.prefix_pages)
            self.pending_images.remove(img)
        for seq in step.admit:
            self.waiting.remove(seq)  # by priority, then FIFO: not always the first
            seq.image.waiting -= 1
            seq.slot = self.free_slots.pop()
            seq.pages = self.pool.allocate(own_pages(seq, P, ps))
            shared = seq.image.pages[: P // ps]
            self.pool.incref(shared)
            seq.page_table = shared + seq.pages
            seq.kv_slots = self.runner.kv_slots(seq.page_table)
            seq.admitted_at = time.perf_counter()
            self.running.append(seq)
        self.steps += 1
        pending, slot = self.runner.launch(step, self.steps)
        for img in step.images:
            img.launched = True
            img.inflight += 1
        for img in {id(i): i for i in step.images + [s.image for s in step.admit]}.values():
            self.maybe_drop_crops(img)  # the step has them
        for seq in members(step):
            seq.inflight += 1
        for ch in step.prefills:
            ch.seq.prefilled += ch.length
            if ch.last:
                ch.seq.launched += 1 + len(ch.draft)
                ch.seq.drafted |= bool(ch.draft)
        for seq, d in zip(step.decodes, step.drafts):
            seq.launched += 1 + len(d)
            seq.drafted |= bool(d)
        self.inflight.append(InFlight(step, pending, slot))

    def commit(self, record: InFlight) -> None:
        # With another step in flight behind this one, the worker has work while this thread
        # notices the end of this one: it may look for it rather than be woken (executor.py).
        result: StepResult = record.pending.wait(timeout=600.0, poll=bool(self.inflight))
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
            self.maybe_release_image(img)
        for seq in members(step):
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
        for seq in members(step):
            d = drafts.get(id(seq))
            if d is not None:
                self._draft_done(seq, d, rows[id(seq)][2] - 1)
            self.maybe_release(seq)

    def _draft_done(self, seq: Sequence, proposed: list[int], accepted: int) -> None:
        """After a step of a drafting sequence: launched back to what was kept; a draft that
        proposed nothing or had nothing kept twice running is dropped (the sequence pipelines again)."""
        self.draft_proposed += len(proposed)
        self.draft_accepted += max(accepted, 0)
        if not seq.finalized:
            seq.launched = len(seq.tokens)
        # A sticky sequence keeps its draft while it repeats it, one row a step or more.
        seq.draft_misses = 0 if accepted > 0 or seq.sticky else seq.draft_misses + 1
        if seq.draft_misses >= 2 or seq.constraint is not None and not seq.sticky:
            seq.draft = seq.draft_index = None

    def _accept(self, seq: Sequence, token: int, now: float) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = now
        self.tokens += 1
        if token == self.model_config.tokenizer.eos_id and not seq.params.ignore_eos:
            self.finalize(seq, "stop")
            return
        seq.keep(token)
        if seq.streamer is None:
            seq.streamer = WordStreamer(self._decode)
        delta = seq.streamer.push(token)
        if delta:
            seq.text_parts.append(delta)
            seq.handle._emit(delta)
        if len(seq.tokens) >= seq.capacity:
            self.finalize(seq, "length")

    def finalize(self, seq: Sequence, reason: str) -> None:
        seq.finalized = True
        seq.finish_reason = reason
        if seq.streamer is not None and reason in ("stop", "length"):
            rest = seq.streamer.flush()
            if rest:
                seq.text_parts.append(rest)
                seq.handle._emit(rest)
        seq.handle._finish(seq.output(reason, time.perf_counter()))

    # ------------------------------------------------------------------ releases

    def maybe_release(self, seq: Sequence) -> None:
        if not seq.finalized or seq.inflight or seq.id not in self.seqs:
            return
        del self.seqs[seq.id]
        if seq.admitted:
            self.pool.decref(seq.page_table)
            self.free_slots.append(seq.slot)
            self.running.remove(seq)
        seq.image.holders -= 1
        self.maybe_release_image(seq.image)

    def maybe_release_image(self, img: Image) -> None:
        if not img.releasable or img.id not in self.images:
            return
        del self.images[img.id]
        if img in self.pending_images:
            self.pending_images.remove(img)
        if img.pages:
            self.pool.decref(img.pages)
            img.pages = []

    def maybe_drop_crops(self, img: Image) -> None:
        """An encoded image that no ImageRef holds and no request waits for will not be encoded
        again: its crops (or embeds) can go."""
        if img.launched and not img.ref_held and not img.waiting:
            img.crops = img.embeds = None

    def drop_idle_prefixes(self) -> bool:
        """Nothing runs and the first waiting request does not fit: the prefixes that no admitted
        request uses give their pages back, those of images no request waits for first, oldest
        first, until it fits; each is encoded again when a request comes to it. Without this, a
        pool full of prefixes that ImageRefs or waiting requests hold (more refs kept than the
        pool has room for; prompts on earlier images queued behind new ones) waits forever. True
        if any was dropped."""
        P, ps = self.model_config.prefix_len, self.config.page_size
        head = max(self.waiting, key=lambda s: s.priority)  # the planner's first: the earliest of the highest
        need = own_pages(head, P, ps) + (0 if head.image.launched else self.prefix_pages)
        idle = [img for img in self.images.values()  # in the order they came
                if img.ready and not img.inflight and img.pages and img.holders == img.ref_held + img.waiting
                and (img.crops is not None or img.embeds is not None)]
        dropped = False
        for img in sorted(idle, key=lambda i: i.waiting > 0):
            if self.pool.n_free >= need:
                break
            self.pool.decref(img.pages)
            img.pages, img.launched, img.ready = [], False, False
            self.pending_images.append(img)
            self.prefixes_dropped += 1
            dropped = True
        return dropped

    def drop_images(self) -> None:
        """At close: images still held by unreleased ImageRefs give their pages back too."""
        for img in list(self.images.values()):
            img.holders = 0
            self.maybe_release_image(img)

    def fail(self) -> None:
        """After a fatal error (the steps in flight forgotten): every request ends with "error",
        every page goes back."""
        self.inflight.clear()
        for slot in self.runner.slots:
            slot.busy = False
        for seq in list(self.seqs.values()):
            if not seq.finalized:
                self.finalize(seq, "error")
            if not seq.admitted and seq in self.waiting:
                self.waiting.remove(seq)
                seq.image.waiting -= 1
            seq.inflight = 0
            self.maybe_release(seq)
        for img in list(self.images.values()):
            img.inflight = 0
            self.maybe_release_image(img)

    def check_invariants(self, depth: int) -> None:
        """After the commits (debug_checks): the bookkeeping agrees with the steps in flight (invariants.py)."""
        check_invariants(self, depth)
