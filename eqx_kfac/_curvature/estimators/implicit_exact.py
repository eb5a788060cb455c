"""Exact curvature matrix-vector products that never form a matrix."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ..._core.compiled import compiled
from ..._core.tree import scale_keeping_dtypes
from ..._tracing.losses import LossFunction
from ..._tracing.tracer import loss_tags_hvp, loss_tags_jvp, loss_tags_vjp
from .base import batch_size_of
from .modes import check_estimation_mode


class ImplicitExactCurvature(eqx.Module):
    """Products with the exact Hessian, GGN and Fisher of a function with registered losses.

    All products are averages over the batch: for the GGN, `G v = (1/B) Σ_b J_bᵀ H_b J_b v`, with
    `J_b` the Jacobian of the loss inputs of example `b` with respect to the parameters and `H_b`
    the Hessian of the (weighted) losses with respect to their inputs; the Fisher uses the losses'
    Fisher matrices instead of `H_b`. The factor products use `F = B Bᵀ` with
    `B u = (1/√B) Σ_b J_bᵀ L_b u_b`, where `L_b L_bᵀ` is the loss's Fisher (or GGN).

    Nothing is traced at construction; each product traces `func` on its arguments (cached per
    argument shapes by the tracer).
    """

    func: Callable[..., Any] = eqx.field(static=True)
    params_index: int = eqx.field(static=True)
    batch_size_extractor: Callable[[Any], Any] | None = eqx.field(static=True)

    def __init__(
        self,
        func: Callable[..., Any],
        params_index: int = 0,
        batch_size_extractor: Callable[[Any], Any] | None = None,
    ):
        """**Arguments:**

        - `func`: the loss function; it must register at least one loss.
        - `params_index`: position of the parameters among the arguments of `func`.
        - `batch_size_extractor`: maps the batch (the last argument of `func`) to the batch size;
          `None` (default) takes the leading dimension of the registered losses' inputs.
        """
        self.func = func
        self.params_index = params_index
        self.batch_size_extractor = batch_size_extractor

    def batch_size(self, func_args: Sequence[Any]) -> Any:
        """The batch size of `func_args` (see `batch_size_extractor`).

        **Arguments:**

        - `func_args`: the arguments of `func`.

        **Returns:**

        The batch size (a Python integer unless the extractor computes an array).
        """
        return batch_size_of(self.func, func_args, self.params_index, self.batch_size_extractor)

    def _losses_and_vjp(self, func_args: Sequence[Any]):
        return loss_tags_vjp(self.func, params_index=self.params_index)(tuple(func_args))

    @compiled
    def multiply_jacobian(
        self, func_args: Sequence[Any], vector: PyTree[Array]
    ) -> tuple[tuple[Array, ...], ...]:
        """The Jacobian of the loss inputs with respect to the parameters, times `vector`.

        **Arguments:**

        - `func_args`: the arguments of `func`.
        - `vector`: a parameter-space vector.

        **Returns:**

        One tuple per loss, shaped like that loss's `inputs`.
        """
        _, tangents = loss_tags_jvp(self.func, params_index=self.params_index)(
            tuple(func_args), vector
        )
        return tuple(tuple(t) for t in tangents)

    @compiled
    def multiply_jacobian_transpose(
        self, func_args: Sequence[Any], loss_input_vectors: Sequence[Sequence[Array]]
    ) -> PyTree[Array]:
        """The transposed Jacobian of the loss inputs times loss-space vectors (summed over examples).

        **Arguments:**

        - `func_args`: the arguments of `func`.
        - `loss_input_vectors`: one tuple per loss, shaped like that loss's `inputs`.

        **Returns:**

        A parameter-space vector.
        """
        _, vjp = self._losses_and_vjp(func_args)
        return vjp(tuple(tuple(v) for v in loss_input_vectors))

    @compiled
    def multiply_hessian(self, func_args: Sequence[Any], vector: PyTree[Array]) -> PyTree[Array]:
        """`H v / B`: the Hessian of the sum of the registered losses, averaged over the batch.

        **Arguments:**

        - `func_args`: the arguments of `func`.
        - `vector`: a parameter-space vector.

        **Returns:**

        A parameter-space vector.
        """
        hvp, _ = loss_tags_hvp(self.func, params_index=self.params_index)(tuple(func_args), vector)
        return scale_keeping_dtypes(hvp, 1.0 / self.batch_size(func_args))

    def _multiply_curvature(
        self, func_args: Sequence[Any], vector: PyTree[Array], kind: str
    ) -> PyTree[Array]:
        losses, tangents = loss_tags_jvp(self.func, params_index=self.params_index)(
            tuple(func_args), vector
        )
        _check(kind, losses)
        products = tuple(
            tuple(loss.multiply_fisher(tuple(t)) if kind == "fisher" else loss.multiply_ggn(tuple(t)))
            for loss, t in zip(losses, tangents)
        )
        _, vjp = self._losses_and_vjp(func_args)
        return scale_keeping_dtypes(vjp(products), 1.0 / self.batch_size(func_args))

    @compiled
    def multiply_fisher(self, func_args: Sequence[Any], vector: PyTree[Array]) -> PyTree[Array]:
        """`F v`: the exact Fisher (averaged over the batch) times `vector`.

        **Arguments:**

        - `func_args`: the arguments of `func`.
        - `vector`: a parameter-space vector.

        **Returns:**

        A parameter-space vector. Raises `TypeError` unless every loss is a `NegativeLogProbLoss`.
        """
        return self._multiply_curvature(func_args, vector, "fisher")

    @compiled
    def multiply_ggn(self, func_args: Sequence[Any], vector: PyTree[Array]) -> PyTree[Array]:
        """`G v`: the exact generalised Gauss-Newton matrix (averaged over the batch) times `vector`.

        **Arguments:**

        - `func_args`: the arguments of `func`.
        - `vector`: a parameter-space vector.

        **Returns:**

        A parameter-space vector.
        """
        return self._multiply_curvature(func_args, vector, "ggn")

    def _multiply_factor_transpose(
        self, func_args: Sequence[Any], vector: PyTree[Array], kind: str
    ) -> tuple[Array, ...]:
        losses, tangents = loss_tags_jvp(self.func, params_index=self.params_index)(
            tuple(func_args), vector
        )
        _check(kind, losses)
        inner = tuple(
            loss.multiply_fisher_factor_transpose(tuple(t))
            if kind == "fisher"
            else loss.multiply_ggn_factor_transpose(tuple(t))
            for loss, t in zip(losses, tangents)
        )
        return scale_keeping_dtypes(inner, 1.0 / jnp.sqrt(self.batch_size(func_args)))

    def _multiply_factor(
        self, func_args: Sequence[Any], loss_inner_vectors: Sequence[Array], kind: str
    ) -> PyTree[Array]:
        losses, vjp = self._losses_and_vjp(func_args)
        _check(kind, losses)
        if len(loss_inner_vectors) != len(losses):
            raise ValueError(
                f"Got {len(loss_inner_vectors)} loss inner vectors for {len(losses)} registered "
                "losses; pass one array per loss, shaped like its factor's inner space."
            )
        products = tuple(
            tuple(loss.multiply_fisher_factor(u) if kind == "fisher" else loss.multiply_ggn_factor(u))
            for loss, u in zip(losses, loss_inner_vectors)
        )
        return scale_keeping_dtypes(vjp(products), 1.0 / jnp.sqrt(self.batch_size(func_args)))

    @compiled
    def multiply_fisher_factor_transpose(
        self, func_args: Sequence[Any], vector: PyTree[Array]
    ) -> tuple[Array, ...]:
        """`Bᵀ v` for the Fisher factor `B` (`F = B Bᵀ`).

        **Arguments:**

        - `func_args`: the arguments of `func`.
        - `vector`: a parameter-space vector.

        **Returns:**

        One array per loss, shaped like its `fisher_factor_inner_shape`.
        """
        return self._multiply_factor_transpose(func_args, vector, "fisher")

    @compiled
    def multiply_ggn_factor_transpose(
        self, func_args: Sequence[Any], vector: PyTree[Array]
    ) -> tuple[Array, ...]:
        """`Bᵀ v` for the GGN factor `B` (`G = B Bᵀ`).

        **Arguments:**

        - `func_args`: the arguments of `func`.
        - `vector`: a parameter-space vector.

        **Returns:**

        One array per loss, shaped like its `ggn_factor_inner_shape`.
        """
        return self._multiply_factor_transpose(func_args, vector, "ggn")

    @compiled
    def multiply_fisher_factor(
        self, func_args: Sequence[Any], loss_inner_vectors: Sequence[Array]
    ) -> PyTree[Array]:
        """`B u` for the Fisher factor `B` (`F = B Bᵀ`).

        **Arguments:**

        - `func_args`: the arguments of `func`.
        - `loss_inner_vectors`: one array per loss, shaped like its `fisher_factor_inner_shape`.

        **Returns:**

        A parameter-space vector.
        """
        return self._multiply_factor(func_args, loss_inner_vectors, "fisher")

    @compiled
    def multiply_ggn_factor(
        self, func_args: Sequence[Any], loss_inner_vectors: Sequence[Array]
    ) -> PyTree[Array]:
        """`B u` for the GGN factor `B` (`G = B Bᵀ`).

        **Arguments:**

        - `func_args`: the arguments of `func`.
        - `loss_inner_vectors`: one array per loss, shaped like its `ggn_factor_inner_shape`.

        **Returns:**

        A parameter-space vector.
        """
        return self._multiply_factor(func_args, loss_inner_vectors, "ggn")


def _check(kind: str, losses: Sequence[LossFunction]) -> None:
    check_estimation_mode("fisher_exact" if kind == "fisher" else "ggn_exact", losses)
