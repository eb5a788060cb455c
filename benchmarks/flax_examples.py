"""Flax's examples trained with K-FAC: steps and seconds to the optimizer each example's config
tunes (issue 48). The examples, models and measurements are in `benchmarks/flax_suite`; see its
docstring and docs/flax_examples.md.

    python benchmarks/flax_examples.py                       # the seven examples, full budgets
    python benchmarks/flax_examples.py --quick --examples mnist vae   # a smoke run
    python benchmarks/flax_examples.py --plots docs/img      # also loss vs steps and vs seconds
"""

import sys

from benchmarks.flax_suite.run import main

if __name__ == "__main__":
    sys.exit(main())
