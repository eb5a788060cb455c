"""Flax's and Haiku's embedding and LSTM layers get structured blocks: `nn.Embed` and `hk.Embed`
the embedding block, `nn.OptimizedLSTMCell`'s concatenated gate kernels one dense block per gate
(and `hk.LSTM`, one `hk.Linear`, a dense block), checked against the exact GGN where K-FAC is
exact and against Kronecker factors built by hand from the layers' inputs and output tangents."""

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac

VOCAB, FEATURES, HIDDEN, OUT, BATCH = 9, 4, 3, 2, 5


def _float64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64), tree)


def _squared_error(apply):
    def loss(params, batch):
        out = apply(params, batch)
        eqx_kfac.register_squared_error_loss(out, weight=0.5)  # H = I
        return 0.5 * jnp.sum(out**2) / out.shape[0]

    return loss


def _dense_blocks(loss, params, batch):
    """The estimator and its blocks' dense matrices, estimated exactly (`ggn_exact`)."""
    estimator = eqx_kfac.BlockDiagonalCurvature(loss, (params, batch), on_unmatched="error")

    @jax.jit
    def dense(params, batch):
        state = estimator.update_curvature_matrix_estimate(
            estimator.init(None), 0.0, 1.0, BATCH, jax.random.key(0), (params, batch), "ggn_exact"
        )
        return [b.to_dense_matrix(s) for b, s in zip(estimator.blocks, state.block_states)]

    return estimator, dense(params, batch)


def _block_of(estimator, matrices, path):
    (k,) = [k for k, b in enumerate(estimator.blocks) if any(path in p for p in b.spec.param_paths)]
    return estimator.blocks[k], matrices[k]


class _FlaxEmbedReadout(nn.Module):
    @nn.compact
    def __call__(self, ids):
        return nn.Dense(OUT)(nn.Embed(VOCAB, FEATURES)(ids))


def _haiku_embed_readout(ids):
    return hk.Linear(OUT)(hk.Embed(VOCAB, FEATURES)(ids))


def _embed_model(library, ids):
    """`(apply, params, table path)` of an embedding followed by a linear readout."""
    if library == "flax":
        model = _FlaxEmbedReadout()
        init, apply, table_path = model.init, model.apply, "['embedding']"
    else:
        transformed = hk.without_apply_rng(hk.transform(_haiku_embed_readout))
        init, apply, table_path = transformed.init, transformed.apply, "['embeddings']"
    # Compiled: an eager `init` compiles a program per operation.
    return apply, jax.jit(lambda k, ids: _float64(init(k, ids)))(jax.random.key(0), ids), table_path


def _table_jacobian(apply, table_path):
    """`(params, ids) ->` the Jacobian of the model's outputs with respect to its table."""

    def jacobian(params, ids):
        def outputs_of_table(table):
            p = jax.tree_util.tree_map_with_path(
                lambda path, leaf: table if table_path in jax.tree_util.keystr(path) else leaf, params
            )
            return apply(p, ids).reshape(-1)

        (table,) = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params) if table_path in jax.tree_util.keystr(path)]
        return jax.jacobian(outputs_of_table)(table)

    return jacobian


@pytest.mark.parametrize("ids_shape", [(BATCH,), (BATCH, 3), (BATCH, 2, 3)], ids=["tokens", "sequences", "grids"])
@pytest.mark.parametrize("library", ["flax", "haiku"])
def test_embedding_block_equals_exact_ggn(library, ids_shape, getkey):
    # Every position's output is linear in its row of the table, so the exact GGN of the table is
    # diag(token counts / B) ⊗ W Wᵀ: K-FAC's embedding block is exact.
    ids = jax.random.randint(getkey(), ids_shape, 0, VOCAB - 1)  # the last token never appears
    apply, params, table_path = _embed_model(library, ids)
    estimator, matrices = _dense_blocks(_squared_error(apply), params, ids)
    registrations = estimator.registrations()
    assert {r.tag for r in registrations.values()} == {"embedding", "dense"}
    block, matrix = _block_of(estimator, matrices, table_path)
    assert type(block).__name__ == "EmbeddingKroneckerFactored"
    assert block.spec.origin == {"flax": "embedding_take", "haiku": "embedding_index"}[library]
    # Compiled: eagerly, the Jacobian compiled a program per operation.
    jacobian = np.asarray(jax.jit(_table_jacobian(apply, table_path))(params, ids)).reshape(-1, VOCAB * FEATURES)
    np.testing.assert_allclose(matrix, jacobian.T @ jacobian / BATCH, rtol=1e-10, atol=1e-12)
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=VOCAB)
    readout = np.asarray(params["params"]["Dense_0"]["kernel"] if library == "flax" else params["linear"]["w"])
    np.testing.assert_allclose(matrix, np.kron(np.diag(counts / BATCH), readout @ readout.T), rtol=1e-10, atol=1e-12)


GATES = ("i", "f", "g", "o")


def _cell_by_hand(params, x, c, h):
    """`nn.OptimizedLSTMCell`'s definition, gate by gate: the pre-activations and the new `h`."""
    p = params["params"]
    z = {g: x @ p[f"i{g}"]["kernel"] + h @ p[f"h{g}"]["kernel"] + p[f"h{g}"]["bias"] for g in GATES}
    return z, _new_h(z, c)


def _new_h(z, c):
    new_c = jax.nn.sigmoid(z["f"]) * c + jax.nn.sigmoid(z["i"]) * jnp.tanh(z["g"])
    return jax.nn.sigmoid(z["o"]) * jnp.tanh(new_c)


_CELL = nn.OptimizedLSTMCell(HIDDEN)


@jax.jit
def _cell_inputs_and_params(key):
    """The cell's inputs `(x, c, h)` and its parameters moved off their initial values (nonzero
    biases), drawn in one compiled program."""
    kx, kc, kh, kp = jax.random.split(key, 4)
    x = jax.random.normal(kx, (BATCH, FEATURES))
    c, h = jax.random.normal(kc, (BATCH, HIDDEN)), jax.random.normal(kh, (BATCH, HIDDEN))
    params = _float64(_CELL.init(jax.random.key(0), (c, h), x))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(kp, len(leaves))
    return (x, c, h), jax.tree.unflatten(treedef, [a + 0.3 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])


@jax.jit  # eagerly: a program per operation
def _gate_output_factors(params, batch):
    """The cell's new `h` by Flax and by hand, and each gate's output factor: the mean outer
    product of the Jacobians of the new `h` with respect to the gate's pre-activation (the output
    tangents, one column per output of the loss), example by example."""
    x, c, h = batch
    z, new_h = _cell_by_hand(params, x, c, h)
    factors = {}
    for gate in GATES:
        def per_example(zg, z_k, c_k, gate=gate):
            return _new_h({**z_k, gate: zg}, c_k)

        jacobians = jax.vmap(jax.jacobian(per_example))(z[gate], z, c)
        factors[gate] = jnp.einsum("bvi,bvj->ij", jacobians, jacobians) / BATCH
    return _CELL.apply(params, (c, h), x)[1], new_h, factors


def test_optimized_lstm_cell_gates_are_dense_blocks_with_hand_built_factors(getkey):
    (x, c, h), params = _cell_inputs_and_params(getkey())
    loss = _squared_error(lambda p, batch: _CELL.apply(p, batch[1:], batch[0])[1])
    estimator, matrices = _dense_blocks(loss, params, (x, c, h))
    flax_h, new_h, g_factors = _gate_output_factors(params, (x, c, h))
    np.testing.assert_allclose(flax_h, new_h, rtol=1e-12)
    for gate in GATES:
        for prefix, inputs in (("i", x), ("h", h)):
            block, matrix = _block_of(estimator, matrices, f"['{prefix}{gate}']")
            assert type(block).__name__ == "DenseTwoKroneckerFactored"
            inputs = np.asarray(inputs)
            if prefix == "h":  # with the bias: a 1 appended to the inputs
                inputs = np.concatenate([inputs, np.ones((BATCH, 1))], axis=1)
            a_factor = inputs.T @ inputs / BATCH
            np.testing.assert_allclose(matrix, np.kron(a_factor, np.asarray(g_factors[gate])), rtol=1e-10, atol=1e-12)


class _SequenceClassifier(nn.Module):
    @nn.compact
    def __call__(self, ids):
        hidden = nn.RNN(nn.OptimizedLSTMCell(HIDDEN + 3))(nn.Embed(VOCAB, FEATURES)(ids))
        return nn.Dense(OUT)(hidden[:, -1])


def _haiku_lstm(ids):
    core = hk.LSTM(HIDDEN)
    x = jnp.swapaxes(hk.Embed(VOCAB, FEATURES)(ids), 0, 1)
    hidden, _ = hk.dynamic_unroll(core, x, core.initial_state(ids.shape[0]))
    return hk.Linear(OUT)(hidden[-1])


def _classification_loss(apply):
    def loss(params, batch):
        ids, labels = batch
        logits = apply(params, ids)
        eqx_kfac.register_softmax_cross_entropy_loss(logits, labels)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss


def test_haiku_lstm_has_no_generic_blocks(getkey):
    ids = jax.random.randint(getkey(), (BATCH, 4), 0, VOCAB)
    transformed = hk.without_apply_rng(hk.transform(_haiku_lstm))
    params = jax.jit(transformed.init)(jax.random.key(0), ids)  # eagerly: a program per operation
    loss = _classification_loss(transformed.apply)
    labels = jnp.zeros((BATCH,), jnp.int32)
    registrations = eqx_kfac.BlockDiagonalCurvature(loss, (params, (ids, labels))).registrations()
    assert {path: r.tag for path, r in registrations.items()} == {
        "['embed']['embeddings']": "embedding",
        "['linear']['b']": "dense",
        "['linear']['w']": "dense",
        "['lstm/linear']['b']": "dense",
        "['lstm/linear']['w']": "dense",
    }


def test_kfac_optax_trains_a_flax_sequence_classifier(getkey):
    ids = jax.random.randint(getkey(), (16, 5), 0, VOCAB)
    labels = (ids[:, 0] % OUT).astype(jnp.int32)  # the class is given by the first token
    model = _SequenceClassifier()
    params = jax.jit(model.init)(jax.random.key(0), ids)  # eagerly: a program per operation
    loss = _classification_loss(model.apply)
    batch = (ids, labels)
    registrations = eqx_kfac.BlockDiagonalCurvature(loss, (params, batch)).registrations()
    cell = {path: r for path, r in registrations.items() if "OptimizedLSTMCell" in path}
    assert len(cell) == 12 and {(r.tag, r.scan) for r in cell.values()} == {("dense", "repeated x5")}
    assert {r.origin for r in cell.values()} == {"concatenated_dense_with_bias", "concatenated_dense_no_bias"}
    # on_unmatched="error": a generic (diagonal) block for any parameter would raise.
    optimizer = eqx_kfac.kfac_optax(loss, (params, batch), on_unmatched="error")
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, key):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, state = optimizer.update(grads, state, params, batch=batch, key=key)
        return optax.apply_updates(params, updates), state, value

    value = jax.jit(loss)  # eagerly: a program per operation
    first = value(params, batch)
    for k in range(8):
        params, state, _ = step(params, state, jax.random.key(k))
    assert value(params, batch) < 0.75 * first
