"""The validation grid of :mod:`simulations.validate`: its points, their problems and settings.

A point of the grid is (heterogeneity zeta, local steps K, step size eta), with variants of
the context length n, the client count C and the covariate shift rho; :class:`ProblemCache`
builds each distinct problem once, so settings that share it share its data sets.
"""

from __future__ import annotations

from dataclasses import dataclass

from linattn_theory.problem import make_problem
from simulations.engine import Setting


@dataclass(frozen=True)
class Grid:
    """The validation grid. Problem: d, C, n, rho, lambda = lambda_M, s; schedule: T, B, N.

    Base factorial: heterogeneity (zeta_K = zeta_V = zeta) x local_steps x lr; variants of the
    context length n and the client count C at (``variant_heterogeneity``, K=5, eta=0.05).
    """

    dim: int = 6
    num_clients: int = 8
    context_length: int = 16
    covariate_shift: float = 0.5
    ridge: float = 0.01
    noise: float = 0.1
    problem_seed: int = 0
    total_rounds: int = 60
    heterogeneity: tuple = (0.0, 0.5, 1.0)
    local_steps: tuple = (2, 5, 10)
    lr: tuple = (0.05, 0.1)
    context_variants: tuple = (8, 32)
    client_variants: tuple = (4, 16)
    variant_heterogeneity: float = 1.0
    iid_points: tuple = ((5, 0.1), (10, 0.1))
    batch_size: int = 32
    samples_per_client: int = 2048
    test_samples: int = 128
    seeds: int = 8
    warmup_grid: tuple = (0, 1, 2, 3, 4, 6, 8, 11, 16, 22, 30, 42, 60)
    p1_batch_size: int = 256
    p1_points: tuple = ((0.5, 5, 0.05), (0.5, 5, 0.1), (1.0, 5, 0.05), (1.0, 5, 0.1))
    floor_points: tuple = ((0.5, 5, 0.1), (1.0, 5, 0.1), (1.0, 10, 0.05))
    floor_warmup: int = 16
    floor_rounds: int = 160
    floor_batch_sizes: tuple = (32, 256)
    p6_points: tuple = ((0.5, 5, 0.05), (0.5, 5, 0.1), (1.0, 5, 0.05), (1.0, 5, 0.1))

    @classmethod
    def quick(cls) -> Grid:
        """A small grid for tests (seconds): same checks, fewer and shorter runs."""
        return cls(dim=4, num_clients=4, context_length=8, total_rounds=24,
                   heterogeneity=(0.0, 1.0), local_steps=(2, 5), lr=(0.1,),
                   context_variants=(), client_variants=(), samples_per_client=256,
                   test_samples=32, seeds=4, warmup_grid=(0, 2, 4, 8, 12, 16, 24),
                   p1_batch_size=64, p1_points=((1.0, 5, 0.1),), floor_points=((1.0, 5, 0.1),),
                   floor_warmup=8, floor_rounds=48, floor_batch_sizes=(32,),
                   iid_points=((5, 0.1),), p6_points=((1.0, 5, 0.1),))


class ProblemCache:
    """make_problem per (zeta, n, C), built once, so that settings share data sets."""

    def __init__(self, grid: Grid):
        self.grid, self.cache = grid, {}

    def get(self, zeta, n=None, c=None, rho=None):
        g = self.grid
        rho = g.covariate_shift if rho is None else rho
        key = (zeta, n or g.context_length, c or g.num_clients, rho)
        if key not in self.cache:
            self.cache[key] = make_problem(dim=g.dim, num_clients=key[2], context_length=key[1],
                                           kernel_heterogeneity=zeta, value_heterogeneity=zeta,
                                           covariate_shift=rho, ridge=g.ridge,
                                           noise=g.noise, seed=g.problem_seed)
        return self.cache[key]


def make_setting(grid, problems, zeta, k, lr, n=None, c=None, rho=None, **kw) -> Setting:
    """The grid's setting at heterogeneity ``zeta``, K = ``k`` and eta = ``lr`` (and context
    length ``n``, client count ``c``, covariate shift ``rho`` where given); ``kw`` overrides
    :class:`~simulations.engine.Setting` fields. The label names the point."""
    label = (f"zeta={zeta:g},K={k},lr={lr:g}" + (f",n={n}" if n else "") + (f",C={c}" if c else "")
             + (f",rho={rho:g}" if rho is not None else ""))
    args = dict(problem=problems.get(zeta, n, c, rho), lr=lr, local_steps=k,
                batch_size=grid.batch_size, total_rounds=grid.total_rounds,
                warmup_rounds=tuple(grid.warmup_grid), samples_per_client=grid.samples_per_client,
                test_samples=grid.test_samples, label=label)
    args.update(kw)
    if "parametrization" in kw:
        args["label"] = label + f",{kw['parametrization']}"
    return Setting(**args)


def grid_settings(grid: Grid, problems: ProblemCache) -> list[Setting]:
    """The grid's settings: the base factorial, then the context-length, client-count and
    IID variants."""
    out = [make_setting(grid, problems, z, k, lr) for z in grid.heterogeneity
           for k in grid.local_steps for lr in grid.lr]
    vz = grid.variant_heterogeneity
    out += [make_setting(grid, problems, vz, 5, 0.05, n=n) for n in grid.context_variants]
    out += [make_setting(grid, problems, vz, 5, 0.05, c=c) for c in grid.client_variants]
    out += [make_setting(grid, problems, 0.0, k, lr, rho=0.0) for k, lr in grid.iid_points]
    return out
