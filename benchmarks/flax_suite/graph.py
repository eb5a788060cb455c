"""ogbg_molpcba's graph network and generated molecule-like graphs (needs jraph: `pip install
-e ".[flax-examples]"`).

The model is the example's `GraphConvNet`: node features embedded by a `Dense`, message-passing
steps of `jraph.GraphConvolution` (self edges added, an MLP of `Dense` + ReLU layers on the
nodes) with skip connections and a `LayerNorm`, mean pooling per graph and a `Dense` to one logit
per task. The graphs are generated: a random tree of 6-16 atoms (9 atom types, one-hot) with a
few extra bonds, as both directed edges (the input pipeline's `add_undirected_edges`); each task
is a binary property of the graph (an atom type present, a bond between two types, a ring, more
than 11 atoms), some labels missing (NaN, masked as OGB's are). Batches are padded to fixed sizes
with `jraph.pad_with_graphs`, as the example pads them.
"""

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp
import jraph
import numpy as np

ATOM_TYPES = 9


class MLP(nn.Module):
    """ogbg's MLP: `Dense` and ReLU per feature size."""

    feature_sizes: Sequence[int]

    @nn.compact
    def __call__(self, x):
        for size in self.feature_sizes:
            x = nn.relu(nn.Dense(size)(x))
        return x


class GraphConvNet(nn.Module):
    """ogbg's `GraphConvNet` (see the module docstring)."""

    latent_size: int
    num_mlp_layers: int
    message_passing_steps: int
    output_globals_size: int

    @nn.compact
    def __call__(self, graphs: jraph.GraphsTuple) -> jraph.GraphsTuple:
        graphs = jraph.GraphMapFeatures(embed_node_fn=nn.Dense(self.latent_size))(graphs)
        for _ in range(self.message_passing_steps):
            update = jraph.concatenated_args(MLP([self.latent_size] * self.num_mlp_layers))
            convolved = jraph.GraphConvolution(update_node_fn=update, add_self_edges=True)(graphs)
            graphs = graphs._replace(nodes=nn.LayerNorm()(convolved.nodes + graphs.nodes))
        n_graph = graphs.n_node.shape[0]
        owners = jnp.repeat(jnp.arange(n_graph), graphs.n_node, axis=0, total_repeat_length=graphs.nodes.shape[0])
        graphs = graphs._replace(globals=jraph.segment_mean(graphs.nodes, owners, n_graph))
        return jraph.GraphMapFeatures(embed_global_fn=nn.Dense(self.output_globals_size))(graphs)


def _molecule(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random tree with a few extra bonds: `(atom types, bonds (k, 2))`."""
    atoms = int(rng.integers(6, 17))
    bonds = [(int(rng.integers(0, i)), i) for i in range(1, atoms)]
    bonds += [tuple(sorted(rng.choice(atoms, 2, replace=False))) for _ in range(int(rng.integers(0, 3)))]
    return rng.integers(0, ATOM_TYPES, atoms), np.unique(np.asarray(bonds), axis=0)


def _properties(types: np.ndarray, bonds: np.ndarray, tasks: int) -> np.ndarray:
    """`tasks` binary properties of a molecule (see the module docstring)."""
    present = np.bincount(types, minlength=ATOM_TYPES) > 0
    pairs = {tuple(sorted((types[a], types[b]))) for a, b in bonds}
    ring = len(bonds) >= len(types)
    candidates = [*present, ring, len(types) > 11] + [(a, b) in pairs for a in range(3) for b in range(a, 4)]
    return np.asarray(candidates[:tasks], np.float32)


def molecules(count: int, tasks: int, seed: int = 0) -> list[jraph.GraphsTuple]:
    """`count` generated molecules as single graphs, their labels (`(1, tasks)`, NaN where missing)
    as the globals, as ogbg's input pipeline gives them."""
    rng = np.random.default_rng(seed)
    graphs = []
    for _ in range(count):
        types, bonds = _molecule(rng)
        labels = _properties(types, bonds, tasks)
        labels[rng.random(tasks) < 0.1] = np.nan
        senders = np.concatenate([bonds[:, 0], bonds[:, 1]])
        receivers = np.concatenate([bonds[:, 1], bonds[:, 0]])
        graphs.append(jraph.GraphsTuple(
            nodes=np.eye(ATOM_TYPES, dtype=np.float32)[types], edges=None, senders=senders.astype(np.int32),
            receivers=receivers.astype(np.int32), n_node=np.asarray([len(types)]),
            n_edge=np.asarray([len(senders)]), globals=labels[None],
        ))
    return graphs


def graph_batches(graphs: list[jraph.GraphsTuple], batch_size: int) -> Callable[..., jraph.GraphsTuple]:
    """`next_batch` for `Problem`: consecutive batches of `batch_size` graphs (cycled), each padded
    with one dummy graph to 16 nodes per graph and 40 edges per graph."""
    batches = []
    for start in range(0, len(graphs) - batch_size + 1, batch_size):
        batch = jraph.batch_np(graphs[start : start + batch_size])
        padded = jraph.pad_with_graphs(batch, 16 * batch_size + 1, 40 * batch_size, batch_size + 1)
        batches.append(padded._replace(edges=np.zeros((40 * batch_size, 1), np.float32)))

    def next_batch(model, step, key, previous=None):
        del model, key, previous
        return batches[step % len(batches)]

    return next_batch


def valid_mask(graphs: jraph.GraphsTuple) -> jnp.ndarray:
    """ogbg's mask of the labels to train on: present, and of a real (not padding) graph."""
    return ~jnp.isnan(graphs.globals) & jraph.get_graph_padding_mask(graphs)[:, None]
