"""Engine-side state of one image prefix and of one generation. No torch here.

Counters the engine loop alone changes:
- `inflight`: steps launched but not yet committed that include this item (0..pipeline depth);
- `launched`: answer tokens whose sampling has been launched (known before their values are;
  a draft step counts all its rows, and its commit sets it back to the tokens kept);
- `tokens`: answer tokens committed, in order.
A sequence is *finalized* once its result is decided (stop, length, cancelled, error) and
*released* (pages and slot returned) when it is finalized and `inflight` is 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .types import RequestOutput, SamplingParams, StageTimings


@dataclass(eq=False)
class Image:
    id: int
    crops: np.ndarray | None  # uint8 (N, C, C, 3); dropped once its encode step is launched
    tiling: tuple[int, int]
    holders: int = 1  # the user's ImageRef (until released) + every unreleased sequence using it
    pages: list[int] = field(default_factory=list)
    launched: bool = False
    ready: bool = False  # encode step committed
    inflight: int = 0
    failed: BaseException | None = None
    timings: StageTimings = field(default_factory=StageTimings)
    submitted_at: float = field(default_factory=time.perf_counter)
    priority: int = 0  # the highest of its requests' (engine.submit)
    staged: bool = False  # its encoding comes from the vision stage (engine/vision_stage.py)
    n_crops: int = 0  # its share of a step that encodes several images
    encoding: bool = False  # handed to the vision stage
    embeds: Any = None  # (P, C) prefix embeddings from the vision stage; then only the prefix step remains
    # While the user's ImageRef is held or requests wait for it, the image's crops (or embeds) are
    # kept after its prefix step: its prefix can then give its pages back while no admitted
    # request uses it, and be encoded again (Batch.drop_idle_prefixes).
    ref_held: bool = True
    waiting: int = 0  # its requests not admitted yet

    @property
    def releasable(self) -> bool:
        return self.holders == 0 and self.inflight == 0

    @property
    def encodable(self) -> bool:
        """Its prefix step can be planned: vision runs in that step, or has run in the stage."""
        return not self.staged or self.embeds is not None

    @property
    def awaits_vision(self) -> bool:
        """Waiting for the vision stage, or in it."""
        return self.staged and self.embeds is None and not self.launched


@dataclass(eq=False)
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    image: Image
    handle: Any  # RequestHandle: the engine reports deltas and the result to it
    capacity: int  # answer tokens this sequence may produce: min(max_tokens, what the context allows)
    constraint: Any = None  # CompiledConstraint or None
    priority: int = 0  # admitted (and its image encoded) before lower priorities; FIFO within one
    # Tokens the answer will likely repeat (e.g. the previous frame's answer), EOS appended; None
    # when the request has none or it stopped paying off. While it is set, the sequence decodes
    # only when none of its steps is in flight, so the host knows every token before it proposes.
    draft: tuple[int, ...] | None = None
    draft_index: dict[int, list[int]] | None = None  # token -> its positions in draft
    draft_misses: int = 0  # consecutive draft steps that kept none of their proposal
    drafted: bool = False  # draft rows were launched: the device's last token for its slot is not reliable
    sticky: bool = False  # params.sticky is set and the answer so far repeats the draft
    slot: int | None = None
    pages: list[int] = field(default_factory=list)  # own pages (the first may copy the prefix tail)
    page_table: list[int] = field(default_factory=list)  # shared prefix pages + own pages
    prefilled: int = 0  # prompt tokens launched
    launched: int = 0
    tokens: list[int] = field(default_factory=list)
    inflight: int = 0
    finalized: bool = False
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)
    streamer: Any = None  # WordStreamer, created at the first token
    kv_slots: Any = None  # np.ndarray: flat KV index of every position, fixed at admission
    timings: StageTimings = field(default_factory=StageTimings)
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    waits_vision: bool = True  # its image was not encoded yet when it came (not a prefix encoded before)

    @property
    def admitted(self) -> bool:
        return self.slot is not None

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == len(self.prompt)

    def output(self, reason: str, now: float) -> RequestOutput:
        """The final result, with its per-stage timings (ms). The stages do not overlap: preprocess
        + queue + vision + prefill + decode is the total (a chart stacks them). `vision` is the
        encoding of its image that this request waited for (none for a prefix encoded before it
        came), taken out of the wait it happened in: the queue where a vision thread encodes
        images before admission, the prefill where the admission step encodes them. Both had
        counted it, so the stages came to 13-30 % more than the total."""
        t, img = self.timings, self.image
        t.preprocess = img.timings.preprocess
        queue = ((self.admitted_at or now) - self.submitted_at) * 1000.0
        prefill = 0.0
        if self.first_token_at is not None:
            t.first_token = (self.first_token_at - self.submitted_at) * 1000.0 + t.preprocess
            prefill = (self.first_token_at - (self.admitted_at or self.first_token_at)) * 1000.0
            t.decode = (now - self.first_token_at) * 1000.0
        elif self.admitted_at is not None:  # admitted, ended before its first token (cancelled, failed)
            prefill = (now - self.admitted_at) * 1000.0
        waited = queue if img.staged else prefill
        t.vision = min(img.timings.vision, waited) if self.waits_vision else 0.0
        t.queue = queue - t.vision if img.staged else queue
        t.prefill = prefill if img.staged else prefill - t.vision
        t.total = (now - self.submitted_at) * 1000.0 + t.preprocess
        return RequestOutput("".join(self.text_parts), list(self.tokens), reason, t, self.params.seed)

    def set_draft(self, tokens: list[int], eos: int) -> None:
        self.draft = tuple(tokens) + (eos,)
        self.draft_index = {}
        for i, t in enumerate(self.draft):
            self.draft_index.setdefault(t, []).append(i)
        self.sticky = self.params.sticky > 0

    def sticky_tail(self) -> tuple[int, ...]:
        """The draft past the committed answer while the answer repeats it (SamplingParams.sticky):
        the tokens the next rows prefer, in order. Empty when the sequence is not sticky."""
        return self.draft[len(self.tokens):] if self.sticky else ()

    def keep(self, token: int) -> None:
        """Append a committed answer token; an answer that leaves its draft stops being sticky."""
        n = len(self.tokens)
        self.tokens.append(token)
        if self.sticky and (n >= len(self.draft) or self.draft[n] != token):
            self.sticky = False

    def wants_decode(self) -> bool:
        """True if a decode step for this sequence could still produce a token we keep.

        EOS is not known until commit, so a sequence whose EOS is still in flight is included
        (a zombie); stops known in advance (capacity) are not."""
        return (self.admitted and not self.finalized and self.prefill_done
                and 0 < self.launched < self.capacity)
