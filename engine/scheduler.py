"""Step planning: which images to encode, which prompts to prefill, which sequences to decode.

`plan()` is a pure selection over the engine's queues: it reads, it allocates nothing and
changes nothing; the engine applies the plan (admission, page allocation, in-flight counts).
Policy, in order: every running sequence that can still produce a token decodes; pending images
are encoded (vision + bidirectional prefix, never chunked) and waiting requests admitted in FIFO
order while slots and free pages last (zombies keep their pages until released); prompt prefill
is chunked so that the image prefixes plus prompt tokens of a step stay within the token budget
(at least one unit of prefill work always proceeds, so nothing starves).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .sequence import Image, Sequence


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # index into the prompt
    length: int

    @property
    def last(self) -> bool:
        return self.start + self.length == len(self.seq.prompt)


@dataclass
class StepPlan:
    images: list[Image] = field(default_factory=list)
    admit: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.images or self.prefills or self.decodes)


@dataclass(frozen=True)
class Budget:
    free_pages: int
    free_slots: int
    prefill_tokens: int
    prefix_len: int
    prefix_pages: int


def own_pages_for(n_prompt: int, capacity: int, prefix_len: int, page_size: int) -> int:
    """Pages a sequence needs beyond the shared full pages of its image prefix."""
    last_position = prefix_len + n_prompt + capacity - 2  # the last token is never fed back
    return last_position // page_size + 1 - prefix_len // page_size


def own_pages(seq: Sequence, prefix_len: int, page_size: int) -> int:
    return own_pages_for(len(seq.prompt), seq.capacity, prefix_len, page_size)


def plan(waiting: deque[Sequence], running: list[Sequence], pending_images: list[Image],
         budget: Budget, page_size: int) -> StepPlan:
    step = StepPlan(decodes=[s for s in running if s.wants_decode()])
    pages, slots, tokens = budget.free_pages, budget.free_slots, budget.prefill_tokens

    # Images first: a waiting request cannot start before its image prefix is launched.
    for img in pending_images:
        if img.launched or img.holders == 0:
            continue
        if budget.prefix_pages > pages or (step.images and tokens < budget.prefix_len):
            break
        step.images.append(img)
        pages -= budget.prefix_pages
        tokens -= budget.prefix_len

    launched = {id(i) for i in step.images}
    for seq in waiting:
        if not (seq.image.launched or id(seq.image) in launched):
            break  # FIFO: the head waits for its image, so does everyone behind it
        need = own_pages(seq, budget.prefix_len, page_size)
        if slots == 0 or need > pages:
            break
        step.admit.append(seq)
        slots -= 1
        pages -= need

    for seq in [s for s in running if s.admitted and not s.finalized and not s.prefill_done] + step.admit:
        if tokens <= 0 and (step.prefills or step.images):
            break
        n = min(len(seq.prompt) - seq.prefilled, max(tokens, 1))
        step.prefills.append(PrefillChunk(seq, seq.prefilled, n))
        tokens -= n
    return step
