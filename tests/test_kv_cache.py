"""The KV page pool's bookkeeping: reference counts, each page freed exactly once."""

import pytest

from engine.kv_cache import OutOfPages, PagePool


def test_pages_are_shared_by_count_and_freed_exactly_once():
    pool = PagePool(n_pages=6, page_size=4)
    prefix = pool.allocate(2)
    assert (pool.n_used, pool.n_free) == (2, 4)
    pool.incref(prefix)  # a sequence reads the image's prefix
    assert [pool.refcount(p) for p in prefix] == [2, 2]
    assert pool.decref(prefix) == 0 and pool.n_used == 2  # the image lets go: the sequence still reads it
    assert pool.decref(prefix) == 2 and (pool.n_used, pool.n_free) == (0, 6)
    with pytest.raises(AssertionError, match="released twice"):
        pool.decref(prefix[:1])
    with pytest.raises(AssertionError, match="free page"):
        pool.incref(prefix[1:])  # a free page is nobody's to share
    assert pool.n_free == 6 and pool.refcount(prefix[0]) == 0


def test_an_allocation_fits_exactly_or_is_refused_whole():
    pool = PagePool(n_pages=5, page_size=4)
    first = pool.allocate(2)
    with pytest.raises(OutOfPages):
        pool.allocate(4)
    assert pool.n_free == 3  # a refused allocation takes nothing
    rest = pool.allocate(3)  # exactly what is left
    assert sorted(first + rest) == list(range(5)) and pool.n_free == 0 and pool.n_used == 5
    pool.decref(first)
    assert sorted(pool.allocate(2)) == sorted(first)  # freed pages are reused
