"""The registration report: which layer, tag and block each parameter got."""

from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

from ..._tracing.layer_data import LayerSpec


_UNUSED_NOTE = (
    "(origin `unused`: the registered losses do not depend on the parameter, which is frozen or "
    "unused; it needs no curvature, and its zero block is no fallback)"
)


class Registration(NamedTuple):
    """How one parameter is approximated: its layer tag, the block class, who registered it, and,
    for a layer inside `jax.lax.scan`, how (`"stacked xN"`: one slice of stacked parameters per
    step; `"repeated xN"`: the same parameters at every step; `""` otherwise)."""

    tag: str
    block: str
    origin: str
    scan: str = ""


def scan_use(spec: LayerSpec) -> str:
    if spec.stack_size is not None:
        return f"stacked x{spec.stack_size}"
    if spec.repeat_size is not None:
        return f"repeated x{spec.repeat_size}"
    return ""


class Registrations(Mapping[str, Registration]):
    """A read-only map from parameter path to its `Registration`; `str()` prints a table (with
    a note saying what origin `unused` means when a parameter has it)."""

    def __init__(self, entries: Sequence[tuple[str, Registration]]):
        """**Arguments:**

        - `entries`: `(parameter path, Registration)` pairs, in parameter-leaf order.
        """
        self._entries = dict(entries)

    def __getitem__(self, path: str) -> Registration:
        return self._entries[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registrations({self._entries!r})"

    def __str__(self) -> str:
        header = ("parameter", "tag", "block", "origin", "scan")
        rows = [header] + [(path, *reg) for path, reg in self._entries.items()]
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if any(reg.origin == "unused" for reg in self._entries.values()):
            lines.append(_UNUSED_NOTE)
        return "\n".join(lines)
