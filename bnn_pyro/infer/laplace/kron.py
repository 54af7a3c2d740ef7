"""The Kronecker-factored (KFAC) precision of ``structure="kron"``: block-diagonal over layers,

    H = blockdiag_l( s * G_l (x) A_l + d_l I ),

``G_l`` (outputs x outputs) and ``A_l`` (inputs x inputs, a bias as one more input) the factors of
:mod:`.kfac`, ``s`` a scale of the likelihood part (the noise search of :mod:`.marglik` moves it), ``d_l`` the
prior precision of layer ``l`` (its prior Hessian must be constant over the block). Block ``l`` covers the
coordinates ``index_l`` (outputs x inputs, row-major, so that ``vec(W) = W.reshape(-1)`` and ``G (x) A``
agree with ``torch.kron``). With ``G = Q_G diag(g) Q_G^T`` and ``A = Q_A diag(a) Q_A^T`` (eigendecompositions,
once per factor), ``H_l = (Q_G (x) Q_A) diag(s g (x) a + d_l) (Q_G (x) Q_A)^T``: its log-determinant, solves,
quadratic forms and square root cost ``O(out^3 + in^3)`` (Martens & Grosse 2015; Ritter et al. 2018; Immer
et al. 2021), and every one of them is differentiable in ``s`` and ``d_l`` (the evidence search needs that).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class KronBlock:
    """One layer: ``G (x) A`` on the covered positions ``index`` (shape ``(out, in)``; float64 factors)."""

    index: torch.Tensor
    g: torch.Tensor
    a: torch.Tensor
    name: str = ""
    bias: bool = False  # the last input column is a bias (a constant 1 input)
    _eig: tuple | None = field(default=None, repr=False)
    _g_eig: tuple | None = field(default=None, repr=False)  # G's (eigenvalues, eigenvectors), shared with its parts
    _parts: tuple | None = field(default=None, repr=False)  # split_bias's two blocks, made once

    def g_eig(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, Q_G)``: the eigendecomposition of ``G`` (eigenvalues clipped at 0: a PSD factor's round-off),
        computed once per block and handed to the blocks :meth:`split_bias` makes (they share ``G``)."""
        if self._g_eig is None:
            lg, qg = torch.linalg.eigh(self.g)
            self._g_eig = (lg.clamp(min=0.0), qg)
        return self._g_eig

    def eig(self):
        """``(g, Q_G, a, Q_A)``: both factors' eigendecompositions, computed once per block."""
        if self._eig is None:
            la, qa = torch.linalg.eigh(self.a)
            self._eig = (*self.g_eig(), la.clamp(min=0.0), qa)  # PSD factors: clip round-off
        return self._eig

    def split_bias(self) -> tuple[KronBlock, KronBlock]:
        """The weight and bias parts as two blocks (their cross-covariance dropped), made once per block so that
        every precision built from it (a prior added at each noise candidate or evidence step) reuses their
        eigendecompositions; both share this block's ``G`` and its eigendecomposition."""
        if self._parts is None:
            g_eig = self.g_eig()
            weight = KronBlock(self.index[:, :-1], self.g, self.a[:-1, :-1], self.name + ".weight", _g_eig=g_eig)
            bias = KronBlock(self.index[:, -1:], self.g, self.a[-1:, -1:], self.name + ".bias", _g_eig=g_eig)
            self._parts = (weight, bias)
        return self._parts


@dataclass
class Kron:
    """``blockdiag(scale * G_l (x) A_l + shift_l I)`` over ``size`` covered coordinates (every covered coordinate
    lies in exactly one block). ``scale`` and ``shift`` may be tensors that require grad."""

    blocks: list[KronBlock]
    size: int
    scale: torch.Tensor | float = 1.0
    shift: list = None  # per block: a float or a 0-d tensor

    def __post_init__(self):
        if self.shift is None:
            self.shift = [0.0] * len(self.blocks)

    # ------------------------------------------------------------------ algebra with numbers and diagonals
    def __mul__(self, factor):
        return replace(self, scale=self.scale * factor, shift=[s * factor for s in self.shift])

    __rmul__ = __mul__

    def __add__(self, diag):
        """``H + diag(d)``: ``d`` a number or a ``(size,)`` tensor constant over each block (a block whose bias
        column has its own constant is split into a weight and a bias block)."""
        if not torch.is_tensor(diag) or diag.dim() == 0:
            return replace(self, shift=[s + diag for s in self.shift])
        if diag.shape != (self.size,):
            raise ValueError(
                "structure='kron': the prior's Hessian is not diagonal (a prior that couples weights); "
                "use a factorized prior such as bp.priors.Normal, or structure='full' or 'diag'."
            )
        blocks, shifts = [], []
        for block, shift in zip(self.blocks, self.shift):
            parts = [block]
            if not _constant(diag[block.index]):
                if block.bias and all(_constant(diag[p.index]) for p in block.split_bias()):
                    parts = list(block.split_bias())
                else:
                    raise ValueError(
                        f"structure='kron': the prior precision of layer {block.name!r} is not one number over the "
                        "layer (the Kronecker factors need H_prior = delta I per layer). Use a Normal prior with one "
                        "scale per layer, prior_precision='marglik_layerwise' or a number, or structure='diag'."
                    )
            for part in parts:
                blocks.append(part)
                shifts.append(shift + diag[part.index.reshape(-1)[0]])
        return replace(self, blocks=blocks, shift=shifts)

    __radd__ = __add__

    # ------------------------------------------------------------------ what the Laplace fit needs
    def eigenvalues(self) -> list[torch.Tensor]:
        """Per block, the eigenvalues ``(out, in)`` of ``H_l``, in the eigenbasis ``Q_G (x) Q_A``."""
        out = []
        for block, shift in zip(self.blocks, self.shift):
            lg, _, la, _ = block.eig()
            out.append(self.scale * lg[:, None] * la[None, :] + shift)
        return out

    def logdet(self) -> torch.Tensor:
        return sum(ev.log().sum() for ev in self.eigenvalues())

    def is_positive_definite(self) -> bool:
        return all(bool((ev > 0).all()) for ev in self.eigenvalues())

    def _apply(self, v: torch.Tensor, power: float) -> torch.Tensor:
        """``H^power v`` for ``v`` shaped ``(..., size)`` (``power`` -1 or -1/2)."""
        out = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
        for block, ev in zip(self.blocks, self.eigenvalues()):
            _, qg, _, qa = block.eig()
            rotated = qg.T @ v[..., block.index].double() @ qa
            out[..., block.index] = qg @ (rotated * ev**power) @ qa.T
        return out

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        return self._apply(v, -1.0)

    def matmul(self, v: torch.Tensor) -> torch.Tensor:
        """``H v`` for ``v`` shaped ``(..., size)``."""
        return self._apply(v, 1.0)

    def inv_sqrt(self, eps: torch.Tensor) -> torch.Tensor:
        """``H^-1/2 eps``: standard normal ``eps`` ``(S, size)`` becomes draws of ``N(0, H^-1)``."""
        return self._apply(eps, -0.5)

    def quad(self, v: torch.Tensor) -> torch.Tensor:
        """``v^T H^-1 v`` for ``v`` shaped ``(..., size)``."""
        total = 0.0
        for block, ev in zip(self.blocks, self.eigenvalues()):
            _, qg, _, qa = block.eig()
            rotated = qg.T @ v[..., block.index].double() @ qa
            total = total + (rotated**2 / ev).sum((-2, -1))
        return total

    def functional_covariance(self, jac: torch.Tensor) -> torch.Tensor:
        """``J H^-1 J^T`` for Jacobians ``jac`` ``(B, out, size)`` in the covered coordinates: ``(B, out, out)``."""
        cov = 0.0
        for block, ev in zip(self.blocks, self.eigenvalues()):
            _, qg, _, qa = block.eig()
            rotated = qg.T @ jac[..., block.index].double() @ qa  # (B, out, O, I)
            cov = cov + torch.einsum("boij,bpij->bop", rotated / ev, rotated)
        return cov

    def dense(self) -> torch.Tensor:
        """``H`` as a dense ``(size, size)`` matrix (for tests and small nets)."""
        device = self.blocks[0].g.device if self.blocks else None
        out = torch.zeros(self.size, self.size, dtype=torch.float64, device=device)
        for block, shift in zip(self.blocks, self.shift):
            pos = block.index.reshape(-1)
            out[pos[:, None], pos] = self.scale * torch.kron(block.g, block.a) + shift * torch.eye(
                len(pos), device=device
            )
        return out


def _constant(values: torch.Tensor) -> bool:
    flat = values.detach().reshape(-1)
    return bool(torch.allclose(flat, flat[:1].expand_as(flat), rtol=1e-6, atol=0.0))
