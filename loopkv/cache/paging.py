"""A shared page pool: history pages handed to rows as they need them, not reserved for ``max_cache_len``
(docs/design.md, D8).

With ``LoopKVCache(..., pool_pages=N)`` every pool of the cache has ``N`` physical pages plus one *trash* page, and
a row's page-table entries point at the trash page until the row needs them. All cells of a row hold the same number
of tokens, so one allocator serves every pool: page ``p`` of row ``b`` is the same physical page in each cell's own
pool, and a ``share`` cell, which reads its source's table, allocates nothing. A row's pages are allocated on the
host before the write that needs them (prefill, a later turn, the eager decode step's one host check, or
:meth:`LoopKVCache.reserve` before a compiled step) and freed by :meth:`LoopKVCache.release` or ``reset()``.
"""

from __future__ import annotations

import heapq
import math

from loopkv.format import BITS, page_bytes


class PoolFull(ValueError):
    """The pool has fewer free pages than a request needs; nothing was allocated."""


class PagePool:
    """Host-side allocator of ``pages`` physical pages for ``rows`` rows of at most ``per_row`` pages each.

    ``trash`` (= ``pages``) is the index of the extra page that unallocated table entries point at. Pages are handed
    out lowest index first, so runs are reproducible."""

    def __init__(self, pages: int, rows: int, per_row: int):
        self.pages, self.per_row, self.trash = pages, per_row, pages
        self._free = list(range(pages))  # a heap: heappop gives the lowest free page
        self._held: list[list[int]] = [[] for _ in range(rows)]

    @property
    def in_use(self) -> int:
        return self.pages - len(self._free)

    def held(self, row: int) -> list[int]:
        """The physical pages of ``row``, in logical order."""
        return list(self._held[row])

    def ensure(self, wanted: dict[int, int]) -> list[tuple[int, int, int]]:
        """Give each row ``b`` at least ``wanted[b]`` pages (capped at ``per_row``); return the new
        ``(row, logical page, physical page)`` entries. All or nothing: :class:`PoolFull` leaves the pool as it was."""
        need = {b: min(n, self.per_row) - len(self._held[b]) for b, n in wanted.items()}
        need = {b: n for b, n in need.items() if n > 0}
        total = sum(need.values())
        if total > len(self._free):
            raise PoolFull(
                f"the page pool has {len(self._free)} of {self.pages} pages free and this step needs {total} more "
                f"(rows {sorted(need)}): release finished rows with cache.release(rows) or cache.reset(), or build "
                "the LoopKVCache with more pool_pages (loopkv.cache.paging.pool_pages_for sizes it from a budget)")
        entries = []
        for b, n in sorted(need.items()):
            for _ in range(n):
                page = heapq.heappop(self._free)
                entries.append((b, len(self._held[b]), page))
                self._held[b].append(page)
        return entries

    def release(self, row: int) -> list[int]:
        """Free every page of ``row``; return them."""
        pages, self._held[row] = self._held[row], []
        for page in pages:
            heapq.heappush(self._free, page)
        return pages


def pool_pages_for(plan, config, *, budget_bytes: int, max_batch_size: int, dtype_bytes: int = 2,
                   reserved_bytes: int = 0) -> int:
    """The ``pool_pages`` that fit a cache of ``plan`` for ``config``'s shape in ``budget_bytes``: ``reserved_bytes``
    (what the caller keeps beside the cache, e.g. a serving engine's prompt scratch) and the exact parts of
    ``max_batch_size`` rows (``loopkv.planning.bytes.exact_bytes``: every cache index's sink, window ring and lengths,
    padding included; every sliding layer's window) come first, the rest buys pages, each a page in every own pool
    (the planned cells' and the fixed exact slots' BF16 pools), one of them the trash page. The page tables (int32 per
    row and page of each own pool) are not counted. Raises ValueError when the budget does not cover the reserved
    bytes, the exact parts and one page."""
    from loopkv.cache.checks import model_layout, model_shape
    from loopkv.planning.bytes import exact_bytes

    _, _, kv_heads, head_dim = model_shape(config)
    exact = exact_bytes(config, rows=max_batch_size, dtype_bytes=dtype_bytes).total + reserved_bytes
    own = [o for o in plan.options if o != "share"] + ["bf16"] * len(model_layout(config).fixed("exact"))
    per_page = sum(page_bytes(BITS[o], kv_heads, head_dim, exact_bytes=dtype_bytes) for o in own)
    pages = math.floor((budget_bytes - exact - per_page) / per_page) if per_page else 0  # one page is the trash page
    if pages < 1:
        raise ValueError(
            f"a budget of {budget_bytes / 2**30:.3f} GiB does not cover {max_batch_size} rows' exact sink and window "
            f"({(exact - reserved_bytes) / 2**30:.3f} GiB), {reserved_bytes / 2**30:.3f} GiB reserved beside them and "
            f"one page ({per_page / 2**20:.3f} MiB): raise the budget or lower max_batch_size")
    return pages
