"""The kernel profile Phi(M) of a real network, by its definition (THEORY.md section 5).

Phi(M) is the validation loss reached when the query/key block (the parameter group of kind
``qk``: every layer's ``attn.q`` and ``attn.k`` weights and biases, the "kernel" M) is frozen at
M and every other parameter trains on the POOLED training data of a run: every client's
training samples, with the run's validation split held out exactly as the run held it out (the
run's ``partition.npz``, or the same partition rebuilt from its config). The loss is read on
that validation split; the test set is never read.

Phi depends on M alone, for a given run config:

- every parameter other than Q/K starts from the run's initial parameters for its seed (the
  round-0 global model: the model built from ``seeds.training``, after ``train.init_from`` or
  the algorithm's own initialization), whatever the snapshot holding M carries for them;
- the budget is fixed (:class:`Budget`): ``steps`` minibatch steps of ``batch_size`` samples
  (default: the run's ``train.batch_size``) with the budget's optimizer: ``"run"`` (the
  default), the run's own optimizer (``train.optimizer``, ``train.momentum``,
  ``train.weight_decay``, ``train.clip_grad_norm``) at the step size ``lr`` (default: the
  run's ``train.lr``; the run's own learning-rate schedule is not applied); or ``"adam"``,
  ``torch.optim.Adam`` (betas 0.9/0.999, eps 1e-8, the run's ``train.weight_decay`` and
  ``train.clip_grad_norm``) at the step size ``lr`` (default 1e-3). The step size is either
  constant or (``schedule="cosine"``) decayed as
  ``lr * (1 + cos(pi * t / steps)) / 2`` at step t = 0 .. steps - 1, so the budget ends at a
  step size near 0 and Phi approaches the minimum over the other parameters instead of
  stopping at the noise level of a constant step;
- the minibatches are fixed too: passes over the pooled training samples, each a permutation
  drawn from ``numpy.random.default_rng([seed, PROFILE_STREAM])`` (``seed``: the run's
  training seed unless the budget names one) and cut into full batches, the tail of a pass
  dropped; a new pass starts when one is used up. Dropout (where the model has it) draws from
  ``torch.manual_seed(seed)``.

Training runs in float32 (float64 for a ``precision: fp64`` run), without autocast unless the
budget asks for it (``Budget.precision``: TF32 matmuls or bf16 autocast on a float32 run; the
validation loss always read in float32), on ``train.device`` unless a device is given.
Several kernels train side by side (their parameters stacked, one gradient step for all on
the same minibatch, :func:`kernel_grads`: the engines' stacked forward for the ViT and the
character model without dropout, else a ``vmap``-ed gradient; the optimizer rules of
:mod:`real_data.engines.optim`); a kernel's Phi does not depend on the others in its stack, up
to floating-point round-off, and the record names the path (``grad_path``). The model is the
plain network: an algorithm's own forward (FedTP's hypernetwork, FedSQ's structure) is not
used.

**The rule that reads Phi** (``phi_rule``). ``"min"`` (the commands' default): the validation
loss is evaluated every ``eval_every`` steps (the checkpoints of a budget of n steps: the
multiples of ``eval_every`` up to n, and n itself) and Phi is its minimum over the checkpoints,
i.e. early stopping on the validation split; the record keeps the step of the minimum
(``phi_step``), the accuracy there (``val_acc``), the last step's loss and accuracy
(``val_loss_last``, ``val_acc_last``) and the whole curve (``val_curve``: ``[step, loss, acc]``
per checkpoint). Evaluating does not change the training (no random numbers are drawn), so
``val_loss_last`` is the ``"last"`` rule's Phi to the bit. ``"last"`` (the :class:`Budget`
dataclass' default, the rule of every record without a ``phi_rule`` key): Phi is the
validation loss after the last step. The validation loss of the study's ViT turns up within
the budgets a doubling check needs (``docs/study/phi_budget/phi_budget.md``), so the last
step's loss has no limit to converge to; the minimum does not grow with the budget at a
constant step size (a doubled budget's checkpoints include those of the budget), and once the
minimum lies inside the budget, doubling leaves it where it is: Adam at a constant lr 2e-3,
batch 2,048, 1,600 steps, read every 50, converges so on the P3 plan's linear main point
(minima at step 850 to 1,400; ``phi_budget.md``). The default
cadence, :data:`DEFAULT_EVAL_EVERY` = 250 steps (``steps`` when the budget is shorter), reads
the curve about 7 times per pass over the study's 54,000 pooled samples at batch 32; on the
study's ViT, reading the measured curves every 500, 1,000 or 2,000 steps instead moves Phi by
up to 0.03%, 0.25% and 1.2%, so 250 resolves the minimum far below the check's 1%. On one
CPU thread an evaluation of the 6,000 validation samples for a stack of two kernels costs
7.6 s, about 80 of its training steps (0.094 s each), so the cadence adds about 30% there
(``docs/study/phi_budget/phi_budget.md``).

**Convergence check.** Phi at twice the budget: at a constant step size the same training
continued to ``2 * steps`` (the step-``steps`` state is a prefix of the doubled budget's, so the
doubled run costs ``steps`` more steps); under the cosine schedule a second training of
``2 * steps`` steps with the cosine stretched over them (the same minibatches first), so the
check costs ``2 * steps`` more; ``relative_change = |Phi(2N) - Phi(N)| / |Phi(N)|`` (each
read by the budget's rule, the doubled budget at the same cadence) is reported with
``converged = relative_change < 0.01`` (THEORY.md asks for < 1%). A kernel whose check fails
is reported as such, never dropped.

``linattn profile --run RUN_DIR --rounds 0,20,50`` evaluates Phi at a run's warm-up snapshots
``checkpoints/round_<t>.pt``; ``--kernel FILE`` at any checkpoint (another run's, e.g. a
drift-free reference's) under this run's config.

**A killed call resumes.** With a place to keep it (``linattn profile --json OUT``: OUT's
folder; ``linattn study --profile``: the cell's cache folder), a stack saves its progress every
:data:`SAVE_EVERY` seconds and after each training (``partial_<digest>.pt``: the parameters,
the optimizer's state, the step, the reads so far and the random state), and the same call
started again resumes it: the same minibatches from the saved step on, so the records equal an
uninterrupted stack's (``tests/real_data/test_kernel_profile.py``, to the bit on the CPU).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from linattn.errors import ConfigError, UserError

PROFILE_STREAM = 20231  # the minibatch stream's second seed word (apart from training's)
TOLERANCE = 0.01  # the doubled-budget check: relative change of Phi below 1%
DEFAULT_STEPS = 4000
SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("run", "adam")
PRECISIONS = ("fp32", "tf32", "bf16")  # the training's arithmetic (Budget.precision)
ADAM_LR = 1e-3  # Adam's step size when the budget names none
PHI_RULES = ("min", "last")
DEFAULT_EVAL_EVERY = 250  # the min rule's cadence when the budget names none (module docstring)


@dataclass(frozen=True)
class Budget:
    """How the parameters other than Q/K train for Phi.

    Attributes
    ----------
    steps : int
        Minibatch steps N (Phi is read at N; the check at 2N).
    lr : float or None
        Step size (the schedule's start); ``None``: the run's ``train.lr`` for ``"run"``,
        :data:`ADAM_LR` for ``"adam"``.
    batch_size : int or None
        Samples per step; ``None``: the run's ``train.batch_size``.
    seed : int or None
        Seed of the minibatch order and dropout; ``None``: the run's training seed.
    check : bool
        Also train to ``2 * steps`` and report the relative change (the convergence check).
        Without it (``--no-check``) a kernel costs half (a constant step) or a third (the
        cosine) of the checked budget; its record holds Phi at N, no verdict (``converged``
        None), and its cache file a name of its own (``_nocheck``). A checked record of the
        same budget holds Phi at N of the same training (up to the round-off of the stack it
        trained in), so the study's tables read one where no unchecked record exists, and a
        checked stack's saved progress within its first N steps resumes the unchecked one.
    schedule : {"constant", "cosine"}
        The step size over the budget: constant, or a cosine from ``lr`` to 0 over ``steps``
        (the module docstring).
    optimizer : {"run", "adam"}
        ``"run"``: the run's optimizer settings (``train.optimizer``, ``train.momentum``,
        ``train.weight_decay``); ``"adam"``: ``torch.optim.Adam`` (betas 0.9/0.999, eps 1e-8,
        the run's weight decay). Both clip as the run does (``train.clip_grad_norm``).
    phi_rule : {"last", "min"}
        How Phi is read (the module docstring): the validation loss after the last step
        (``"last"``, this class' default, so that a ``Budget`` built without the field reads
        and caches as it always did), or its minimum over the checkpoints every
        ``eval_every`` steps (``"min"``, the commands' default).
    precision : {"fp32", "tf32", "bf16"}
        The training's arithmetic on a float32 run: float32 (the default), float32 with
        TF32 matmuls on CUDA (``torch.backends.cuda.matmul.allow_tf32``), or the gradients
        under bf16 autocast (float32 parameters and optimizer state). The validation loss is
        always read in float32. A float64 run takes ``"fp32"`` only (its own precision).
    eval_every : int or None
        The ``"min"`` rule's cadence: ``None`` gives :data:`DEFAULT_EVAL_EVERY`, or ``steps``
        when the budget is shorter; a given value must lie in 1 .. ``steps``. Only with
        ``"min"`` (``None`` with ``"last"``).
    """

    steps: int = DEFAULT_STEPS
    lr: float | None = None
    batch_size: int | None = None
    seed: int | None = None
    check: bool = True
    schedule: str = "constant"
    optimizer: str = "run"
    phi_rule: str = "last"
    eval_every: int | None = None
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(f"--steps (--profile-steps) {self.steps}: must be an integer "
                              ">= 1")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"--lr (--profile-lr) {self.lr}: must be > 0")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch-size (--profile-batch-size) {self.batch_size}: must "
                              "be >= 1")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"--schedule (--profile-schedule) {self.schedule!r}: must be one "
                              f"of {', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision (--profile-precision) {self.precision!r}: must be "
                              f"one of {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer (--profile-optimizer) {self.optimizer!r}: must be "
                              f"one of {', '.join(OPTIMIZERS)}")
        if self.phi_rule not in PHI_RULES:
            raise ConfigError(f"--phi-rule (--profile-phi-rule) {self.phi_rule!r}: must be one "
                              f"of {', '.join(PHI_RULES)}")
        every = self.eval_every
        if self.phi_rule == "last":
            if every is not None:
                raise ConfigError(f"--eval-every (--profile-eval-every) {every}: only with "
                                  "--phi-rule min (the last rule reads the last step alone)")
            return
        if every is None:
            object.__setattr__(self, "eval_every", min(DEFAULT_EVAL_EVERY, self.steps))
        elif isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"--eval-every (--profile-eval-every) {every}: must be an "
                              "integer >= 1")
        elif every > self.steps:
            raise ConfigError(f"--eval-every (--profile-eval-every) {every}: exceeds the "
                              f"budget of {self.steps} steps (--steps); give at most "
                              f"{self.steps}")

    def checkpoints(self, steps: int) -> tuple[int, ...]:
        """The steps at which a budget of ``steps`` steps reads the validation loss: the
        multiples of ``eval_every`` up to ``steps``, and ``steps`` (``"last"``: ``steps``)."""
        if self.phi_rule == "last":
            return (steps,)
        return tuple(sorted({*range(self.eval_every, steps + 1, self.eval_every), steps}))

    def step_size(self, lr: float, step: int, horizon: int) -> float:
        """The step size of step ``step`` (0-based) of a training of ``horizon`` steps."""
        if self.schedule == "constant":
            return lr
        return lr * 0.5 * (1.0 + float(np.cos(np.pi * step / horizon)))

    def tag(self) -> str:
        """A file-name part that names the budget (the profile cache's key)."""
        parts = [f"steps{self.steps}"]
        if self.lr is not None:
            parts.append(f"lr{self.lr:g}")
        if self.batch_size is not None:
            parts.append(f"bs{self.batch_size}")
        if self.seed is not None:
            parts.append(f"seed{self.seed}")
        if self.schedule != "constant":
            parts.append(self.schedule)
        if self.optimizer != "run":
            parts.append(self.optimizer)
        if self.precision != "fp32":
            parts.append(self.precision)
        if self.phi_rule != "last":  # the last rule keeps the key its records always had
            parts.append(f"{self.phi_rule}{self.eval_every}")
        if not self.check:
            parts.append("nocheck")
        return "_".join(parts)


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """``(steps, batch_size)`` positions into the pooled training samples (module docstring):
    successive permutations from ``default_rng([seed, PROFILE_STREAM])``, full batches only."""
    if batch_size > n:
        raise ConfigError(f"--batch-size {batch_size} exceeds the {n} pooled training samples")
    rng = np.random.default_rng([seed, PROFILE_STREAM])
    per_pass = n // batch_size
    out = []
    while len(out) < steps:
        perm = rng.permutation(n)
        out.extend(perm[: per_pass * batch_size].reshape(per_pass, batch_size))
    return np.stack(out[:steps])


@dataclass
class ProfileSetup:
    """A run config bound to its data, partition and initial parameters: Phi for many kernels
    without reloading anything (:func:`profile_setup`)."""

    cfg: object
    fed: object  # the run's Federation (model, data on the device, initial parameters)
    init: dict[str, torch.Tensor]
    qk_names: tuple[str, ...]
    pooled: np.ndarray  # pooled training indices into x_train, sorted

    def phi(self, kernel, budget: Budget, label: str = "") -> dict:
        """Phi of one kernel (a checkpoint path or a dict of Q/K tensors)."""
        return _profile_many(self, [(label, kernel)], budget)[0]

    def phi_many(self, kernels: list[tuple[str, object]], budget: Budget,
                 stack: int = 32, partial_dir: Path | None = None) -> list[dict]:
        """Phi of every ``(label, kernel)``, ``stack`` kernels trained side by side at a
        time (:func:`_profile_many`); with ``partial_dir``, each stack saves its progress
        there (:func:`partial_file`) and a killed call's stack resumes."""
        if stack < 1:
            raise ConfigError(f"--stack {stack}: must be >= 1")
        out = []
        for i in range(0, len(kernels), stack):
            chunk = kernels[i:i + stack]
            partial = None
            if partial_dir is not None:
                Path(partial_dir).mkdir(parents=True, exist_ok=True)
                partial = partial_file(partial_dir, chunk, budget)
            out += _profile_many(self, chunk, budget, partial=partial)
        return out


def profile_setup(cfg, dataset=None, partition=None, device: str | None = None
                  ) -> ProfileSetup:
    """Bind ``cfg`` (a run's config) to its data and partition (loaded here unless given) and
    its round-0 parameters. Raises UserError when the run holds out no validation split or its
    model has no Q/K block."""
    from real_data.device import resolve_device
    from real_data.federation import Federation
    from real_data.runs import load_data, make_partition_for, shifted

    if cfg.partition.validation_fraction is None:
        raise UserError("the run holds out no validation split (partition.validation_fraction "
                        "is null), so Phi has nothing to be read on; profile a run that holds "
                        "one out, e.g. partition.validation_fraction=0.1")
    if dataset is None:  # one data set kept: a plan's cells mostly share theirs
        key = repr(cfg.data)
        if _DATASET.get("key") != key:
            _DATASET.clear()
            _DATASET.update(key=key, data=load_data(cfg))
        dataset = _DATASET["data"]
    partition = make_partition_for(cfg, dataset) if partition is None else partition
    dataset, partition = shifted(cfg, dataset, partition)
    if cfg.train.precision == "bf16":  # Phi trains without autocast (module docstring)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="fp32"))
    fed = Federation(cfg, dataset, partition,
                     device=resolve_device(device or cfg.train.device))
    if not fed.qk_names:
        raise UserError(f"model {cfg.model.name} has no query/key block (no parameter group of "
                        "kind qk): it has no kernel to profile")
    init = {n: t.detach().clone() for n, t in fed.initial_state().global_params.items()}
    pooled = np.sort(np.concatenate([np.asarray(p, np.int64) for p in partition.train]))
    return ProfileSetup(cfg, fed, init, tuple(fed.qk_names), pooled)


_DATASET: dict = {}


def load_kernel(source, qk_names: tuple[str, ...], shapes: dict[str, tuple]
                ) -> tuple[dict[str, torch.Tensor], int | None]:
    """The Q/K tensors of ``source`` (a checkpoint path: a run's ``checkpoints/*.pt``, a packed
    archive's Q/K-only snapshot, a ``linattn pretrain`` file; or a dict of tensors) and the
    round it holds (None when unknown). Raises UserError naming the file when it is missing or
    has no Q/K tensors of this model."""
    where = "the kernel"
    rnd = None
    if isinstance(source, dict):
        params = source
    else:
        path = Path(source)
        where = str(path)
        if not path.is_file():
            raise UserError(f"{path}: no such snapshot; list the run's checkpoints/ folder "
                            "(a T0 family keeps checkpoints/round_<t>.pt at each of its T0)")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - truncated or foreign file
            raise UserError(f"{path}: not a readable checkpoint ({type(exc).__name__})") \
                from None
        if not isinstance(payload, dict):
            raise UserError(f"{path}: not a linattn checkpoint")
        params = payload.get("global_params", payload.get("params"))
        rnd = payload.get("round")
        if not isinstance(params, dict):
            raise UserError(f"{path}: holds no parameters (no global_params)")
    missing = [n for n in qk_names if n not in params]
    if missing:
        raise UserError(f"{where}: holds no Q/K tensors of this model (missing {missing[:3]}); "
                        "give a snapshot of a run with the same model")
    bad = [n for n in qk_names if tuple(params[n].shape) != tuple(shapes[n])]
    if bad:
        raise UserError(f"{where}: {bad[0]} has shape {tuple(params[bad[0]].shape)}, the "
                        f"model {tuple(shapes[bad[0]])}; give a snapshot of the same model")
    return {n: params[n].detach() for n in qk_names}, (int(rnd) if rnd is not None else None)


def grad_path(model, dropout: bool) -> str:
    """How a stack of kernels takes its gradients (:func:`kernel_grads`): ``"stacked"``, the
    stacked forward of :mod:`real_data.engines.stacked`, for the models it mirrors without
    dropout; else ``"vmap"``."""
    from real_data.models.char_transformer import CharTransformer
    from real_data.models.vit import ViT

    return "stacked" if not dropout and type(model) in (ViT, CharTransformer) else "vmap"


def kernel_grads(model, qk: dict[str, torch.Tensor], path: str):
    """``f(own, xb, yb)``: the gradient of each kernel's mean task loss on the minibatch
    ``(xb, yb)`` with respect to its own other parameters (``own``: every parameter but Q/K,
    ``(C, *shape)``), the kernels' Q/K ``qk`` (``(C, *shape)``) frozen.

    ``"vmap"``: ``vmap`` of ``grad`` over the model's own forward (``functional_call``),
    dropout masks shared across the stack (``randomness="same"``). ``"stacked"``: one forward
    of every kernel's model at once (:func:`real_data.engines.stacked.stacked_forward`, the
    kernels on the client axis, the minibatch broadcast to each) and one backward of the sum of
    the kernels' losses, whose gradient with respect to a kernel's parameters is its own
    loss's; the same function up to round-off (``tests/real_data/test_kernel_profile.py``), in
    fewer, larger GEMMs."""
    from real_data.engines.base import client_losses, task_loss

    if path == "vmap":
        from torch.func import functional_call, grad, vmap

        def objective(own, kernel, xb, yb):
            return task_loss(functional_call(model, {**own, **kernel}, (xb,)), yb)

        step = vmap(grad(objective), in_dims=(0, 0, None, None), randomness="same")
        return lambda own, xb, yb: step(own, qk, xb, yb)
    if path != "stacked":
        raise ConfigError(f"gradient path {path!r}: must be one of {', '.join(GRAD_PATHS)}")
    from real_data.engines.stacked import stacked_forward

    c = next(iter(qk.values())).shape[0]

    def step(own, xb, yb):
        leaves = {n: v.detach().requires_grad_(True) for n, v in own.items()}
        with torch.enable_grad():
            logits = stacked_forward(model, {**leaves, **qk}, frozenset([*leaves, *qk]),
                                     xb.unsqueeze(0).expand(c, *xb.shape))
            loss = client_losses(logits, yb.unsqueeze(0).expand(c, *yb.shape)).sum()
            grads = torch.autograd.grad(loss, list(leaves.values()))
        return dict(zip(leaves, grads, strict=True))

    return step


GRAD_PATHS = ("vmap", "stacked")


def update(spec, own, grads, state, count: torch.Tensor) -> dict[str, torch.Tensor]:
    """One optimizer step of a kernel stack: each kernel's gradients clipped to
    ``spec.clip_grad_norm`` (when set), ``count`` (steps taken, per kernel) advanced in place,
    then the rule of :mod:`real_data.engines.optim`; returns the new parameters."""
    from real_data.engines import optim

    if spec.clip_grad_norm is not None:
        optim.clip_(grads, optim.grad_norms(grads), spec.clip_grad_norm)
    count += 1
    return optim.step(spec, own, grads, state, count)


class ProfileHalted(RuntimeError):
    """Raised by a training told to stop at a step (``halt_at``), after saving its progress:
    what a killed process leaves behind, for the resume tests."""


def _sources(kernels: list[tuple[str, object]]) -> list:
    """Each kernel's source as saved progress names it: a path, or a dict's tensor names."""
    return [str(s) if not isinstance(s, dict) else sorted(s) for _, s in kernels]


def _partial_key(kernels, budget: Budget, path: str, c: int, dtype, device) -> dict:
    """What a saved stack must match to be resumed: its kernels (labels and sources), budget,
    gradient path, size, dtype and device type."""
    return {"kernels": [[str(label), src] for (label, _), src in
                        zip(kernels, _sources(kernels), strict=True)],
            "budget": dataclasses.asdict(budget), "path": path, "stack": c,
            "dtype": str(dtype), "device": device.type}


def _load_partial(partial: Path | None, key: dict) -> dict | None:
    """The progress saved at ``partial`` when it belongs to this stack (``key``), else None
    (a file of another stack, or unreadable, is replaced when this stack saves)."""
    if partial is None or not partial.is_file():
        return None
    try:
        payload = torch.load(partial, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 - a truncated file: start over
        return None
    if not isinstance(payload, dict) or payload.get("key") != key:
        return None
    return payload


def partial_file(folder: Path, kernels: list[tuple[str, object]], budget: Budget) -> Path:
    """Where a stack of ``kernels`` saves its progress under ``budget`` in ``folder``: a name
    of its own per stack (a digest of the kernels' sources and the budget's tag)."""
    text = json.dumps([budget.tag(), _sources(kernels)])
    return Path(folder) / f"partial_{hashlib.sha256(text.encode()).hexdigest()[:16]}.pt"


def _checked_progress(partial: Path, kernels, budget: Budget, path: str, c: int, dtype,
                      device, key: dict) -> dict | None:
    """For a budget without the check: the progress the same stack saved under the checked
    budget (its file beside ``partial``), where it covers this budget's one training. That
    training is the checked budget's first N steps (a constant step: the start of its one
    training of 2N; the cosine: its first training, over N), the same steps on the same
    minibatches, so the checked state resumes it exactly: a finished first training (the
    cosine's, kept in ``done``) is read as it is, and one stopped within its first N steps
    goes on from there. None otherwise (the state is past N, or no such file)."""
    checked = dataclasses.replace(budget, check=True)
    other = _load_partial(partial_file(partial.parent, kernels, checked),
                          _partial_key(kernels, checked, path, c, dtype, device))
    if other is None:
        return None
    n = budget.steps
    horizon = 2 * n if budget.schedule == "constant" else n  # as _profile_many trains it
    if horizon == n and n in other["done"]:
        return {"key": key, "done": {n: other["done"][n]}, "seconds": other["seconds"],
                "current": None}
    now = other["current"]
    if now is None or now["horizon"] != horizon or now["step"] > n:
        return None
    return {"key": key, "done": {}, "seconds": other["seconds"], "current": now}


def _to_device(obj, device):
    """``obj`` (tensors in dicts) with every tensor on ``device``."""
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj.to(device) if isinstance(obj, torch.Tensor) else obj


SAVE_EVERY = 60.0  # seconds of training between saves of a stack's progress


def _profile_many(setup: ProfileSetup, kernels: list[tuple[str, object]], budget: Budget,
                  path: str | None = None, partial: Path | None = None,
                  save_every: float = SAVE_EVERY, halt_at: int | None = None) -> list[dict]:
    """Phi of every ``(label, source)`` kernel, trained side by side: the parameters of each
    kernel are stacked on a leading axis and one gradient step (:func:`kernel_grads`, along
    ``path``: by default :func:`grad_path`) steps them all on the same minibatch (the
    optimizer rules of :mod:`real_data.engines.optim`, torch's SGD and Adam and
    ``clip_grad_norm_`` per kernel). A kernel's Phi does not depend on the others in its
    stack, up to floating-point round-off; dropout masks are shared across the stack, so they
    too depend on the seed alone.

    ``partial`` (a file path, e.g. :func:`partial_file`): the stack's progress is saved there
    every ``save_every`` seconds (the parameters, the optimizer's state, the step, the reads so
    far and the random state) and at the end of each training, and a call that finds this
    stack's file resumes from it: a killed call loses at most ``save_every`` seconds, and the
    resumed stack ends with the records of an uninterrupted one (the same minibatches, state
    and random numbers from the saved step on). The file is removed when the stack ends;
    ``seconds`` counts the time of every call. ``halt_at``: save at that step and raise
    :class:`ProfileHalted` (what a kill leaves, for tests)."""
    from real_data.engines import optim
    from real_data.engines.base import OptimizerSpec

    fed, cfg = setup.fed, setup.cfg
    model = fed.model
    shapes = {n: tuple(t.shape) for n, t in setup.init.items()}
    loaded = [load_kernel(src, setup.qk_names, shapes) for _, src in kernels]
    t = cfg.train
    adam = budget.optimizer == "adam"
    lr = (ADAM_LR if adam else t.lr) if budget.lr is None else budget.lr
    bs = t.batch_size if budget.batch_size is None else budget.batch_size
    seed = cfg.role_seed("training") if budget.seed is None else budget.seed
    if adam:
        spec = OptimizerSpec(name="adam", lr=lr, momentum=0.0, weight_decay=t.weight_decay,
                             clip_grad_norm=t.clip_grad_norm)
    else:
        spec = OptimizerSpec(name=t.optimizer, lr=lr, momentum=t.momentum,
                             weight_decay=t.weight_decay, clip_grad_norm=t.clip_grad_norm)
    frozen = set(setup.qk_names)
    c = len(kernels)
    device, dtype = fed.device, next(iter(setup.init.values())).dtype
    qk = {n: torch.stack([k[n].to(device, dtype) for k, _ in loaded]) for n in setup.qk_names}
    dropout = float(getattr(cfg.model.params, "dropout", 0.0)) > 0
    path = grad_path(model, dropout) if path is None else path
    if budget.precision != "fp32" and dtype != torch.float32:
        raise ConfigError(f"--precision (--profile-precision) {budget.precision}: the run "
                          f"trains in {str(dtype).removeprefix('torch.')}; give fp32 (a "
                          "float64 run's Phi keeps its own precision)")
    step_grads = kernel_grads(model, qk, path)
    if budget.precision == "bf16":
        plain = step_grads

        def step_grads(own, xb, yb):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return plain(own, xb, yb)
    total = budget.steps * (2 if budget.check else 1)
    order = batch_order(len(setup.pooled), bs, total, seed)
    index = torch.as_tensor(setup.pooled[order], device=device)
    x, y = fed.x_train, fed.y_train
    devices = [device] if device.type == "cuda" else []

    key = _partial_key(kernels, budget, path, c, dtype, device)
    saved = _load_partial(partial, key)
    if saved is None and partial is not None and not budget.check:
        saved = _checked_progress(partial, kernels, budget, path, c, dtype, device, key)
    done: dict[int, dict] = saved["done"] if saved else {}  # horizon -> its finished reads
    elapsed = saved["seconds"] if saved else 0.0

    def save(horizon: int, step: int | None = None, own=None, state=None, count=None,
             out=None) -> None:
        """Write the stack's progress to ``partial`` (atomically): the finished trainings'
        reads and, mid-training, the state after ``step`` steps."""
        payload = {"key": key, "done": done, "seconds": elapsed + time.perf_counter() - start,
                   "current": None}
        if step is not None:
            payload["current"] = {
                "horizon": horizon, "step": step, "own": own, "state": state, "count": count,
                "out": out, "rng": torch.random.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(device) if devices else None}
        tmp = partial.with_name(partial.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, partial)

    def train_and_read(horizon: int, read_at: tuple[int, ...]) -> dict[int, list[tuple]]:
        """Train every kernel's other parameters from the start for ``max(read_at)`` steps
        (the schedule spread over ``horizon``) and evaluate at each step in ``read_at``:
        ``{step: [(loss, acc) per kernel]}``, ending early (fewer steps) once every kernel's
        loss is non-finite. With ``partial``, a training finished before is read back, one
        interrupted resumes from its last saved step, and the progress is saved every
        ``save_every`` seconds."""
        if horizon in done:
            return done[horizon]
        now = saved["current"] if saved and saved["current"] \
            and saved["current"]["horizon"] == horizon else None
        if now is None:
            own = {n: p.to(device).unsqueeze(0).repeat(c, *([1] * p.dim()))
                   for n, p in setup.init.items() if n not in frozen}
            state = optim.init_state(spec, own)
            count = torch.zeros(c, dtype=torch.int64, device=device)
            out: dict[int, list[tuple]] = {}
            first = 0
        else:
            own, state, count = (_to_device(now[k], device) for k in ("own", "state", "count"))
            out, first = now["out"], now["step"]
        reads = set(read_at)
        last_save = time.perf_counter()
        tf32 = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = budget.precision == "tf32"
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                if now is not None:
                    torch.random.set_rng_state(now["rng"])
                    if devices and now["cuda_rng"] is not None:
                        torch.cuda.set_rng_state(now["cuda_rng"], device)
                model.train(dropout)
                for step in range(first, max(read_at)):
                    if partial is not None and (
                            time.perf_counter() - last_save >= save_every or step == halt_at):
                        save(horizon, step, own, state, count, out)
                        last_save = time.perf_counter()
                        if step == halt_at:
                            raise ProfileHalted(f"halted at step {step} (saved)")
                    ix = index[step]
                    grads = step_grads(own, x[ix], y[ix])
                    step_spec = spec if budget.schedule == "constant" else \
                        dataclasses.replace(spec, lr=budget.step_size(lr, step, horizon))
                    own = update(step_spec, own, grads, state, count)
                    if step + 1 in reads:
                        model.eval()
                        torch.backends.cuda.matmul.allow_tf32 = False  # read in float32
                        out[step + 1] = _evaluate_each(model, own, qk, fed, cfg, path)
                        torch.backends.cuda.matmul.allow_tf32 = budget.precision == "tf32"
                        if not any(np.isfinite(v) for v, _ in out[step + 1]):
                            break
                        model.train(dropout)
        finally:
            model.eval()
            torch.backends.cuda.matmul.allow_tf32 = tf32
        done[horizon] = out
        if partial is not None:
            save(horizon)
        return out

    start = time.perf_counter()
    n = budget.steps
    first, second = budget.checkpoints(n), budget.checkpoints(2 * n)
    if budget.schedule == "constant":  # the doubled budget continues the same training
        reads = train_and_read(2 * n, tuple(sorted({*first, *second})) if budget.check
                               else first)
        doubled = reads
    else:  # a decayed budget ends where it is read: the check is a training of its own
        reads = train_and_read(n, first)
        doubled = {}
        if budget.check and any(np.isfinite(_read(reads, first, i, budget)[0])
                                for i in range(c)):
            doubled = train_and_read(2 * n, second)
    seconds = (elapsed + time.perf_counter() - start) / c
    if partial is not None:
        partial.unlink(missing_ok=True)
    # what ``seconds`` (wall time per kernel, the stack's share) was measured on
    where = {"type": device.type, "name": torch.cuda.get_device_name(device)
             if device.type == "cuda" else platform.machine()}
    out = []
    for i, ((label, src), (_, rnd)) in enumerate(zip(kernels, loaded, strict=True)):
        phi, acc, at, last, last_acc, curve = _read(reads, first, i, budget)
        rec = {"kernel": label or (str(src) if not isinstance(src, dict) else ""),
               "kernel_round": rnd, "phi": phi, "val_acc": acc,
               "steps": budget.steps, "lr": lr, "schedule": budget.schedule,
               "batch_size": bs, "optimizer": spec.name,
               "momentum": spec.momentum, "weight_decay": spec.weight_decay,
               "clip_grad_norm": t.clip_grad_norm, "seed": seed,
               "train_samples": int(len(setup.pooled)), "val_samples": int(len(fed.y_val)),
               "phi_doubled": None, "val_acc_doubled": None, "relative_change": None,
               "converged": None, "stacked": c, "grad_path": path, "seconds": seconds,
               "device": where,
               "phi_rule": budget.phi_rule, "eval_every": budget.eval_every,
               "precision": budget.precision, "check": budget.check,
               "phi_step": at, "val_loss_last": last, "val_acc_last": last_acc}
        if adam:
            rec.update(betas=list(spec.betas), eps=spec.eps)
        if budget.phi_rule == "min":
            rec["val_curve"] = curve
        if budget.check:
            if 2 * n in doubled and np.isfinite(phi):
                twice, acc2, at2, last2, last_acc2, curve2 = _read(doubled, second, i, budget)
                rec["phi_doubled"], rec["val_acc_doubled"] = twice, acc2
                rel = abs(twice - phi) / max(abs(phi), 1e-300)
                rec["relative_change"] = float(rel)
                rec["converged"] = bool(rel < TOLERANCE)
                rec.update(phi_step_doubled=at2, val_loss_last_doubled=last2,
                           val_acc_last_doubled=last_acc2)
                if budget.phi_rule == "min":
                    rec["val_curve_doubled"] = curve2
            else:  # non-finite at N, or the doubled training ended early: no check
                rec["converged"] = False
        out.append(rec)
    return out


def _read(reads: dict[int, list[tuple]], checkpoints: tuple[int, ...], i: int,
          budget: Budget) -> tuple:
    """Kernel ``i``'s Phi under the budget's rule from one training's evaluations ``reads``
    (``{step: [(loss, acc) per kernel]}``) at a budget's ``checkpoints`` (the last is its
    final step): ``(phi, acc at phi, step of phi, last loss, last acc, curve)``. ``"min"``:
    the smallest finite loss (the earliest on a tie); none finite, the last evaluation's. A
    checkpoint the training did not reach (it ended early, non-finite) reads NaN as the last
    step."""
    curve = [[s, *reads[s][i]] for s in checkpoints if s in reads]
    end = checkpoints[-1]
    last, last_acc = reads[end][i] if end in reads else (float("nan"), float("nan"))
    if budget.phi_rule == "last":
        return last, last_acc, end, last, last_acc, curve
    finite = [r for r in curve if np.isfinite(r[1])]
    best = min(finite, key=lambda r: r[1]) if finite else (curve[-1] if curve else
                                                            [end, last, last_acc])
    return best[1], best[2], best[0], last, last_acc, curve


def _evaluate_each(model, train, qk, fed, cfg, path: str) -> list[tuple[float, float]]:
    """(validation loss, accuracy) of each stacked kernel's model: one stacked forward of
    every kernel per minibatch along the ``"stacked"`` path
    (:func:`real_data.metrics.evaluate_stacked`), one model at a time along ``"vmap"``."""
    from torch.func import functional_call

    from real_data.metrics import evaluate, evaluate_stacked

    if path == "stacked":
        with torch.no_grad():
            loss, hit = evaluate_stacked(model, {**train, **qk}, fed.x_val, fed.y_val,
                                         cfg.eval.batch_size)
        return [(float(a), float(b)) for a, b in zip(loss.mean(1), hit.mean(1), strict=True)]
    out = []
    with torch.no_grad():
        for i in range(next(iter(qk.values())).shape[0]):
            params = {**{n: v[i] for n, v in train.items()}, **{n: v[i] for n, v in qk.items()}}
            loss, hit = evaluate(lambda xb, p=params: functional_call(model, p, (xb,)),
                                 fed.x_val, fed.y_val, cfg.eval.batch_size)
            out.append((float(loss.mean()), float(hit.mean())))
    return out


def kernel_profile(cfg, kernel_source, budget: Budget | None = None, *, dataset=None,
                   partition=None, device: str | None = None) -> dict:
    """Phi(M) for the Q/K tensors M of ``kernel_source`` under run config ``cfg``.

    Every other parameter starts from the run's initial parameters for its seed, so Phi
    depends on M alone (module docstring). ``partition``: the run's own (its
    ``partition.npz``); rebuilt from ``cfg`` when not given.

    Returns a dict: ``phi`` read by ``budget.phi_rule`` (``"last"``: the validation loss
    after ``budget.steps`` steps; ``"min"``: its minimum over the checkpoints every
    ``budget.eval_every`` steps, with ``val_curve``, the ``[step, loss, acc]`` of each),
    ``val_acc`` (the accuracy where Phi is read), ``phi_step`` (the step of Phi),
    ``val_loss_last`` and ``val_acc_last`` (after the last step), ``phi_rule`` and
    ``eval_every``; with the budget's check ``phi_doubled``, ``val_acc_doubled``,
    ``phi_step_doubled``, ``val_loss_last_doubled``, ``val_acc_last_doubled`` (and
    ``val_curve_doubled``), ``relative_change`` and ``converged`` (relative change < 1%); the
    settings used (``steps``, ``lr``, ``batch_size``, ``optimizer``, ``momentum``,
    ``weight_decay``, ``clip_grad_norm``, ``seed``), the sample counts, ``seconds`` (wall
    time per kernel: the stack's time over its ``stacked`` kernels) and ``device`` (its type
    and name: where ``seconds`` was measured).
    """
    budget = Budget() if budget is None else budget
    setup = profile_setup(cfg, dataset, partition, device)
    return setup.phi(kernel_source, budget)


def run_setup(run_dir: Path, device: str | None = None, dataset=None) -> ProfileSetup:
    """:func:`profile_setup` for a run directory: its ``config.yaml`` and ``partition.npz``
    (rebuilt from the config when absent, e.g. in an unpacked study archive)."""
    from linattn.configio import load_yaml
    from real_data.config import config_from_dict

    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise UserError(f"--run {run_dir}: not a run directory (no config.yaml); give the folder "
                        "`linattn run` or `linattn study` wrote")
    cfg = config_from_dict(load_yaml(saved), source=saved)
    partition = None
    if (run_dir / "partition.npz").is_file():
        from real_data.data import load_partition

        partition = load_partition(run_dir / "partition.npz")
    return profile_setup(cfg, dataset, partition, device)
