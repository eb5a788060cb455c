"""Shared helper of the tests that run a docs page's examples."""

import linecache
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
    text = page.read_text()
    found = list(re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL))
    assert len(found) == blocks
    # Each block on its own lines of the page (the prose blanked), so that tracebacks name the
    # page's lines; the code goes in `linecache` under the page's path, so that
    # `inspect.getsource` (Hypothesis calls it on a test function) reads the code, not the page
    # (Python 3.12's tokenizer raises on the prose: "unterminated string literal").
    lines = [""] * text.count("\n")
    for block in found:
        first = text.count("\n", 0, block.start(1))
        lines[first : first + block.group(1).count("\n")] = block.group(1).splitlines()
    source = "".join(line + "\n" for line in lines)
    linecache.cache[str(page)] = (len(source), None, source.splitlines(True), str(page))
    namespace: dict = {"__name__": page.stem + "_example"}
    exec(compile(source, str(page), "exec"), namespace)
    return namespace
