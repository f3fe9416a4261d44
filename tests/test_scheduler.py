"""The planner alone: a pure selection (it changes nothing it is given) that keeps a step's
prompt tokens within the prefill budget while running sequences decode beside them."""

import copy
from collections import deque

from engine.scheduler import Budget, plan
from engine.sequence import Image, Sequence
from engine.types import SamplingParams

PREFIX, PAGE = 82, 16


def _seq(i: int, image: Image, prompt: int, admitted: bool = False, launched: int = 0) -> Sequence:
    seq = Sequence(id=i, prompt=list(range(3, 3 + prompt)), params=SamplingParams(max_tokens=40), image=image,
                   handle=None, capacity=40)
    if admitted:
        seq.slot, seq.prefilled, seq.launched = i, prompt, launched
    return seq


def _state(waiting, running, images) -> list:
    return [copy.deepcopy((s.prefilled, s.launched, s.slot, s.pages, s.inflight, s.finalized)) for s in
            [*waiting, *running]] + [(img.launched, img.pages, img.inflight) for img in images] + [[s.id for s in waiting]]


def test_plan_changes_nothing_and_keeps_prompts_within_the_budget():
    encoded = Image(id=1, crops=None, tiling=(1, 1), launched=True, ready=True)
    fresh = [Image(id=2 + k, crops=None, tiling=(1, 1)) for k in range(3)]
    running = [_seq(10 + k, encoded, 5, admitted=True, launched=1 + k) for k in range(3)]  # decoding
    long_prompts = [_seq(20 + k, encoded, 50) for k in range(3)]  # on an encoded image: prompt only
    new_images = [_seq(30 + k, img, 5) for k, img in enumerate(fresh)]
    waiting = deque(long_prompts + new_images)
    budget = Budget(free_pages=1000, free_slots=32, prefill_tokens=64, prefix_len=PREFIX, prefix_pages=6)
    before = _state(waiting, running, [encoded, *fresh])

    step = plan(waiting, running, fresh, budget, PAGE)
    again = plan(waiting, running, fresh, budget, PAGE)

    assert _state(waiting, running, [encoded, *fresh]) == before  # pure: nothing it was given changed
    assert [(c.seq.id, c.start, c.length) for c in again.prefills] == [(c.seq.id, c.start, c.length)
                                                                       for c in step.prefills]
    assert step.decodes == running  # running sequences decode in every step, prefills or not
    assert sum(c.length for c in step.prefills) <= budget.prefill_tokens
    assert [(c.seq.id, c.start, c.length) for c in step.prefills][:2] == [(20, 0, 50), (21, 0, 14)]  # chunked
    assert not step.images  # no room left in the budget for an image prefix (82 tokens)


def test_an_image_prefix_is_never_cut_and_one_goes_even_over_the_budget():
    """Moondream's prefix attends both ways within itself: it cannot be chunked. A step takes one
    whole even where it is more than the budget (Moondream 2's 730 against 512), no more."""
    fresh = [Image(id=2 + k, crops=None, tiling=(1, 1)) for k in range(3)]
    waiting = deque(_seq(30 + k, img, 5) for k, img in enumerate(fresh))
    budget = Budget(free_pages=1000, free_slots=32, prefill_tokens=16, prefix_len=PREFIX, prefix_pages=6)
    step = plan(waiting, [], fresh, budget, PAGE)
    assert step.images == fresh[:1] and [s.id for s in step.admit] == [30]
    assert not step.prefills  # the prefix is the step's one unit over the budget: its prompt waits
    roomy = Budget(free_pages=1000, free_slots=32, prefill_tokens=2 * PREFIX + 10, prefix_len=PREFIX, prefix_pages=6)
    assert plan(waiting, [], fresh, roomy, PAGE).images == fresh[:2]


def test_a_request_short_of_pages_keeps_its_place_before_smaller_ones_on_encoded_images():
    """FIFO within a priority: requests behind one that lacks pages wait for it. Let smaller ones
    past, a request with a long answer limit could wait for ever while short ones kept coming."""
    encoded = Image(id=1, crops=None, tiling=(1, 1), launched=True, ready=True)
    big, small = _seq(1, encoded, 5), _seq(2, encoded, 5)
    small.capacity = 2
    budget = Budget(free_pages=2, free_slots=8, prefill_tokens=512, prefix_len=PREFIX, prefix_pages=6)
    assert plan(deque([big, small]), [], [], budget, PAGE).admit == []
    assert plan(deque([small, big]), [], [], budget, PAGE).admit == [small]


def test_draft_rows_stop_one_short_of_the_capacity():
    """A sequence's rows never run past the last position its pages hold (the last answer token is
    never fed back): with 3 of 5 tokens launched, one draft row beside the decode, not two."""
    encoded = Image(id=1, crops=None, tiling=(1, 1), launched=True, ready=True)
    seq = _seq(1, encoded, 5, admitted=True, launched=3)
    seq.capacity = 5
    seq.set_draft([10, 11, 12, 13, 14], eos=0)
    for t in (10, 11, 12):
        seq.keep(t)
    budget = Budget(free_pages=100, free_slots=8, prefill_tokens=512, prefix_len=PREFIX, prefix_pages=6,
                    max_draft=8, draft_rows=8)
    assert plan(deque(), [seq], [], budget, PAGE).drafts == [[13]]


def test_own_pages_cover_every_position_written_and_no_more():
    """The last answer token is never fed back: a sequence writes positions up to prefix + prompt
    + capacity - 2, and needs the pages from its prefix's partial one to that one."""
    from engine.scheduler import own_pages_for
    assert own_pages_for(5, 42, PREFIX, PAGE) == 3  # last position 127: pages 5, 6, 7
    assert own_pages_for(5, 43, PREFIX, PAGE) == 4  # 128 starts page 8
    assert own_pages_for(14, 1, 82, 16) == 1  # 95: the prefix's partial page 5 alone (copied)
    assert own_pages_for(15, 1, 80, 16) == 1  # 94 on page 5, past the prefix's 5 whole pages


def test_admission_takes_exactly_the_free_pages_and_never_one_more():
    encoded = Image(id=1, crops=None, tiling=(1, 1), launched=True, ready=True)
    seq = _seq(1, encoded, 5)  # capacity 40: 3 own pages
    fits = Budget(free_pages=3, free_slots=8, prefill_tokens=512, prefix_len=PREFIX, prefix_pages=6)
    assert plan(deque([seq]), [], [], fits, PAGE).admit == [seq]
    short = Budget(free_pages=2, free_slots=8, prefill_tokens=512, prefix_len=PREFIX, prefix_pages=6)
    assert plan(deque([seq]), [], [], short, PAGE).admit == []
    # a new image's prefix pages count too
    fresh = Image(id=2, crops=None, tiling=(1, 1))
    other = _seq(2, fresh, 5)
    assert plan(deque([other]), [], [fresh], Budget(9, 8, 512, PREFIX, 6), PAGE).admit == [other]
    assert plan(deque([other]), [], [fresh], Budget(8, 8, 512, PREFIX, 6), PAGE).admit == []
    # two requests: the second goes only if both fit together
    a, b = _seq(3, encoded, 5), _seq(4, encoded, 5)
    assert plan(deque([a, b]), [], [], Budget(6, 8, 512, PREFIX, 6), PAGE).admit == [a, b]
    assert plan(deque([a, b]), [], [], Budget(5, 8, 512, PREFIX, 6), PAGE).admit == [a]
    assert plan(deque([a, b]), [], [], Budget(100, 1, 512, PREFIX, 6), PAGE).admit == [a]  # one slot


def test_the_lower_priority_turn_goes_first_when_its_pages_are_exactly_free():
    encoded = Image(id=1, crops=None, tiling=(1, 1), launched=True, ready=True)
    high, low = _seq(1, encoded, 5), _seq(2, encoded, 5)
    high.priority, high.capacity = 1, 120  # more pages than are free: it waits
    budget = Budget(free_pages=3, free_slots=8, prefill_tokens=512, prefix_len=PREFIX, prefix_pages=6)
    assert plan(deque([high, low]), [], [], budget, PAGE).admit == []  # strict priority: the first waits
    assert plan(deque([high, low]), [], [], budget, PAGE, first=low).admit == [low]


def test_a_request_on_a_new_image_short_of_pages_holds_back_later_new_images():
    """Later requests on encoded images go past it (their ends free pages); later new images do not
    (they would take the pages it waits for)."""
    big_img, small_img = Image(id=1, crops=None, tiling=(1, 1)), Image(id=2, crops=None, tiling=(1, 1))
    encoded = Image(id=3, crops=None, tiling=(1, 1), launched=True, ready=True)
    big, small, on_encoded = _seq(1, big_img, 5), _seq(2, small_img, 5), _seq(3, encoded, 5)
    big.capacity = 120
    small.capacity = on_encoded.capacity = 2
    budget = Budget(free_pages=8, free_slots=8, prefill_tokens=512, prefix_len=PREFIX, prefix_pages=6)
    step = plan(deque([big, small, on_encoded]), [], [big_img, small_img], budget, PAGE)
    assert step.admit == [on_encoded] and step.images == []


def test_images_encoded_ahead_wait_for_waiting_requests_and_leave_the_reserve():
    ahead = Image(id=1, crops=None, tiling=(1, 1))  # encode_image: held by its ImageRef
    encoded = Image(id=2, crops=None, tiling=(1, 1), launched=True, ready=True)
    budget = Budget(free_pages=10, free_slots=8, prefill_tokens=512, prefix_len=PREFIX, prefix_pages=6,
                    reserve_pages=4)
    assert plan(deque(), [], [ahead], budget, PAGE).images == [ahead]
    tight = Budget(free_pages=9, free_slots=8, prefill_tokens=512, prefix_len=PREFIX, prefix_pages=6,
                   reserve_pages=4)
    assert plan(deque(), [], [ahead], tight, PAGE).images == []  # the reserve stays free
    waiting = _seq(1, encoded, 5)
    waiting.capacity = 200  # more than is free: it waits, and the image does not take its pages
    assert plan(deque([waiting]), [], [ahead], budget, PAGE).images == []
