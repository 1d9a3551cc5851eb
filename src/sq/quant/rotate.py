"""Orthogonal rotations of the residual stream and of attention heads: the maths, free of plumbing.

A rotation ``Q`` (orthogonal, ``Q Q^T = I``) moves the residual stream ``x`` to ``x Q``.  A Linear that
reads the stream after a root-mean-square norm with per-channel scale ``g`` then computes the same
outputs from ``W diag(g) Q`` on the rotated stream with the norm's scale set to one (the norm commutes
with ``Q``: it divides by a length ``Q`` keeps); a Linear that writes into the stream (``o_proj``,
``down_proj``) writes rotated outputs with ``Q^T W`` (and ``Q^T b``).  Per attention head, ``v_proj``'s
rows of each head take ``H^T`` and ``o_proj``'s columns of each head ``H``: the attention mixes a head's
values by scalars, which commute with ``H``.  Nothing is left to do at serving time for those.

R4 is the one online rotation: ``down_proj``'s input ``x`` (the MLP's intermediate activations) becomes
``x Q`` at run time and its weight ``W Q`` offline, so that ``(x Q)(W Q)^T = x W^T``.  ``Q`` is
block-diagonal with one ``b x b`` block ``diag(s) H_b / sqrt(b)`` repeated (``online_hadamard``): the
form compressed-tensors' ``transform_config`` describes (``head_dim = b``) and vLLM applies.

``orthogonal(n, seed)`` is a randomized Hadamard matrix ``diag(s) H / sqrt(n)`` where a Hadamard
matrix of order ``n`` can be built here (Sylvester's powers of two, Paley's constructions for primes,
and Kronecker products of those: 576, 896, 1536, 2048, 2560, 2880, 3584, 4096, 5120, 7168, ... and the
head sizes 64, 80, 96, 112, 128), else a random orthogonal matrix (QR of a Gaussian one): spreading an
outlier channel over every channel is what makes the rotated weights and activations easier to quantize.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["ROTATIONS", "hadamard", "orthogonal", "online_hadamard", "rotate_input", "rotate_output",
           "rotate_head_rows", "rotate_head_columns"]


# --rotate words: the residual stream (R1), each attention head's values (R2), down_proj's input online (R4)
ROTATIONS = ("r1", "r2", "r4")


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = chi(j - i)``, chi the quadratic character modulo the prime ``q``."""
    squares = {(k * k) % q for k in range(1, q)}
    chi = torch.tensor([0] + [1 if r in squares else -1 for r in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` by Paley's constructions over a prime field, or None."""
    q = n - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: I + [[0, 1^T], [-1, Q]]
        s = torch.zeros(n, n, dtype=torch.float64)
        s[0, 1:] = 1
        s[1:, 0] = -1
        s[1:, 1:] = _jacobsthal(q)
        return _checked(torch.eye(n, dtype=torch.float64) + s)
    q = n // 2 - 1
    if n % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II: C = [[0, 1^T], [1, Q]] with 2x2 blocks
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:] = 1
        c[1:, 0] = 1
        c[1:, 1:] = _jacobsthal(q)
        zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        return _checked(torch.kron((c == 0).double(), zero) + torch.kron(c, one))
    return None


def _checked(h: torch.Tensor) -> torch.Tensor:
    n = h.shape[0]
    if not torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)):
        raise AssertionError(f"Paley construction of order {n} is not a Hadamard matrix")
    return h


@functools.lru_cache(maxsize=64)
def _hadamard(n: int) -> torch.Tensor | None:
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if n == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    if n % 4:
        return None  # no Hadamard matrix of an order other than 1, 2 or a multiple of 4
    h = _paley(n)
    if h is not None:
        return h
    for d in range(2, math.isqrt(n) + 1):
        if n % d == 0:
            a, b = _hadamard(d), _hadamard(n // d)
            if a is not None and b is not None:
                return torch.kron(a, b)
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of order ``n`` (``H H^T = n I``, float64), or None where none is built here.
    Each Paley matrix is checked when built (a Kronecker product of Hadamard matrices is one)."""
    h = _hadamard(n)
    return None if h is None else h.clone()


def orthogonal(n: int, seed: int, block: int | None = None) -> tuple[torch.Tensor, str]:
    """``(Q [n, n] float64 orthogonal, kind)``: ``diag(s) H / sqrt(n)`` with random signs ``s`` (kind
    ``"hadamard"``), or the Q of a Gaussian matrix's QR with R's diagonal made positive (``"random"``).
    ``block`` (dividing ``n``): block-diagonal, ``I ⊗ H_block`` under ``n`` random signs, so that each
    group of ``block`` channels is mixed only within itself (what a format with per-group scales over
    the same groups keeps: one outlier spreads over its own group, not over every group).
    The same arguments give the same matrix on every rank and machine (a CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    b = n if block is None else block
    if n % b:
        raise ValueError(f"rotation block {b} does not divide {n}")
    h = hadamard(b)
    if h is not None:
        signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
        return signs[:, None] * torch.kron(torch.eye(n // b, dtype=torch.float64), h / math.sqrt(b)), "hadamard"
    a = torch.randn(b, b, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r))[None, :]
    return torch.kron(torch.eye(n // b, dtype=torch.float64), q), "random"


def online_hadamard(n: int, seed: int, block: int | None = None) -> torch.Tensor | None:
    """The ``b x b`` block (``b = block or n``, float64, orthogonal) of an online rotation over ``n``
    channels: ``diag(s) H_b / sqrt(b)`` with random signs ``s``, or None where no Hadamard matrix of order
    ``b`` is built here.  Its entries are ``±1 / sqrt(b)``: ``sqrt(b)`` times it is exact in any float
    dtype, which is what a checkpoint stores (compressed-tensors' transform weights are unnormalized)."""
    b = n if block is None else block
    if n % b:
        raise ValueError(f"rotation block {b} does not divide {n}")
    h = hadamard(b)
    if h is None:
        return None
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (b,), generator=g).double() * 2 - 1
    return signs[:, None] * h / math.sqrt(b)


def _work(w: torch.Tensor) -> torch.dtype:
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def rotate_input(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``w [..., in] -> (w * scale) @ q`` in ``w``'s dtype (computed in float32): a reader of the rotated
    stream, a norm's per-channel ``scale`` folded in first."""
    dt = _work(w)
    x = w.to(dt)
    if scale is not None:
        x = x * scale.to(dt)
    return (x @ q.to(dt)).to(w.dtype)


def rotate_output(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``w [..., out, in] -> q^T @ w`` (a bias ``[..., out]`` too): a writer into the rotated stream."""
    dt = _work(w)
    if w.dim() == 1:
        return (w.to(dt) @ q.to(dt)).to(w.dtype)
    return (q.to(dt).T @ w.to(dt)).to(w.dtype)


def rotate_head_rows(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``v_proj``'s rows (or bias) ``[heads * d, ...]``: each head's ``d`` rows -> ``h^T`` times them."""
    d, dt = h.shape[0], _work(w)
    x = w.to(dt).reshape(w.shape[0] // d, d, -1)
    return (h.to(dt).T @ x).reshape(w.shape).to(w.dtype)


def rotate_head_columns(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``o_proj``'s columns ``[out, heads * d]``: each head's ``d`` columns -> times ``h``."""
    d, dt = h.shape[0], _work(w)
    x = w.to(dt).reshape(w.shape[0], w.shape[1] // d, d)
    return (x @ h.to(dt)).reshape(w.shape).to(w.dtype)
