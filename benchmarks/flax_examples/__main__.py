"""`python -m benchmarks.flax_examples`: see the package's docstring."""

import sys

from .run import main

sys.exit(main())
