"""Runs the FermiNet-style example of `docs/migrating.md` and checks what the page says of it."""

import re

import numpy as np
import pytest

from doc_pages import DOCS, run_page


@pytest.fixture(scope="module")
def page():
    """The namespace after executing every Python block of the page, in order."""
    return run_page("migrating.md", blocks=1)


def test_registrations_are_the_pages(page):
    # The optimizer was built with on_unmatched="error": no parameter fell back to a generic block.
    (printed,) = re.findall(r"```text\n(.*?)\n```", (DOCS / "migrating.md").read_text(), flags=re.DOTALL)
    estimator = page["optimizer"].estimators((page["params"], page["walkers"]))[0]
    assert str(estimator.registrations()) == printed


def test_energy_decreases_toward_helium(page):
    # Helium's exact energy is -2.90372 Ha; 40 iterations from a random network get well on the way.
    energies = np.asarray(page["energies"])
    assert np.all(np.isfinite(energies))
    assert np.mean(energies[-10:]) < np.mean(energies[:10]) - 0.2
    assert np.mean(energies[-10:]) > -2.95
