"""A long benchmark's finished work, kept on disk so that a run cut short resumes where it stopped.

A `Journal` is a JSON-lines file of `(key, value)` entries: a script records each piece of work as
it finishes (a calibration, a round of runs) under a key that says what was asked (the settings
that change the result included), and before starting a piece looks it up. Run the same command
with the same `--journal` again and it skips what is there and does the rest. Entries are appended
and flushed one by one, so a kill loses at most the piece under way. `record_to_json` and
`record_from_json` carry a `Run` (without its model and state) through JSON.
"""

import dataclasses
import json
import os
from typing import Any

import numpy as np

from .record import Run
from .staging import FirstCall


class Journal:
    """A JSON-lines file of finished work, keyed by what was asked (`None`: keeps nothing).

    **Arguments:**

    - `path`: the file; read when it exists, appended to by `put`.
    """

    def __init__(self, path: str | None):
        self.path = path
        self.entries: dict[str, Any] = {}
        if path is not None and os.path.exists(path):
            with open(path) as file:
                for number, line in enumerate(file, 1):
                    if not line.strip():
                        continue
                    try:
                        entry = json.loads(line)
                    except json.JSONDecodeError:
                        # A line cut short by a kill: the piece it recorded is done again.
                        print(f"{path}:{number}: an unfinished entry, ignored", flush=True)
                        continue
                    self.entries[entry["key"]] = entry["value"]

    @staticmethod
    def key(**asked: Any) -> str:
        """The key of a piece of work: its settings as canonical JSON."""
        return json.dumps(asked, sort_keys=True)

    def get(self, key: str) -> Any | None:
        """The value recorded under `key`, or `None`."""
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        """Records `value` under `key` (JSON types only), on disk before returning."""
        self.entries[key] = value
        if self.path is None:
            return
        with open(self.path, "a") as file:
            file.write(json.dumps(dict(key=key, value=value)) + "\n")
            file.flush()
            os.fsync(file.fileno())


def record_to_json(run: Run) -> dict[str, Any]:
    """`run` as JSON types (its `model` and `state` left out)."""
    return dict(
        problem=run.problem, method=run.method, learning_rate=run.learning_rate, seed=run.seed,
        losses=run.losses.tolist(), times=run.times.tolist(), batch_times=run.batch_times.tolist(),
        first_call=dataclasses.asdict(run.first_call), stats={k: v.tolist() for k, v in run.stats.items()},
    )


def record_from_json(data: dict[str, Any]) -> Run:
    """The `Run` that `record_to_json` wrote (without a model or state)."""
    arrays = {k: np.asarray(data[k], dtype=float) for k in ("losses", "times", "batch_times")}
    return Run(
        data["problem"], data["method"], data["learning_rate"], data["seed"], **arrays,
        first_call=FirstCall(**data["first_call"]),
        stats={k: np.asarray(v) for k, v in data["stats"].items()},
    )
