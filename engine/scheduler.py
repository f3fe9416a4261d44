"""Step planning: which images to encode, which prompts to prefill, which sequences to decode.

`plan()` is a pure selection over the engine's queues: it reads, it allocates nothing and
changes nothing; the engine applies the plan (admission, page allocation, in-flight counts).
Policy, in order: every running sequence that can still produce a token decodes; waiting
requests are admitted by priority, then in FIFO order (but `first`, the oldest request of a lower
priority when it is its turn, goes ahead once its image can be encoded and its pages are free:
EngineConfig.lower_turn),
while slots and free pages last (zombies keep their pages
until released), each bringing its image's encoding (vision + bidirectional prefix, never
chunked) if that is not launched yet; when one with a new image lacks pages, later requests on
encoded images still go ahead (they need their own pages alone, and their ends are what give
the other prefixes' pages back: waiting for them could wait forever); prompt prefill is chunked
so that the image prefixes plus prompt tokens of a step stay within the token budget (at least
one unit of prefill work always proceeds, so nothing starves).

Drafts: a greedy request may come with tokens its answer will likely repeat (a video's previous
frame's answer). The step of its prompt's last chunk, whose row samples the first answer token,
then also carries decode rows fed the draft's first tokens at the following positions, and each
later decode row carries up to `max_draft` proposed tokens the same way; the engine keeps the
rows' tokens up to the first proposal that differs from what greedy decoding chose, so the
answer is exactly the greedy one (a decode row's result does not depend on the other rows of its
step, and a step writes each row's KV before any row reads). An answer that repeats its draft
comes whole in the step of its first token. A sticky request (SamplingParams.sticky) proposes
the draft's tokens in order while its answer repeats the draft, and its rows prefer them
(engine/runner.py), so a frame read nearly as before gets the answer before.
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
    draft: list[int] = field(default_factory=list)  # tokens proposed from the first answer token on (last chunk)

    @property
    def last(self) -> bool:
        return self.start + self.length == len(self.seq.prompt)


@dataclass
class StepPlan:
    images: list[Image] = field(default_factory=list)
    admit: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per decode: tokens proposed after its next one

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
    max_draft: int = 0  # draft tokens proposed per sequence and step
    draft_rows: int = 0  # draft tokens proposed per step, all sequences together
    # Pages that images encoded ahead of their requests leave free: what a full-context request on
    # a new image needs. Without it, images encoded ahead (encode_image, submit later) could take
    # the pages every request needs, while their ImageRefs wait for those requests: a hang.
    reserve_pages: int = 0


def own_pages_for(n_prompt: int, capacity: int, prefix_len: int, page_size: int) -> int:
    """Pages a sequence needs beyond the shared full pages of its image prefix."""
    last_position = prefix_len + n_prompt + capacity - 2  # the last token is never fed back
    return last_position // page_size + 1 - prefix_len // page_size


def own_pages(seq: Sequence, prefix_len: int, page_size: int) -> int:
    return own_pages_for(len(seq.prompt), seq.capacity, prefix_len, page_size)


MATCH = 4  # longest suffix of the answer looked up in the draft


def propose(tokens: list[int], draft: tuple[int, ...], where: dict[int, list[int]], limit: int) -> list[int]:
    """Up to `limit` tokens the answer may go on with, read off the draft (prompt lookup): where
    the answer's last tokens occur in the draft (the longest match of up to MATCH tokens, then the
    occurrence nearest the same position), the draft's next tokens. No answer yet: its start."""
    if limit <= 0:
        return []
    if not tokens:
        return list(draft[:limit])
    best_key, best = None, None
    for c in where.get(tokens[-1], ()):
        if c + 1 >= len(draft):
            continue
        m = 1
        while m < MATCH and m <= c and m < len(tokens) and draft[c - m] == tokens[-1 - m]:
            m += 1
        key = (-m, abs(c + 1 - len(tokens)))
        if best_key is None or key < best_key:
            best_key, best = key, c + 1
    return [] if best is None else list(draft[best:best + limit])


def _fits_first(seq: Sequence, budget: Budget, page_size: int) -> bool:
    """Whether a request can go ahead of the others now: its image encoded (or encodable in the
    step) and its pages free. One that must wait for pages keeps its place in the order: put
    first, it held back every request while nothing ran, and freeing idle prefixes
    (Batch.drop_idle_prefixes) sizes what the first by priority needs."""
    if not (seq.image.launched or seq.image.encodable) or budget.free_slots == 0:
        return False
    need = own_pages(seq, budget.prefix_len, page_size) + (0 if seq.image.launched else budget.prefix_pages)
    return need <= budget.free_pages


def plan(waiting: deque[Sequence], running: list[Sequence], pending_images: list[Image],
         budget: Budget, page_size: int, first: Sequence | None = None) -> StepPlan:
    # A sequence with a draft waits for its step in flight: it proposes from committed tokens.
    step = StepPlan(decodes=[s for s in running if s.wants_decode() and not (s.draft and s.inflight)])
    rows = budget.draft_rows
    for s in step.decodes:
        d = []
        if s.draft and rows > 0 and s.constraint is None:
            limit = min(budget.max_draft, s.capacity - s.launched - 1, rows)
            d = list(s.sticky_tail()[:limit]) if s.sticky else propose(s.tokens, s.draft, s.draft_index, limit)
            rows -= len(d)
        step.drafts.append(d)
    pages, slots, tokens = budget.free_pages, budget.free_slots, budget.prefill_tokens

    # Admission in FIFO order. A request whose image is not encoded yet brings its image into
    # the step (vision + prefix; the prefix alone where the vision stage has run, and admission
    # waits for that); pages for both are reserved together, so images never take
    # the pages their own requests need (encoding ahead of admission could deadlock the pool).
    planned: set[int] = set()
    blocked = False  # a request with a new image lacked pages: only those on encoded images go on
    order = sorted(waiting, key=lambda s: -s.priority)  # stable: FIFO within a priority
    if first is not None and _fits_first(first, budget, page_size):
        order.remove(first)
        order.insert(0, first)
    for seq in order:
        img = seq.image
        new_image = not img.launched and id(img) not in planned
        need = own_pages(seq, budget.prefix_len, page_size) + (budget.prefix_pages if new_image else 0)
        if slots == 0 or new_image and not img.encodable:
            break
        if need > pages or blocked and new_image:
            if not new_image:
                break
            blocked = True
            continue
        if new_image:
            if tokens < budget.prefix_len and (step.images or step.admit):
                break
            step.images.append(img)
            planned.add(id(img))
            tokens -= budget.prefix_len
        step.admit.append(seq)
        slots -= 1
        pages -= need

    # Images encoded ahead of any request (encode_image, then submit later) use what is left,
    # beyond the reserve.
    if not waiting or len(step.admit) == len(waiting):
        for img in pending_images:
            if img.launched or img.holders == 0 or id(img) in planned or not img.encodable:
                continue
            if (budget.prefix_pages + budget.reserve_pages > pages
                    or tokens < budget.prefix_len and (step.images or step.admit)):
                break
            step.images.append(img)
            planned.add(id(img))
            pages -= budget.prefix_pages
            tokens -= budget.prefix_len

    for seq in [s for s in running if s.admitted and not s.finalized and not s.prefill_done] + step.admit:
        if tokens <= 0 and (step.prefills or step.images):
            break
        n = min(len(seq.prompt) - seq.prefilled, max(tokens, 1))
        step.prefills.append(PrefillChunk(seq, seq.prefilled, n))
        tokens -= n
    # A prompt's last chunk samples the first answer token; draft rows from the draft's start,
    # in the same step, can finish an answer that repeats the draft there and then.
    for ch in step.prefills:
        if ch.last and ch.seq.draft and rows > 0 and ch.seq.constraint is None:
            ch.draft = propose([], ch.seq.draft, ch.seq.draft_index, min(budget.max_draft, ch.seq.capacity - 1, rows))
            rows -= len(ch.draft)
    return step


def members(step: StepPlan) -> list[Sequence]:
    """The sequences a step includes, each once."""
    return list({id(s): s for s in [c.seq for c in step.prefills] + step.decodes}.values())
