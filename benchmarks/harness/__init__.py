"""The benchmark harness: one problem type, one data loader, one K-FAC factory, one training loop,
one run record and one report, shared by every script in `benchmarks/`.

A benchmark builds `Problem`s (or takes them from `benchmarks.model_zoo`), trains them with
`Method`s through `train`/`run_round`, and reports the `Run`s grouped into `Outcome`s:

```python
import jax
from benchmarks.harness import Method, Outcome, report, run_round
from benchmarks.model_zoo import PROBLEMS

problem = PROBLEMS["cnn"](jax.random.key(0))
runs = run_round(problem, [Method("kfac"), Method("adam", 3e-3)], steps=100)
outcome = Outcome("cnn", 100, {r.method: [r] for r in runs}, {r.method: [r] for r in runs})
print(report.table([outcome]))
```
"""

from . import ladder as ladder, report as report
from .data import (
    digit_batches as digit_batches,
    digits as digits,
    minibatches as minibatches,
    stdlib_text as stdlib_text,
    topics_text as topics_text,
    upsampled_digits as upsampled_digits,
)
from .loop import first_call as first_call, run_round as run_round, train as train
from .methods import (
    KFAC_METHODS as KFAC_METHODS,
    KFAC_OPTAX as KFAC_OPTAX,
    OPTAX as OPTAX,
    RECOMMENDED_KFAC_JAX_KEYWORDS as RECOMMENDED_KFAC_JAX_KEYWORDS,
    Method as Method,
    make_optimizer as make_optimizer,
    make_step as make_step,
    psgd_error as psgd_error,
    usable as usable,
)
from .outcome import Outcome as Outcome
from .problem import Problem as Problem, full_batch as full_batch
from .record import WINDOW as WINDOW, Reach as Reach, Run as Run, best as best
from .registration import registration_summary as registration_summary
from .staging import (
    CompileTimes as CompileTimes,
    FirstCall as FirstCall,
    call_in_stages as call_in_stages,
    compile_in_stages as compile_in_stages,
)
