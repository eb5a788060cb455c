"""The models of Equinox's example notebooks, rebuilt from their published architectures on data
that ships with scikit-learn or is generated (`benchmarks/examples.py`, docs/examples.md).

`EXAMPLES` maps each example to its module; each module has `problem(key) -> Problem` and
`NOTEBOOK_OPTIMIZER`, the `Method` its notebook trains with (`unet` uses `diffusion`'s).
"""

from . import diffusion, frozen_layer, mnist_cnn, rnn, stateful, unet, vit

EXAMPLES = {
    "mnist_cnn": mnist_cnn,
    "vit": vit,
    "diffusion_mixer": diffusion,
    "rnn": rnn,
    "stateful": stateful,
    "frozen_layer": frozen_layer,
}
