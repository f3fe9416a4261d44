"""Bookkeeping of the paged KV pool: which pages are free, who holds each page. No torch here.

Pages are reference counted: an image prefix's pages are held once by the image and once by
each sequence that reads them; a sequence's own pages are held by it alone. A page returns to
the free list when its count reaches zero, exactly once; releasing a free page is a bug and
raises.
"""

from __future__ import annotations


class OutOfPages(Exception):
    """Not enough free pages for an allocation (the scheduler checks before it asks)."""


class PagePool:
    def __init__(self, n_pages: int, page_size: int):
        self.n_pages = n_pages
        self.page_size = page_size
        self._refs = [0] * n_pages
        # Pop from the end: low page ids first, which keeps the working set compact.
        self._free = list(range(n_pages - 1, -1, -1))

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise AssertionError(f"incref of free page {p}")
            self._refs[p] += 1

    def decref(self, pages: list[int]) -> int:
        """Drop one reference to each page; return how many pages became free."""
        freed = 0
        for p in pages:
            if self._refs[p] <= 0:
                raise AssertionError(f"page {p} released twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def refcount(self, page: int) -> int:
        return self._refs[page]
