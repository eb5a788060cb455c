"""Shared helper of the tests that run a docs page's examples."""

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def run_page(name: str, blocks: int) -> dict:
    """Executes every Python block of `docs/<name>`, in order, in one namespace.

    **Arguments:**

    - `name`: the page's file name, e.g. `"variants.md"`.
    - `blocks`: how many Python blocks the page must have (so that none is lost silently).

    **Returns:**

    The namespace after the last block.
    """
    page = DOCS / name
    code = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    assert len(code) == blocks
    namespace: dict = {"__name__": page.stem + "_example"}
    exec(compile("\n".join(code), str(page), "exec"), namespace)
    return namespace
