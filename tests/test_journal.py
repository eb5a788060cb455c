"""The benchmarks' journal (benchmarks/harness/journal.py): what it keeps is what it gives back,
across processes (a new `Journal` on the same file), and a line cut short by a kill is skipped."""

import dataclasses

import numpy as np

from benchmarks.harness import FirstCall, Run
from benchmarks.harness.journal import Journal, record_from_json, record_to_json


def test_a_run_comes_back_as_it_was_recorded():
    run = Run("gpt", "kfac_muon", 0.03, 2, np.array([3.0, 2.5, 2.25]), np.array([0.125, 0.25]),
              np.array([0.001, 0.002]), FirstCall(1.0, 2.0, 0.5, 4.0, 0.25),
              stats={"damping": np.array([1e-3, 1e-3, 2e-3])}, model="left out", state="left out")
    back = record_from_json(record_to_json(run))
    for field in dataclasses.fields(Run):
        value, expected = getattr(back, field.name), getattr(run, field.name)
        if field.name in ("model", "state"):
            assert value is None
        elif field.name == "stats":
            assert value.keys() == expected.keys()
            np.testing.assert_array_equal(value["damping"], expected["damping"])
        elif isinstance(expected, np.ndarray):
            np.testing.assert_array_equal(value, expected)
        else:
            assert value == expected


def test_entries_survive_a_new_process_and_a_cut_line_is_skipped(tmp_path, capsys):
    path = str(tmp_path / "journal.jsonl")
    journal = Journal(path)
    first, second = Journal.key(round=0, rates=[0.1]), Journal.key(rates=[0.1], round=1)
    assert Journal.key(rates=[0.1], round=0) == first  # the order of the settings does not matter
    journal.put(first, {"loss": [1.5, 1.25]})
    journal.put(second, [1, 2])
    with open(path, "a") as file:
        file.write('{"key": "{\\"round\\": 2}", "val')  # killed while writing
    reopened = Journal(path)
    assert reopened.get(first) == {"loss": [1.5, 1.25]} and reopened.get(second) == [1, 2]
    assert reopened.get(Journal.key(round=2)) is None
    assert f"{path}:3: an unfinished entry, ignored" in capsys.readouterr().out


def test_without_a_file_the_entries_are_kept_in_memory():
    journal = Journal(None)
    journal.put("k", 1)
    assert journal.get("k") == 1 and journal.get("other") is None
