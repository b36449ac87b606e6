"""Host-side page allocation for the paged KV caches (target and drafter share one block table per request).

A request at committed length n with a block of up to L+1 tokens in flight needs ⌈(n + L + 1) / page_size⌉
pages. Pages come from a free list; `free` returns a request's pages at once (finish, cancel, preemption).
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, max_pages_per_request: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages=}, {page_size=}")
        self.num_pages, self.page_size, self.max_pages = num_pages, page_size, max_pages_per_request
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.owned: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_hold(self, request_id: str, tokens: int) -> bool:
        """Whether the request could grow to `tokens` cache positions now."""
        need = self.pages_for(tokens) - len(self.owned.get(request_id, ()))
        return need <= self.num_free and self.pages_for(tokens) <= self.max_pages

    def ensure(self, request_id: str, tokens: int) -> bool:
        """Grows the request's pages to cover `tokens` positions; False (and no change) if the pool is short."""
        if not self.can_hold(request_id, tokens):
            return False
        pages = self.owned.setdefault(request_id, [])
        while len(pages) < self.pages_for(tokens):
            pages.append(self._free.pop())
        return True

    def free(self, request_id: str) -> int:
        pages = self.owned.pop(request_id, [])
        self._free.extend(reversed(pages))
        return len(pages)

    def table_row(self, request_id: str, sentinel: int) -> list[int]:
        """The request's block-table row, padded with `sentinel` (the pool size: writes there are dropped)."""
        pages = self.owned.get(request_id, [])
        return pages + [sentinel] * (self.max_pages - len(pages))
