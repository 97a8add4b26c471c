"""Problem description for federated linear attention (docs/theory.md, section 1).

A :class:`Problem` is data: dimensions, client weights, covariances and teachers, ridge
parameters and noise. :func:`make_problem` builds one from the heterogeneity knobs with a seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from linattn_theory.errors import ParameterError, require


@dataclass(frozen=True)
class TeacherProducts:
    """Products of the covariances and teachers that the closed forms reuse (computed once).

    Per client (shapes (C, d, .)): S V* (and its transpose), S M*, S M* S, S M* S V*,
    S M*^T S, the Cholesky factor R of S = R R^T and its transpose, and c_m (eq. 6). Pooled
    over clients with the weights p: ``linear_map``, the matrix of the linear map
    M -> C(M) = sum_m p_m C_m(M) of eq. (10) on row-major vec(M), shape (d d_y, d^2), so that
    C(M) = (linear_map @ M.ravel()).reshape(d, d_y) and, by adjointness, the teacher part of
    grad_M F is -(linear_map.T @ V.ravel()); ``base`` = sum_m p_m c_m.
    """

    constants: np.ndarray
    sw: np.ndarray
    sw_t: np.ndarray
    sms: np.ndarray
    smss: np.ndarray
    smsw: np.ndarray
    smts: np.ndarray
    chol: np.ndarray
    chol_t: np.ndarray
    linear_map: np.ndarray
    base: float


@dataclass(frozen=True, eq=False)
class Problem:
    """A federated linear-attention regression problem (eqs. 1-3).

    Client m draws n context tokens and a query i.i.d. N(0, Sigma_m) and observes
    ``y^T = x_q^T M*_m Sigma_hat V*_m + eps^T`` with ``eps ~ N(0, s^2 I)``.

    Attributes
    ----------
    dim : int
        Token dimension d.
    out_dim : int
        Output dimension d_y.
    context_length : int
        Number of context tokens n (>= 1).
    weights : ndarray, shape (C,)
        Client weights p_m, positive, summing to 1.
    covariances : ndarray, shape (C, d, d)
        Token covariances Sigma_m, symmetric positive definite.
    kernel_teachers : ndarray, shape (C, d, d)
        Teacher kernels M*_m.
    value_teachers : ndarray, shape (C, d, d_y)
        Teacher value blocks V*_m.
    ridge : float
        lambda, the ridge on V in F (eq. 3).
    kernel_ridge : float
        lambda_M, the ridge on M in F (eq. 3; our addition, see eq. 12 for why).
    noise : float
        Output noise standard deviation s.
    knobs : dict
        The heterogeneity knobs used to build it (zeta_K, zeta_V, rho, seed), for provenance.
    """

    dim: int
    out_dim: int
    context_length: int
    weights: np.ndarray
    covariances: np.ndarray
    kernel_teachers: np.ndarray
    value_teachers: np.ndarray
    ridge: float = 1e-2
    kernel_ridge: float = 1e-2
    noise: float = 0.1
    knobs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(isinstance(self.dim, int | np.integer) and self.dim >= 1, "dim", self.dim,
                "an integer >= 1")
        require(isinstance(self.out_dim, int | np.integer) and self.out_dim >= 1, "out_dim",
                self.out_dim, "an integer >= 1")
        require(isinstance(self.context_length, int | np.integer) and self.context_length >= 1,
                "context_length", self.context_length, "an integer n >= 1")
        d, dy = self.dim, self.out_dim
        w = np.asarray(self.weights, dtype=np.float64)
        require(w.ndim == 1 and w.size >= 1, "weights", w.shape,
                "a 1-d array with one entry per client")
        c = w.size
        require(bool(np.all(w > 0)) and abs(w.sum() - 1.0) < 1e-9, "weights", w,
                "positive and summing to 1")
        require(bool(np.all(np.isfinite(w))), "weights", w, "finite")
        for name, arr, shape in (
            ("covariances", self.covariances, (c, d, d)),
            ("kernel_teachers", self.kernel_teachers, (c, d, d)),
            ("value_teachers", self.value_teachers, (c, d, dy)),
        ):
            if np.shape(arr) != shape:
                raise ParameterError(
                    f"{name} has shape {np.shape(arr)}; expected {shape} "
                    f"(clients={c}, dim={d}, out_dim={dy})"
                )
            bad = np.argwhere(~np.isfinite(np.asarray(arr, dtype=np.float64)))
            if bad.size:
                raise ParameterError(f"{name}[{', '.join(str(int(i)) for i in bad[0])}] is "
                                     f"{np.asarray(arr)[tuple(bad[0])]}; every entry of {name} "
                                     "must be a finite number")
        cov = np.asarray(self.covariances, dtype=np.float64)
        require(np.allclose(cov, np.swapaxes(cov, 1, 2), atol=1e-10), "covariances",
                "non-symmetric", "symmetric positive definite")
        require(bool(np.all(np.linalg.eigvalsh(cov) > 0)), "covariances", "not positive definite",
                "symmetric positive definite")
        for name in ("ridge", "kernel_ridge", "noise"):
            val = getattr(self, name)
            require(np.isfinite(val) and val >= 0, name, val, ">= 0 and finite")
        for name in ("weights", "covariances", "kernel_teachers", "value_teachers"):
            arr = np.array(getattr(self, name), dtype=np.float64)
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)

    @property
    def num_clients(self) -> int:
        return int(self.weights.size)

    @cached_property
    def teacher_products(self) -> TeacherProducts:
        """Products of Sigma_m, M*_m, V*_m that the closed forms reuse (computed once)."""
        s, ms, vs = self.covariances, self.kernel_teachers, self.value_teachers
        c, d, dy, n = self.num_clients, self.dim, self.out_dim, self.context_length
        p = self.weights
        sms = s @ ms
        sw = s @ vs
        smss = sms @ s
        smsw = sms @ sw
        smts = s @ np.swapaxes(ms, 1, 2) @ s
        chol = np.linalg.cholesky(s)
        from linattn_theory.moments import fourth_moment

        g_star = fourth_moment(np.swapaxes(ms, 1, 2) @ s @ ms, s, n)
        constants = 0.5 * np.einsum("cia,cij,cja->c", vs, g_star, vs)
        constants = constants + 0.5 * self.out_dim * self.noise**2
        # C(M) = sum_m p_m [S M^T (S M* S V*) + (S M*^T S) M (S V*)/n + <M, S M* S> S V*/n]
        pw = p[:, None]
        first = ((pw * s.reshape(c, d * d)).T @ smsw.reshape(c, d * dy)).reshape(d, d, d, dy)
        second = ((pw * smts.reshape(c, d * d)).T @ sw.reshape(c, d * dy)).reshape(d, d, d, dy)
        third = ((pw * sw.reshape(c, d * dy)).T @ smss.reshape(c, d * d)).reshape(d, dy, d, d)
        linear = (first.transpose(0, 3, 2, 1) + (second.transpose(0, 3, 1, 2) + third) / n)
        return TeacherProducts(constants=constants, sw=sw, sw_t=np.swapaxes(sw, 1, 2).copy(),
                               sms=sms, smss=smss, smsw=smsw, smts=smts, chol=chol,
                               chol_t=np.swapaxes(chol, 1, 2).copy(),
                               linear_map=linear.reshape(d * dy, d * d),
                               base=float(p @ constants))

    def to_dict(self) -> dict:
        return {
            "dim": int(self.dim),
            "out_dim": int(self.out_dim),
            "context_length": int(self.context_length),
            "weights": self.weights.tolist(),
            "covariances": self.covariances.tolist(),
            "kernel_teachers": self.kernel_teachers.tolist(),
            "value_teachers": self.value_teachers.tolist(),
            "ridge": float(self.ridge),
            "kernel_ridge": float(self.kernel_ridge),
            "noise": float(self.noise),
            "knobs": dict(self.knobs),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Problem:
        """A problem from a mapping: explicit arrays (as :meth:`to_dict` writes) or
        ``{make_problem: {...}}`` with :func:`make_problem`'s arguments. Every error names the
        key."""
        if "make_problem" in data:
            args = data["make_problem"]
            if not isinstance(args, dict):
                raise ParameterError(f"make_problem={args!r} must be a mapping of make_problem() "
                                     "arguments (dim, num_clients, ...)")
            unknown = sorted(set(args) - set(_MAKE_PROBLEM_ARGS))
            if unknown:
                raise ParameterError(f"unknown key make_problem.{unknown[0]}; valid: "
                                     f"{', '.join(_MAKE_PROBLEM_ARGS)}")
            return make_problem(**args)
        keys = ("dim", "out_dim", "context_length", "weights", "covariances", "kernel_teachers",
                "value_teachers")
        missing = [k for k in keys if k not in data]
        if missing:
            raise ParameterError(
                f"problem description lacks {missing}; give all of {list(keys)} "
                "or a 'make_problem' mapping of make_problem() arguments"
            )
        knobs = data.get("knobs", {})
        require(isinstance(knobs, dict), "knobs", knobs, "a mapping")
        return cls(
            dim=_integer(data, "dim"),
            out_dim=_integer(data, "out_dim"),
            context_length=_integer(data, "context_length"),
            weights=_array(data, "weights"),
            covariances=_array(data, "covariances"),
            kernel_teachers=_array(data, "kernel_teachers"),
            value_teachers=_array(data, "value_teachers"),
            ridge=_number(data, "ridge", 1e-2),
            kernel_ridge=_number(data, "kernel_ridge", _number(data, "ridge", 1e-2)),
            noise=_number(data, "noise", 0.1),
            knobs=dict(knobs),
        )


def _is_number(value) -> bool:
    return isinstance(value, int | float | np.number) and not isinstance(value, bool)


def _integer(data: dict, key: str) -> int:
    value = data[key]
    require(isinstance(value, int | np.integer) and not isinstance(value, bool), key, value,
            "an integer >= 1")
    return int(value)


def _number(data: dict, key: str, default: float) -> float:
    value = data.get(key, default)
    require(_is_number(value) and np.isfinite(value), key, value, "a finite number >= 0")
    return float(value)


def _array(data: dict, key: str) -> np.ndarray:
    try:
        return np.asarray(data[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise ParameterError(f"{key} is not an array of numbers (ragged rows, or entries that "
                             "are not numbers); give a nested list of numbers of equal "
                             "lengths") from None


def _centered(rng: np.random.Generator, weights: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Random per-client perturbations with sum_m p_m X_m = 0 and E||X_m||_F^2 ~ 1."""
    raw = rng.standard_normal((weights.size, *shape)) / np.sqrt(shape[0])
    return raw - np.tensordot(weights, raw, axes=1)[None]


def make_problem(
    dim: int = 8,
    num_clients: int = 10,
    context_length: int = 16,
    out_dim: int = 1,
    kernel_heterogeneity: float = 0.5,
    value_heterogeneity: float = 0.5,
    covariate_shift: float = 0.0,
    ridge: float = 1e-2,
    kernel_ridge: float | None = None,
    noise: float = 0.1,
    weights: str | np.ndarray = "uniform",
    seed: int = 0,
) -> Problem:
    """Build a :class:`Problem` from the heterogeneity knobs (section 1 of docs/theory.md).

    ``M*_m = M* + zeta_K Delta_m`` and ``V*_m = V* + zeta_V Gamma_m`` with
    ``sum_m p_m Delta_m = 0 = sum_m p_m Gamma_m``; ``Sigma_m = expm(rho S_m)`` with S_m a
    random symmetric matrix of unit scale (rho = 0 gives Sigma_m = I).

    Parameters
    ----------
    dim, num_clients, context_length, out_dim : int
        d, C, n, d_y.
    kernel_heterogeneity, value_heterogeneity, covariate_shift : float
        zeta_K, zeta_V, rho (all >= 0).
    ridge, kernel_ridge : float
        lambda and lambda_M; ``kernel_ridge=None`` takes ``ridge``.
    noise : float
        s.
    weights : "uniform", "random" or array
        Client weights p_m ("random": Dirichlet(2) draws).
    seed : int
        Seed of the numpy Generator that draws everything.
    """
    require(isinstance(dim, int | np.integer) and dim >= 1, "dim", dim, "an integer >= 1")
    require(isinstance(num_clients, int | np.integer) and num_clients >= 1, "num_clients",
            num_clients, "an integer >= 1")
    require(isinstance(context_length, int | np.integer) and context_length >= 1,
            "context_length", context_length, "an integer n >= 1")
    for name, val in (("kernel_heterogeneity", kernel_heterogeneity),
                      ("value_heterogeneity", value_heterogeneity),
                      ("covariate_shift", covariate_shift)):
        require(_is_number(val) and np.isfinite(val) and val >= 0, name, val,
                ">= 0 (0 is the i.i.d. case)")
    require(isinstance(out_dim, int | np.integer) and out_dim >= 1, "out_dim", out_dim,
            "an integer >= 1")
    require(isinstance(seed, int | np.integer) and not isinstance(seed, bool) and seed >= 0,
            "seed", seed, "an integer >= 0")
    for name, val in (("ridge", ridge), ("noise", noise), ("kernel_ridge", kernel_ridge)):
        require(val is None and name == "kernel_ridge" or _is_number(val) and np.isfinite(val)
                and val >= 0, name, val, ">= 0 and finite")
    rng = np.random.default_rng(seed)
    if isinstance(weights, str):
        if weights == "uniform":
            p = np.full(num_clients, 1.0 / num_clients)
        elif weights == "random":
            p = rng.dirichlet(np.full(num_clients, 2.0))
        else:
            raise ParameterError(f"weights={weights!r}; allowed: 'uniform', 'random' or an array")
    else:
        p = _array({"weights": weights}, "weights")
        require(p.shape == (num_clients,), "weights", p.shape, f"shape ({num_clients},)")
        require(bool(np.all(np.isfinite(p) & (p > 0))), "weights", p, "positive and finite")
        p = p / p.sum()
    m_star = rng.standard_normal((dim, dim)) / np.sqrt(dim)
    v_star = rng.standard_normal((dim, out_dim)) / np.sqrt(dim)
    delta = _centered(rng, p, (dim, dim))
    gamma = _centered(rng, p, (dim, out_dim))
    sym = rng.standard_normal((num_clients, dim, dim))
    sym = (sym + np.swapaxes(sym, 1, 2)) / (2.0 * np.sqrt(2.0 * dim))
    # scipy is imported on use (here, in frozen.py and in profile.py): `linattn warmup`
    # from constants alone then imports numpy only (0.4 s less start-up)
    from scipy.linalg import expm

    cov = np.stack([expm(covariate_shift * s) for s in sym])
    cov = 0.5 * (cov + np.swapaxes(cov, 1, 2))
    return Problem(
        dim=int(dim),
        out_dim=int(out_dim),
        context_length=int(context_length),
        weights=p,
        covariances=cov,
        kernel_teachers=m_star[None] + kernel_heterogeneity * delta,
        value_teachers=v_star[None] + value_heterogeneity * gamma,
        ridge=float(ridge),
        kernel_ridge=float(ridge if kernel_ridge is None else kernel_ridge),
        noise=float(noise),
        knobs={
            "kernel_heterogeneity": float(kernel_heterogeneity),
            "value_heterogeneity": float(value_heterogeneity),
            "covariate_shift": float(covariate_shift),
            "seed": int(seed),
            "weights": weights if isinstance(weights, str) else "array",
        },
    )


_MAKE_PROBLEM_ARGS = ("dim", "num_clients", "context_length", "out_dim", "kernel_heterogeneity",
                      "value_heterogeneity", "covariate_shift", "ridge", "kernel_ridge", "noise",
                      "weights", "seed")
