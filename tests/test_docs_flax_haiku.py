"""Runs the examples of `docs/flax_haiku.md` and checks what the page says of them."""

import re

import pytest

from doc_pages import DOCS, run_page


@pytest.fixture(scope="module")
def page():
    """The namespace after executing every Python block of the page, in order."""
    return run_page("flax_haiku.md", blocks=3)


def test_linen_registrations_are_the_pages(page):
    # The optimizer was built with on_unmatched="error": no parameter fell back to a generic block.
    (printed,) = re.findall(r"```text\n(.*?)\n```", (DOCS / "flax_haiku.md").read_text(), flags=re.DOTALL)
    estimator = page["optimizer"].estimators((page["params"], page["batch_stats"], page["batch"]))[0]
    assert str(estimator.registrations()) == printed


def test_linen_trains(page):
    assert float(page["stats"]["loss"]) < 0.5 * float(page["first_loss"])


def test_nnx_trains(page):
    # kfac_optax's norm constraint (0.1) bounds its first steps.
    assert float(page["loss"]) < 0.8 * float(page["nnx_first_loss"])


def test_haiku_trains(page):
    assert float(page["hk_stats"]["loss"]) < 0.5 * float(page["hk_first_loss"])
