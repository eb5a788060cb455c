"""Runs the FermiNet-style example of `docs/migrating.md` (through `eqx_kfac.kfac_jax`) and checks
what the page says of it and of the drop-in's names."""

import re

import numpy as np
import pytest

from doc_pages import DOCS, run_page

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)


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


def _paragraph(start: str) -> str:
    text = (DOCS / "migrating.md").read_text()
    begin = text.index(start)
    return text[begin:text.index("\n\n", begin)]


def _names(text: str) -> list[str]:
    return re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)`", text)


def test_the_drop_in_names_are_the_pages():
    """The names the page says `kfac_jax.utils` has are there; the ones it says are not
    provided are absent; the keywords it says are refused or ignored are the optimizer's."""
    import eqx_kfac.kfac_jax as kfac_jax
    from eqx_kfac.kfac_jax._keywords import IGNORED, REFUSED

    utils_row = next(line for line in (DOCS / "migrating.md").read_text().splitlines() if line.startswith("| `kfac_jax.utils` |"))
    listed = _names(utils_row.split("|")[2])
    assert len(listed) > 30 and [n for n in listed if not hasattr(kfac_jax.utils, n)] == []
    missing = _names(_paragraph("Not provided:").split("(")[0]) + ["HAIKU_BIASES", "LayerData"]
    assert [n for n in missing if hasattr(kfac_jax, n)] == []
    refused = set(_names(_paragraph("`kfac_jax.Optimizer`'s keywords that map onto no part"))) & set(REFUSED)
    assert refused == set(REFUSED)
    ignored = set(_names(_paragraph("Accepted and ignored:"))) & set(IGNORED)
    assert ignored == set(IGNORED)
