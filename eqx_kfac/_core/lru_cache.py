"""A bounded least-recently-used cache for what is built once per function and argument signature.

The tracer caches traced functions, the optimizer and the optax transformation their estimators:
building them traces the user's function, which must not happen again at every step.
"""

import collections
from collections.abc import Callable, Hashable
from typing import Any


class LRUCache:
    """At most `maxsize` values, each built once per key; the least recently used goes first.

    A key that cannot be hashed (a static argument that is not hashable) is never cached: its
    value is built at every lookup.
    """

    def __init__(self, maxsize: int):
        """**Arguments:**

        - `maxsize`: the number of values kept.
        """
        self._maxsize = maxsize
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value for `key`, built with `build()` when it is not cached.

        **Arguments:**

        - `key`: the lookup key.
        - `build`: makes the value.

        **Returns:**

        The cached or newly built value.
        """
        try:
            hash(key)
        except TypeError:
            return build()
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        value = build()
        self._entries[key] = value
        if len(self._entries) > self._maxsize:
            self._entries.popitem(last=False)
        return value
