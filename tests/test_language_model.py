"""The language-model benchmark (benchmarks/language_model.py) and its model
(benchmarks/model_zoo/gpt.py): the model's registration and data, the per-method step budgets and
observation of `run_round`, the schedule, the bookkeeping of validation losses in seconds, the
step's memory, and a whole tiny run of the script."""

import json
import os
import pathlib
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac
from benchmarks import language_model as lm
from benchmarks.harness import FirstCall, Method, registration_summary, Run, run_round, stdlib_text, topics_text
from benchmarks.model_zoo import gpt, lm1b

TINY = dict(width=16, depth=1, heads=2, length=8, batch_size=4)


@pytest.fixture(scope="module")
def problem():
    return gpt.problem(jax.random.key(0), **TINY)


# The losses and their references in one compiled program each: run eagerly, every operation of
# the model was a program of its own (the GPT's test compiled 88 programs, now 1; lm1b's 147, now
# 79, most of them Flax's initialisation).
@eqx.filter_jit
def _gpt_losses(loss, model, batch):
    """`loss`, `gpt.mean_cross_entropy` and the mean cross-entropy written out, on `batch`."""
    logits = jax.vmap(model)(batch[:, :-1])
    by_hand = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], -1))
    return loss(model, batch), gpt.mean_cross_entropy(model, batch), by_hand


@eqx.filter_jit
def _lm1b_losses(loss, model, batch):
    """`loss`, `lm1b.mean_cross_entropy` and the mean cross-entropy written out, on `batch`."""
    logits = model.module.apply({"params": model.params}, batch)
    by_hand = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[..., None], -1))
    return loss(model, batch), lm1b.mean_cross_entropy(model, batch), by_hand


def test_every_parameter_of_the_untied_model_gets_a_structured_block(problem):
    kinds, generic = registration_summary(problem)
    assert generic == 0
    # Per block: the four attention projections and the MLP's two layers; and the head.
    assert "7 DenseTwoKroneckerFactored" in kinds and "2 EmbeddingKroneckerFactored" in kinds


def test_the_registered_loss_is_the_per_character_mean(problem):
    # `mean_over="all"` must make the registered loss's value the function's value: the check at
    # `init` compares them and warns otherwise.
    args = problem.first_args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_kfac.BlockDiagonalCurvature(problem.loss, args, on_unmatched="error")
    loss, mean, by_hand = _gpt_losses(problem.loss, *args)
    np.testing.assert_allclose(loss, by_hand, rtol=1e-10)
    np.testing.assert_allclose(mean, by_hand, rtol=1e-10)


def test_flax_lm1b_gets_structured_blocks_and_the_per_character_mean():
    lm1b_problem = lm1b.problem(jax.random.key(0), width=16, depth=1, length=8, batch_size=4)
    kinds, generic = registration_summary(lm1b_problem)
    assert generic == 0
    # Per block: the attention's four projections and the MLP's two layers; the head; nn.Embed.
    assert "7 DenseTwoKroneckerFactored" in kinds and "1 EmbeddingKroneckerFactored" in kinds, kinds
    args = lm1b_problem.first_args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_kfac.BlockDiagonalCurvature(lm1b_problem.loss, args, on_unmatched="error")
    model, batch = args
    assert batch.shape == (4, 8) and int(batch.min()) >= 1  # ids from 1: 0 is lm1b's padding
    loss, mean, by_hand = _lm1b_losses(lm1b_problem.loss, model, batch)
    np.testing.assert_allclose(loss, by_hand, rtol=1e-10)
    np.testing.assert_allclose(mean, by_hand, rtol=1e-10)
    # The validation windows are the GPT's (length + 1 ids predict length characters), shifted by one.
    np.testing.assert_array_equal(lm1b.validation_batch(9, count=3), gpt.validation_batch(8, count=3) + 1)


def test_the_stdlib_corpus_is_the_standard_librarys_sources_split_in_order():
    text = stdlib_text()
    os_source = pathlib.Path(os.__file__).read_text().encode("ascii", "replace").decode()
    assert os.__file__.endswith("os.py") and os_source in text
    # A class of the standard library's own tests (Lib/test/test_os.py), which are left out.
    # The 12 million characters' set and splits once each (each pass over them takes CPU seconds).
    characters = set(text)
    assert "class StatAttributeTests(unittest.TestCase)" not in text and characters <= {chr(i) for i in range(128)}
    assert gpt.vocabulary_size("stdlib") == len(characters)
    stdlib_problem = gpt.problem(jax.random.key(0), **TINY, corpus="stdlib")
    assert stdlib_problem.model.tokens.num_embeddings == len(characters)
    chars = sorted(characters)
    decode = lambda row: "".join(chars[i] for i in np.asarray(row))  # noqa: E731
    cut = int(len(text) * 0.9)
    train, held_out = text[:cut], text[cut:]
    batch = stdlib_problem.next_batch(stdlib_problem.model, 0, jax.random.key(3), None)
    assert batch.shape == (4, 9) and all(decode(row) in train for row in batch)
    validation = gpt.validation_batch(8, count=3, corpus="stdlib")
    assert all(decode(row) in held_out for row in validation)


def test_the_model_is_causal(problem):
    ids = jnp.arange(8) % gpt.vocabulary_size()
    changed = ids.at[5].set((ids[5] + 1) % gpt.vocabulary_size())
    model = eqx.filter_jit(problem.model)  # one program for both calls (eagerly: 51)
    before, after = model(ids), model(changed)
    np.testing.assert_allclose(before[:5], after[:5], rtol=1e-12)
    assert not np.allclose(before[5:], after[5:])


def test_batches_come_from_the_first_nine_tenths_and_validation_from_the_rest(problem):
    text = topics_text()
    chars = sorted(set(text))
    decode = lambda row: "".join(chars[i] for i in np.asarray(row))  # noqa: E731
    cut = int(len(text) * 0.9)
    batch = problem.next_batch(problem.model, 0, jax.random.key(3), None)
    assert batch.shape == (4, 9)
    for row in batch:
        assert decode(row) in text[:cut]
    validation = gpt.validation_batch(8, count=5)
    assert validation.shape == (5, 9)
    for row in validation:
        assert decode(row) in text[cut:]
    # The same key gives the same batch (every method of a seed sees the same batches).
    np.testing.assert_array_equal(batch, problem.next_batch(None, 7, jax.random.key(3), None))


def test_run_round_takes_a_step_budget_per_method_and_observes_every_step(problem):
    seen = []
    runs = run_round(problem, [Method("adamw", 1e-3), Method("sgd", 1e-2)], [2, 4],
                     observe=lambda index, step, model: seen.append((index, step)))
    assert [len(r.losses) for r in runs] == [2, 4]
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]
    with pytest.raises(ValueError, match="2 step budgets for 1 methods"):
        run_round(problem, [Method("sgd", 1e-2)], [2, 3])


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    schedule = lm.warmup_cosine(200)(0.01)
    assert float(schedule(0)) == 0.0
    np.testing.assert_allclose(schedule(10), 0.01, rtol=1e-12)
    np.testing.assert_allclose(schedule(5), 0.005, rtol=1e-12)
    np.testing.assert_allclose(schedule(200), 0.001, rtol=1e-12)
    assert lm.make_method("kfac", None, 100).schedule is None
    eigen = lm.make_method("eigen", 3e-3, 100)
    assert eigen.name == "recipe" and isinstance(eigen.options["direction"], eqx_kfac.EigenbasisAdam)
    # kfac_muon keeps the harness's periods (statistics every 10th step, refreshes every 50th).
    assert lm.make_method("kfac_muon", 0.03, 100).options == {}
    with pytest.raises(ValueError, match="adapted rate"):
        Method("kfac", None, schedule=lm.warmup_cosine(10))


def _trial(steps, evaluated, first_call=2.0, step_seconds=0.5):
    n = max(steps) + 1
    run = Run("gpt", "adamw", 1e-3, 0, np.ones(n), np.full(n - 1, step_seconds), np.zeros(n - 1),
              FirstCall(first_call, 0.0, 0.0, 0.0, 0.0))
    return lm.Trial("adamw", run, list(steps), list(evaluated))


def test_validation_losses_are_placed_in_seconds_after_their_step():
    trial = _trial([0, 4, 8], [3.0, 2.0, 1.5])
    # After step s: the first step at the median (0.5 s) and s more steps of 0.5 s, compiled;
    # from the first call, the first call's 2 s instead of the first step.
    np.testing.assert_allclose(trial.clock(True)[[0, 4, 8]], [0.5, 2.5, 4.5])
    np.testing.assert_allclose(trial.clock(False)[[0, 4, 8]], [2.0, 4.0, 6.0])
    assert trial.at(2.5, compiled=True) == 2.0 and trial.at(2.4, compiled=True) == 3.0
    assert trial.at(5.0, compiled=False) == 2.0 and np.isnan(trial.at(1.0, compiled=False))
    assert trial.reach(2.0, compiled=True) == 2.5 and trial.reach(1.6, compiled=False) == 6.0
    assert np.isnan(trial.reach(1.0, compiled=True)) and trial.final == 1.5


def test_summary_and_table_give_ratios_to_adamw():
    repeats = {"adamw": [_trial([0, 4, 8], [3.0, 2.0, 1.5])],
               "soap": [_trial([0, 4, 8], [3.0, 1.5, 1.0], first_call=1.0, step_seconds=1.0)]}
    # Both runs last 8 steps: AdamW 4.5 s compiled and 6 s from its first call, SOAP 9 s and 9 s.
    assert lm.common_seconds(repeats) == (4.5, 6.0)
    rows = lm.summarise(repeats, {"adamw": 2**20, "soap": 3 * 2**20})
    assert rows["soap"]["reach_compiled"] == 5.0 and rows["adamw"]["reach_compiled"] == 4.5
    # At 4.5 compiled seconds SOAP has only its step-0 loss (its step 4 ends at 5 s); at 6 s from
    # the first call it has its step-4 loss (5 s), AdamW its step-8 loss (6 s).
    assert rows["soap"]["compiled"] == 3.0 and rows["adamw"]["compiled"] == 1.5
    assert rows["soap"]["from_first_call"] == 1.5 and rows["adamw"]["from_first_call"] == 1.5
    text = lm.table(rows, 4.5, 6.0)
    assert "| soap | 0.001 | 9 | 1000 (2.00x) |" in text and "3.0 (3.00x) |" in text
    assert "val. loss at 4.5 s compiled | at 6.0 s from the first call" in text


def test_a_round_whose_steps_differ_from_their_calibration_is_named():
    # Steps after the second of 0.5 s (and no batch time) against calibrations of 0.5 s, 0.4 s
    # and 0.6 s: within 15%, 25% slower, 17% faster.
    repeats = {name: [_trial(range(9), [1.0] * 9)] for name in ("adamw", "soap", "muon")}
    lines = lm.calibration_drift({"adamw": 0.5, "soap": 0.4, "muon": 0.6}, repeats)
    assert len(lines) == 2
    assert lines[0].startswith("note: soap's steps took 500 ms, calibrated at 400 ms (+25%)")
    assert lines[1].startswith("note: muon's steps took 500 ms, calibrated at 600 ms (-17%)")


def test_step_memory_counts_the_parameters_and_the_optimizer_state(problem):
    params = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(problem.model, eqx.is_inexact_array)))
    sgd, adamw = (lm.step_memory(problem, name, 1e-3) for name in ("sgd", "adamw"))
    # AdamW's step takes two moments more than SGD's (its arguments alone grow by 2x the
    # parameters; its outputs too, though XLA may reuse temporaries for them).
    assert adamw >= 3 * params and adamw - sgd >= 2 * params


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)
def test_a_tiny_run_of_the_script_writes_its_table_and_curves_and_resumes_from_its_journal(
    tmp_path, capsys, monkeypatch
):
    path, journal = tmp_path / "lm.json", tmp_path / "journal.jsonl"
    # Two methods, one at its reference rate and one at a given rate. Muon (optax's) rather than
    # SOAP: its step compiles in a third of the time (the script compiles each method's step three
    # times: calibration, round, memory). `--seconds 0.05`: budgets at or near their floor of
    # `CALIBRATION_STEPS` steps (0.5 s gave AdamW 41 steps), each step's model still evaluated.
    args = ["--quick", "--methods", "adamw", "muon", "--seconds", "0.05", "--width", "16", "--depth",
            "1", "--length", "8", "--batch-size", "4", "--rates", "muon=0.002", "--save", str(path),
            "--journal", str(journal)]
    assert lm.main(args) == 0
    out = capsys.readouterr().out
    assert "| adamw | 0.001 |" in out and "| muon | 0.002 |" in out
    saved = json.loads(path.read_text())
    for name in ("adamw", "muon"):
        curve = saved["curves"][name][0]
        assert len(curve["validation"]) == len(curve["steps"]) >= 2
        assert np.all(np.diff(curve["compiled"]) > 0)
    # Run again: the calibration and the round come from the journal, nothing is trained, and the
    # table is the same.
    monkeypatch.setattr(lm, "run_round", lambda *a, **k: pytest.fail("trained again"))
    assert lm.main(args) == 0
    again = capsys.readouterr().out
    assert "seed 0: adamw, muon taken from the journal" in again
    table = lambda text: [line for line in text.splitlines() if line.startswith("| adamw") or line.startswith("| muon")]
    assert table(again) == table(out)
    assert json.loads(path.read_text())["curves"] == saved["curves"]


def test_the_calibration_covers_a_whole_refresh_period():
    assert lm.calibration_steps(lm.make_method("adamw", 1e-3, 10)) == lm.CALIBRATION_STEPS
    period = lm.KFAC_OPTAX["kfac_muon"]["inverse_update_period"]
    assert lm.calibration_steps(lm.make_method("kfac_muon", 0.03, 10)) == period + 2
    assert lm.calibration_steps(lm.make_method("eigen", 3e-3, 10)) == max(
        lm.CALIBRATION_STEPS, lm.KFAC_PERIODS["inverse_update_period"] + 2)


def test_given_rates_are_parsed_and_bad_ones_refused(capsys):
    assert lm.parse_args(["--rates", "muon=0.1", "soap=0.01"]).rates == {"muon": 0.1, "soap": 0.01}
    for argv, message in (
        (["--rates", "kfac=0.1"], "'kfac' is not one of the methods with a rate"),
        (["--rates", "muon=fast"], "write METHOD=RATE with a number, e.g. muon=0.01"),
        (["--methods", "adamw", "--rates", "muon=0.1"], "'muon' is not one of the methods with a rate"),
        # Zero is refused, not taken for "not given" (which would start a 4-hour run).
        (["--seconds", "0"], "--seconds must be positive, got 0"),
        (["--seeds", "0"], "--seeds must be at least 1, got 0"),
        (["--max-grid", "0"], "--max-grid is 1 (the reference rate) or at least 3"),
    ):
        with pytest.raises(SystemExit):
            lm.parse_args(argv)
        assert message in capsys.readouterr().err


def test_a_seed_that_never_reaches_the_target_counts_as_latest_not_as_unknown():
    # AdamW's target is the median of its finals, 1.5: seed 0 (final 1.6) never reaches it, the
    # others do at 4.5 s and 2.5 s compiled; the median over the three is 4.5 s, not NaN.
    repeats = {"adamw": [_trial([0, 4, 8], [3.0, 2.0, 1.6]), _trial([0, 4, 8], [3.0, 2.0, 1.5]),
                         _trial([0, 4, 8], [3.0, 1.4, 1.4])]}
    rows = lm.summarise(repeats, {"adamw": 2**20})
    assert rows["adamw"]["reach_compiled"] == 4.5
    # With two of three seeds never reaching a target, the median is "never" (NaN).
    repeats["soap"] = [_trial([0, 4, 8], [3.0, 2.0, 1.6]), _trial([0, 4, 8], [3.0, 2.0, 1.7]),
                       _trial([0, 4, 8], [3.0, 1.4, 1.4])]
    assert np.isnan(lm.summarise(repeats, {"adamw": 2**20, "soap": 2**20})["soap"]["reach_compiled"])

