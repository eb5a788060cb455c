"""The Equinox-examples benchmark (benchmarks/examples.py) on its smallest example, a few steps.

Wall time is never asserted (benchmarks are not tests). Checked: K-FAC registers the layers of the
RNN (its bias a separate array) and of the stateful model with structured blocks, leaving generic
only the spectrally normalised weight; the command line trains an example with K-FAC's two forms
and the notebook's optimizer and writes its tables; the U-Net table marks a first call the timeout
stopped. The benchmark prints every example's registration (the ViT leaves its class token
generic); tracing the larger models here would cost the suite half a minute.
"""

import jax
import pytest

from benchmarks import examples
from benchmarks.harness import registration_summary
from benchmarks.model_zoo.equinox_examples import EXAMPLES

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)

# The blocks K-FAC gives each example, and its parameters left in generic blocks: the stateful
# model's spectrally normalised weight (32 x 3) is read through the power iteration's division.
REGISTRATIONS = {
    "rnn": ("3 DenseTwoKroneckerFactored, 1 ScaleAndShiftDiagonal", 0),
    "stateful": ("2 DenseTwoKroneckerFactored, 1 NaiveDiagonal, 3 ScaleAndShiftDiagonal", 96),
}


@pytest.mark.parametrize("name", sorted(REGISTRATIONS))
def test_examples_register_their_layers(name):
    problem = EXAMPLES[name].problem(jax.random.key(0))
    assert registration_summary(problem) == REGISTRATIONS[name]


def test_command_line_end_to_end(tmp_path, monkeypatch, capsys):
    # In this process (the benchmark starts one per example), so that the output is captured.
    monkeypatch.setattr(examples, "run_in_subprocess", examples.run_example)
    save = tmp_path / "examples.md"
    examples.main(["--examples", "frozen_layer", "--steps", "3", "--save", str(save)])
    out = capsys.readouterr().out
    rows = [line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| frozen_layer |")]
    # The rows printed as the example ends, the results table and the first-call table, each with
    # K-FAC's two forms and the notebook's SGD; the registration row.
    assert rows.count("kfac") == rows.count("recipe") == rows.count("sgd") == 3
    assert rows[-1] == "1 DenseTwoKroneckerFactored"
    saved = save.read_text()
    assert saved.startswith("| problem | method |") and "| setup s | trace s | lower s | compile s |" in saved


def test_unet_table_marks_a_stopped_first_call():
    table = examples.unet_table({
        "adabelief": {"setup": 0.0, "trace": 0.5, "lower": 0.25, "compile": 2.0, "run": 0.25},
        "kfac": {"setup": 3.0, "trace": 40.0, "running": 557.0},
    })
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]
    assert rows[0] == ["adabelief", "0.00", "0.50", "0.25", "2.00", "0.25", "3.0"]
    assert rows[1] == ["kfac", "3.00", "40.00", "> 557", "-", "-", "> 600.0"]
