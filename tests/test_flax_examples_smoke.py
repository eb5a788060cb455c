"""Smoke test of `benchmarks/flax_examples.py` (`--quick`): one example (the suite's time) trains with both K-FAC forms,
`Optimizer` and `kfac_optax` with a warm start (`--warm-start`) and their config's optimizer, and the record holds what the docs page's
table is made of."""

import json

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("sklearn")

from benchmarks.flax_suite import run  # noqa: E402

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)

STEPS = 3
WARM = 2


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    path = tmp_path_factory.mktemp("flax_examples") / "quick.json"
    argv = ["--quick", "--examples", "mnist", "--steps", str(STEPS), "--warm-start", str(WARM), "--save", str(path)]
    assert run.main(argv) == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", ["mnist"])
def test_every_method_trains_from_the_same_start(record, name):
    example = record["examples"][name]
    methods = example["methods"]
    assert set(methods) == {
        "Optimizer", "Optimizer+WarmStart", "kfac_optax", "kfac_optax+WarmStart", example["baseline"]
    }
    for method in methods.values():
        assert len(method["losses"]) == STEPS and np.all(np.isfinite(method["losses"]))
        assert method["ms_per_step"] > 0 and method["first_call_s"] > 0
    # Step 0's loss is the initial parameters' loss on the first batch (and, for the VAE, the
    # step's key; `Optimizer` draws its loss's key from it, the optax steps pass it on).
    same = ["kfac_optax", "kfac_optax+WarmStart", example["baseline"]]
    same += ["Optimizer", "Optimizer+WarmStart"] if name == "mnist" else []
    firsts = [methods[m]["losses"][0] for m in same]
    np.testing.assert_allclose(firsts, firsts[0], rtol=1e-3)
    # The target is the baseline's final loss: its mean over the last (here: all) steps.
    np.testing.assert_allclose(example["target"], np.mean(methods[example["baseline"]]["losses"]), rtol=1e-3)
    assert len(methods["Optimizer"]["damping"]) == len(methods["Optimizer"]["learning_rate"]) == STEPS
    # The warm start's steps have no K-FAC statistics; K-FAC's step follows them.
    rates = methods["Optimizer+WarmStart"]["learning_rate"]
    assert rates[:WARM] == [None] * WARM and rates[WARM] is not None


def test_table_has_a_row_per_example(record):
    steps_table, _, trajectories = record["table"].split("\n\n")[:3]
    for text in (steps_table, trajectories):
        assert [row.split(" | ")[0] for row in text.splitlines()[2:]] == ["| mnist"]


def test_ogbg_without_jraph_is_skipped_with_the_install_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None)
    assert run.main(["--quick", "--examples", "ogbg", "--save", str(tmp_path / "none.json")]) == 0
    assert run.MISSING_JRAPH in capsys.readouterr().out
    assert json.loads((tmp_path / "none.json").read_text())["examples"] == {}


def _fake_run(rate, final):
    return run.Run(problem="p", method="sgd", learning_rate=rate, seed=0, losses=np.full(10, final),
                   times=np.ones(9), batch_times=np.ones(9), first_call=None, stats={})


@pytest.mark.parametrize("losses, rates", [
    ({1 / 3: 3.0, 1.0: 2.0, 3.0: 1.0, 9.0: 0.5, 27.0: 0.4}, [1 / 3, 1, 3, 9, 27]),  # two rungs, then the cap
    ({1 / 3: 3.0, 1.0: 2.0, 3.0: 1.0, 9.0: 1.5}, [1 / 3, 1, 3, 9]),  # one rung: the best is inside
    ({1 / 9: 2.0, 1 / 3: 1.0, 1.0: 2.0, 3.0: 3.0}, [1 / 9, 1 / 3, 1, 3]),  # downwards
    ({1 / 3: 2.0, 1.0: 1.0, 3.0: 2.0}, [1 / 3, 1, 3]),  # already inside: unchanged
])
def test_the_ladder_grows_past_an_end_that_holds_its_best_run(monkeypatch, losses, rates):
    trained = []

    def one_round(problem, methods, steps):
        trained.append(methods[0].learning_rate)
        return [_fake_run(methods[0].learning_rate, losses[methods[0].learning_rate])]

    monkeypatch.setattr(run, "run_round", one_round)
    grid = [_fake_run(r, losses[r]) for r in (1.0, 1 / 3, 3.0)]
    out = run.extended(None, run.Method("sgd", 1.0), grid, 10)
    np.testing.assert_allclose([r.learning_rate for r in out], rates)
    assert len(trained) == len(rates) - 3
