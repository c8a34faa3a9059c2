"""Rendered plot PNGs kept between requests: a plot is drawn again only when its logs change."""

from __future__ import annotations

import threading
from collections import OrderedDict


class PlotCache:
    """Rendered PNGs by (run, plot, options, versions of the logs it draws): new data, new PNG."""

    def __init__(self, size: int = 64):
        self.size = size
        self._items: OrderedDict[tuple, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.renders = 0

    def get_or_render(self, key: tuple, render) -> bytes:
        with self._lock:
            png = self._items.get(key)
            if png is not None:
                self._items.move_to_end(key)
                return png
        png = render()
        with self._lock:
            self.renders += 1
            self._items[key] = png
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return png
