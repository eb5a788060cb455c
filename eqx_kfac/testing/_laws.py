"""`check_block`: the laws every curvature block must satisfy, checked against dense NumPy."""

import dataclasses
import io
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from .._curvature.blocks import CurvatureBlock
from .._tracing.layer_data import EstimationData, LayerSpec
from .._curvature.operators.block_operators import unflatten_vector
from .._curvature.operators.spectral import eigenvalues, frobenius_norm, logdet, matpower, trace
from ._specs import batch_size, block_state, estimation_data, example_specs, random_vector


class BlockLawError(AssertionError):
    """A curvature block breaks laws of `check_block`; the message names the block, its layer and
    every broken law."""


_CACHE = dict(exact_powers_to_cache=(-1, 0.5), approx_powers_to_cache=-1, cache_eigenvalues=True)
_POWERS = (-1.0, -0.5, 0.5, 2.0)
# (p, q) with p + q among the powers above or 1, so each composition has a reference.
# (p, q) with p + q among the powers above or 1, so each composition has a reference.
_COMPOSITIONS = ((0.5, -1.0), (2.0, -1.0))
# (power, exact) of the operator's matpower, compared with the block's multiply_matpower.
_OPERATOR_POWERS = ((-1.0, True), (-0.5, True), (-1.0, False), (1.0, False))
_CACHED = ((-1.0, True), (0.5, True), (-1.0, False))


def _flat(vector: Sequence[Array]) -> Array:
    return jnp.concatenate([jnp.ravel(v) for v in vector])


@eqx.filter_jit
def _evaluate(block: CurvatureBlock, state: Any, vector: tuple, damping: Array) -> dict:
    """Everything the laws compare, from the block's methods and its operator, in one program."""

    def power(v, p, exact=True, cached=False, s=state, weight=damping):
        if not isinstance(v, tuple):
            v = unflatten_vector(v, block.param_shapes)
        return _flat(block.multiply_matpower(s, v, weight, p, exact, cached))

    zero = jnp.zeros_like(damping)
    out = {
        "dense": block.to_dense_matrix(state),
        "eigenvalues": block.eigenvalues(state),
        "undamped": power(vector, 1, weight=zero),
        "approximate undamped": power(vector, 1, False, weight=zero),
        "block power 1.0 True": power(vector, 1),
        "block power 1.0 False": power(vector, 1, False),
        "block power -1.0 False": power(vector, -1, False),
    }
    for p in _POWERS:
        out[f"block power {p} True"] = power(vector, p)
    for p, q in _COMPOSITIONS:
        out[f"compose {p} {q}"] = power(out[f"block power {q} True"], p)
    for exact in (True, False):
        out[f"round trip {exact}"] = power(out[f"block power -1.0 {exact}"], 1, exact)
    cached = block.update_cache(
        state, damping, exact_powers=(-1, 0.5), approx_powers=-1, eigenvalues=True
    )
    out["cached eigenvalues"] = block.eigenvalues(cached, use_cached=True)
    out["fresh eigenvalues"] = block.eigenvalues(cached)
    for p, exact in _CACHED:
        out[f"cached {p} {exact}"] = power(vector, p, exact, True, cached)
        out[f"fresh {p} {exact}"] = power(vector, p, exact, False, cached)
    operator = block.as_linear_operator(state, damping)
    out["operator matrix"] = operator.as_matrix()
    out["operator mv"] = _flat(operator.mv(vector))
    out["operator transpose mv"] = _flat(operator.transpose().mv(vector))
    out["operator diagonal"] = lx.diagonal(operator)
    out["operator trace"] = trace(operator)
    out["operator logdet"] = logdet(operator)
    out["operator frobenius"] = frobenius_norm(operator)
    out["operator eigenvalues"] = eigenvalues(operator)
    for p, exact in _OPERATOR_POWERS:
        out[f"operator power {p} {exact}"] = _flat(matpower(operator, p, exact).mv(vector))
    out["operator powers add"] = _flat(matpower(matpower(operator, -0.5), 2).mv(vector))
    return out


@eqx.filter_jit
def _stack_views(block: CurvatureBlock, data: EstimationData, vector: tuple) -> dict:
    state = block.init(None)
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch_size(block.spec))
    return {
        "dense": block.to_dense_matrix(state),
        "multiply": block.multiply(state, vector, 0.0),
        "eigenvalues": block.eigenvalues(state),
    }


class _Laws:
    """Collects the broken laws of one block, comparing with tolerances relative to the scale."""

    def __init__(self, rtol: float):
        self.rtol = rtol
        self.broken: list[str] = []

    def holds(self, law: str, ok: bool, detail: str) -> None:
        if not ok:
            self.broken.append(f"'{law}': {detail}")

    def close(self, law: str, got: Any, expected: Any, factor: float = 1.0) -> None:
        got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
        if got.shape != expected.shape:
            self.holds(law, False, f"shape {got.shape}, expected {expected.shape}")
            return
        error = np.max(np.abs(got - expected), initial=0.0)
        bound = self.rtol * factor * max(np.max(np.abs(expected), initial=0.0), 1.0)
        self.holds(law, bool(error <= bound), f"max error {error:.3g} > tolerance {bound:.3g}")


def _dense_power(
    values: np.ndarray, vectors: np.ndarray, damping: float, power: float
) -> np.ndarray:
    return (vectors * (np.maximum(values, 0.0) + damping) ** power) @ vectors.T


class _Dense(NamedTuple):
    """The reference of one block's laws: its dense matrix, spectrum and the test vector."""

    matrix: np.ndarray
    values: np.ndarray
    vectors: np.ndarray
    damped: np.ndarray
    kappa: float
    v: np.ndarray


def _check_matrix(laws: _Laws, dense: np.ndarray, n: int, damping: float, v: np.ndarray) -> "_Dense | None":
    """The laws of `to_dense_matrix` itself; its reference, or `None` when it has the wrong shape."""
    laws.holds("to_dense_matrix is dim × dim", dense.shape == (n, n), f"shape {dense.shape}")
    if dense.shape != (n, n):
        return None
    scale = max(np.max(np.abs(dense), initial=0.0), 1.0)
    laws.close("to_dense_matrix is symmetric", dense, dense.T)
    values, vectors = np.linalg.eigh((dense + dense.T) / 2)
    lowest = np.min(values, initial=0.0)
    laws.holds(
        "to_dense_matrix is positive semi-definite",
        bool(lowest >= -laws.rtol * n * scale),
        f"smallest eigenvalue {lowest:.3g}",
    )
    # Rounding in inverses and fractional powers grows with the condition number.
    kappa = (np.max(values, initial=0.0) + damping) / (max(np.min(values, initial=0.0), 0.0) + damping)
    return _Dense(dense, values, vectors, dense + damping * np.eye(n), kappa, v)


def _check_products(laws: _Laws, out: dict[str, np.ndarray], ref: _Dense, damping: float) -> None:
    """The laws of the block's products, powers and caches against the dense reference."""
    v, kappa = ref.v, ref.kappa
    multiply = out["block power 1.0 True"]
    laws.close("multiply is to_dense_matrix plus damping", multiply, ref.damped @ v)
    laws.close("damping adds identity_weight · v", multiply - out["undamped"], damping * v)
    laws.close(
        "the approximate product without damping is the exact one", out["approximate undamped"],
        ref.matrix @ v,
    )
    laws.close("eigenvalues are those of to_dense_matrix", np.sort(out["eigenvalues"]), ref.values)
    for p in _POWERS:
        laws.close(
            "exact powers are the powers of to_dense_matrix plus damping",
            out[f"block power {p} True"], _dense_power(ref.values, ref.vectors, damping, p) @ v, kappa,
        )
    for p, q in _COMPOSITIONS:
        laws.close("exact powers add", out[f"compose {p} {q}"], out[f"block power {p + q} True"], kappa)
    for exact in (True, False):
        law = "multiply_inverse undoes multiply" + ("" if exact else " (approximate powers)")
        laws.close(law, out[f"round trip {exact}"], v, kappa)
    law = "cached results equal fresh ones after update_cache"
    laws.close(law, out["cached eigenvalues"], out["fresh eigenvalues"])
    for p, exact in _CACHED:
        laws.close(law, out[f"cached {p} {exact}"], out[f"fresh {p} {exact}"], kappa)


def _check_operator(
    laws: _Laws, out: dict[str, np.ndarray], ref: _Dense, operator: Any, param_shapes: tuple, damping: float
) -> None:
    """The laws of `as_linear_operator` against the dense reference and the block's own powers."""
    structure = tuple(tuple(s.shape) for s in jax.tree.leaves(operator.in_structure()))
    laws.holds(
        "as_linear_operator acts on the block's parameters", structure == param_shapes,
        f"input shapes {structure}, parameters {param_shapes}",
    )
    laws.holds(
        "as_linear_operator is tagged symmetric positive semi-definite",
        lx.is_symmetric(operator) and lx.is_positive_semidefinite(operator),
        "lineax.is_symmetric / is_positive_semidefinite say no",
    )
    damped, v, kappa, n = ref.damped, ref.v, ref.kappa, ref.matrix.shape[0]
    law = "as_linear_operator is to_dense_matrix plus damping"
    for key, expected in (("operator matrix", damped), ("operator mv", damped @ v),
                          ("operator transpose mv", damped @ v), ("operator diagonal", np.diagonal(damped))):
        laws.close(law, out[key], expected)
    law = "trace, logdet, Frobenius norm and eigenvalues of the operator are the dense ones"
    damped_values = np.maximum(ref.values, 0.0) + damping
    laws.close(law, out["operator trace"], np.trace(damped))
    laws.close(law, out["operator frobenius"], np.linalg.norm(damped))
    laws.close(law, np.sort(out["operator eigenvalues"]), damped_values)
    logdet_reference = np.sum(np.log(damped_values))
    laws.holds(
        law,
        bool(abs(out["operator logdet"] - logdet_reference) <= laws.rtol * kappa * max(n, abs(logdet_reference))),
        f"logdet {out['operator logdet']:.10g}, dense {logdet_reference:.10g}",
    )
    law = "matpower of the operator is the block's multiply_matpower"
    for p, exact in _OPERATOR_POWERS:
        laws.close(law, out[f"operator power {p} {exact}"], out[f"block power {p} {exact}"], kappa)
    laws.close(law, out["operator powers add"], out["block power -1.0 True"], kappa)


def _check_algebra(
    laws: _Laws, block: CurvatureBlock, state: Any, key: PRNGKeyArray, damping: float
) -> None:
    vector = random_vector(block, key)
    raw = _evaluate(block, state, vector, jnp.asarray(damping, block.dtype))
    out = {k: np.asarray(x, np.float64) for k, x in raw.items()}
    ref = _check_matrix(laws, out["dense"], block.dim, damping, np.asarray(_flat(vector), np.float64))
    if ref is None:
        return
    _check_products(laws, out, ref, damping)
    _check_operator(laws, out, ref, block.as_linear_operator(state, damping), block.param_shapes, damping)


def _slice(data: EstimationData, s: int) -> EstimationData:
    return EstimationData(
        params=tuple(x[s] for x in data.params),
        inputs=tuple(x[s] for x in data.inputs),
        outputs=tuple(x[s] for x in data.outputs),
        outputs_tangent=tuple(t[:, s] for t in data.outputs_tangent),
        params_tangent=tuple(t[:, s] for t in data.params_tangent),
    )


def _check_stacking(laws: _Laws, block: CurvatureBlock, key: PRNGKeyArray) -> None:
    """A scan-stacked block is the block diagonal of per-layer blocks on the slices' data."""
    spec = block.spec
    single = dataclasses.replace(block, spec=dataclasses.replace(spec, stack_size=None))
    data_key, vector_key = jax.random.split(key)
    data = estimation_data(spec, data_key)
    vector = random_vector(block, vector_key)
    stacked = _stack_views(block, data, vector)
    dense = np.asarray(stacked["dense"], np.float64)
    sizes = [int(np.prod(s)) for s in spec.param_shapes]
    law = "a scan-stacked block equals per-layer blocks"
    all_values = []
    for s in range(spec.stack_size):
        views = _stack_views(single, _slice(data, s), tuple(v[s] for v in vector))
        # Parameter k of slice s sits at `stack · offset_k + s · size_k` of the stacked leaves.
        index = np.concatenate(
            [spec.stack_size * sum(sizes[:k]) + s * n + np.arange(n) for k, n in enumerate(sizes)]
        )
        laws.close(law, dense[np.ix_(index, index)], views["dense"])
        outside = np.delete(dense[index], index, axis=1)
        laws.close(law, outside, np.zeros_like(outside))
        laws.close(law, _flat([m[s] for m in stacked["multiply"]]), _flat(views["multiply"]))
        all_values.append(np.asarray(views["eigenvalues"]))
    laws.close(law, np.sort(stacked["eigenvalues"]), np.sort(np.concatenate(all_values)))


def _shapes(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(jnp.shape(x)), jnp.result_type(x)) for x in leaves)


def _check_state(laws: _Laws, block: CurvatureBlock, state: Any, damping: float) -> None:
    fresh = block.init(None, **_CACHE)
    cached = jax.eval_shape(lambda s: block.update_cache(s, damping, (-1, 0.5), -1, True), state)
    law = "the state keeps its structure, shapes and dtypes"
    for name, other in (
        ("after update_curvature_matrix_estimate", state),
        ("after update_cache", cached),
    ):
        laws.holds(law, _shapes(other) == _shapes(fresh), f"{name} it differs from init's")
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, state)
    buffer.seek(0)
    restored = eqx.tree_deserialise_leaves(buffer, fresh)
    same = _shapes(restored) == _shapes(state) and all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state))
    )
    laws.holds(
        "the state round-trips through eqx.tree_serialise_leaves",
        same,
        "the deserialised state differs from the serialised one",
    )


def _blocks_to_check(
    block_or_ctor: CurvatureBlock | Callable[[LayerSpec], CurvatureBlock],
    specs: Sequence[LayerSpec] | None,
) -> list[CurvatureBlock]:
    if isinstance(block_or_ctor, CurvatureBlock):
        if specs is not None:
            raise ValueError("check_block: pass `specs=` with a block constructor, not a block.")
        return [block_or_ctor]
    if specs is None:
        if not (isinstance(block_or_ctor, type) and issubclass(block_or_ctor, CurvatureBlock)):
            raise TypeError(
                f"check_block: {block_or_ctor!r} is neither a CurvatureBlock nor a block class; "
                "for another constructor pass the layers to check as `specs=`."
            )
        tags = sorted(block_or_ctor.supported_tags or {"generic"})
        specs = [spec for tag in tags for spec in example_specs(tag)]
    return [block_or_ctor(spec) for spec in specs]


def check_block(
    block_or_ctor: CurvatureBlock | Callable[[LayerSpec], CurvatureBlock],
    *,
    specs: Sequence[LayerSpec] | None = None,
    key: PRNGKeyArray | None = None,
    damping: float = 0.1,
    rtol: float | None = None,
) -> None:
    """Checks the laws every curvature block must satisfy, against dense NumPy linear algebra.

    Each block gets a state with realistic statistics (`block_state`: two moving-average updates
    with `estimation_data`) and a random vector `v`. With `C = to_dense_matrix(state)` and
    `λ = damping`, the laws are:

    - `to_dense_matrix` is symmetric positive semi-definite, and `eigenvalues` are its eigenvalues;
    - `multiply` is `(C + λI) v`, and the damping adds `λ v`; the approximate product without
      damping is the exact one;
    - exact powers are those of `C + λI` (NumPy's eigendecomposition) and add
      (`p` after `q` is `p + q`); `multiply_inverse` undoes `multiply`, exactly and with the
      approximate powers;
    - after `update_cache`, cached eigenvalues and powers equal fresh ones;
    - `as_linear_operator(state, λ)` acts on the parameters, is tagged symmetric PSD, its
      matrix, products and diagonal are those of `C + λI`, its `trace`, `logdet`,
      `frobenius_norm` and `eigenvalues` those of the dense matrix, and its `matpower` (exact and
      approximate) is the block's `multiply_matpower`;
    - a scan-stacked block (`spec.stack_size`) equals per-layer blocks of the slices' data;
    - the state keeps its structure, shapes and dtypes through the updates and round-trips
      through `eqx.tree_serialise_leaves`.

    Tolerances are relative to the largest entry (at least 1); those of powers and inverses are
    multiplied by the condition number of `C + λI`.

    **Arguments:**

    - `block_or_ctor`: a block, or a block class (or any constructor from a `LayerSpec`,
      together with `specs`).
    - `specs`: the layers to build blocks for; default for a block class: two example layers
      (one scan-stacked) of every tag it supports.
    - `key`: a PRNG key for the statistics and vectors (default `jax.random.key(0)`).
    - `damping`: `λ > 0`.
    - `rtol`: the relative tolerance; default `1e-8` for float64 statistics, `1e-4` otherwise.

    **Returns:**

    Nothing; raises `BlockLawError` naming the block, the layer and every broken law.
    """
    key = jax.random.key(0) if key is None else key
    for block in _blocks_to_check(block_or_ctor, specs):
        float64 = jnp.dtype(block.dtype) == jnp.float64
        laws = _Laws(rtol if rtol is not None else (1e-8 if float64 else 1e-4))
        state_key, vector_key, stack_key = jax.random.split(key, 3)
        state = block_state(block, state_key, **_CACHE)
        _check_state(laws, block, state, damping)
        _check_algebra(laws, block, state, vector_key, damping)
        if block.spec.stack_size is not None:
            _check_stacking(laws, block, stack_key)
        if laws.broken:
            broken = "\n".join(f"- {law}" for law in dict.fromkeys(laws.broken))
            raise BlockLawError(
                f"{type(block).__name__} for the {block.spec.describe} breaks "
                f"{len(laws.broken)} check(s) of its laws:\n{broken}"
            )
