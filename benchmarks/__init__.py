"""The project's benchmarks: the main job (`run.py`), the studies beside it, and what they share.

- `benchmarks.harness`: the one benchmark harness (problems, data, methods, the training loop, the
  run record, reports).
- `benchmarks.model_zoo`: the models, written the idiomatic Equinox way (the tests use them too).
- The scripts (`run.py`, `alternatives.py`, `examples.py`, ...): each runs as
  `python benchmarks/<name>.py` or `python -m benchmarks.<name>` after `pip install -e .`
  (the editable install puts the repository's root on the path, see pyproject.toml).
"""
