"""The fast vectorized path (stacked forward, flat optimizer, chunks, CUDA graphs) agrees with the
sequential reference engine (plain loop over clients, the models' own code, torch.optim).

CPU tests run in float64 at 1e-6 relative (both compute the same sums in different orders);
the CUDA tests (graphs, bf16) run where a GPU is present and are skipped elsewhere.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from real_data.algorithms import AlgorithmContext, FedAvg, FedAvgParams, FedProx, FedProxParams
from real_data.engines import LocalJob, OptimizerSpec, fast, make_batches, train_sequential
from real_data.engines.vectorized import train_vectorized, train_vmap
from real_data.models import CharTransformerConfig, ViTConfig, build_model, names_of_kind

RTOL = 1e-6


def _model(kind: str, dtype=torch.float64, **cfg):
    if kind == "vit":
        base = dict(patch=2, dim=8, depth=2, heads=2, mlp_dim=16, image_size=8, channels=1,
                    num_classes=5)
        return build_model("vit", ViTConfig(**{**base, **cfg}), seed=3, dtype=dtype)
    base = dict(dim=8, depth=2, heads=2, mlp_dim=16, vocab_size=11, seq_len=6)
    return build_model("char_transformer", CharTransformerConfig(**{**base, **cfg}), seed=3,
                       dtype=dtype)


def _job(model, *, algo=FedAvg, algo_params=None, trainable=None, spec=None, clients=4,
         batch=5, steps=3, epochs=None, sizes=None, overrides=None, device="cpu", dtype=None,
         autocast=None, seed=0) -> LocalJob:
    """A round's job on random data shaped for ``model`` (client m owns ``sizes[m]`` samples)."""
    dtype = dtype or next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    sizes = sizes or [12] * clients
    n = sum(sizes)
    if model.task == "image":
        c = model.cfg
        x = torch.rand(n, c.channels, c.image_size, c.image_size, generator=g, dtype=dtype)
        y = torch.randint(c.num_classes, (n,), generator=g)
    else:
        c = model.cfg
        x = torch.randint(c.vocab_size, (n, c.seq_len), generator=g)
        y = torch.randint(c.vocab_size, (n, c.seq_len), generator=g)
    cuts = np.cumsum([0, *sizes])
    train_idx = tuple(np.arange(cuts[m], cuts[m + 1]) for m in range(len(sizes)))
    ids = np.arange(len(sizes))
    spec = spec or OptimizerSpec("sgd", lr=0.1)
    params = {k: p.detach().clone().to(device) for k, p in model.named_parameters()}
    shapes = {k: tuple(p.shape) for k, p in params.items()}
    ctx = AlgorithmContext(model.param_groups(), shapes, len(ids), 10, len(ids), steps, spec)
    algorithm = algo(algo_params or FedAvgParams(), ctx)
    batches = make_batches(train_idx, ids, 7, 1, batch, None if epochs else steps, epochs,
                           device)
    return LocalJob(model=model.to(device), algorithm=algorithm, global_params=params,
                    trainable=tuple(trainable or params), batches=batches, x=x.to(device),
                    y=y.to(device), optimizer=spec, client_ids=ids,
                    overrides=overrides or {}, autocast=autocast)


def _assert_close(a, b, rtol=RTOL):
    for n in a.params:
        x, y = a.params[n].double().cpu(), b.params[n].double().cpu()
        err = float((x - y).abs().max()) / max(float(y.abs().max()), 1e-12)
        assert err <= rtol, f"{n}: relative difference {err:.2e} > {rtol}"
    for k in ("data_loss", "objective", "first_loss", "grad_norm_first", "grad_norm_last"):
        x, y = getattr(a, k).double().cpu(), getattr(b, k).double().cpu()
        assert torch.allclose(x, y, rtol=rtol * 10, atol=0), (k, x, y)
    assert torch.equal(a.steps, b.steps)


def _qk(model):
    return names_of_kind(model.param_groups(), "qk")


def _all_but_qk(model):
    qk = set(_qk(model))
    return tuple(n for n, _ in model.named_parameters() if n not in qk)


MOMENTUM = OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01, clip_grad_norm=0.5)
ADAM = OptimizerSpec("adam", lr=0.01, weight_decay=0.01, clip_grad_norm=0.5)


@pytest.mark.parametrize("kind,cfg,spec,stage", [
    ("vit", {}, MOMENTUM, "full"),
    ("vit", {"attention": "linear", "pool": "mean", "activation": "relu"}, ADAM, "full"),
    ("vit", {}, MOMENTUM, "all_but_qk"),
    ("vit", {"attention": "linear"}, ADAM, "v"),
    ("char", {}, MOMENTUM, "full"),
    ("char", {"attention": "linear"}, ADAM, "all_but_qk"),
    ("char", {}, OptimizerSpec("sgd", lr=0.5), "v"),
])
def test_fast_path_matches_sequential(kind, cfg, spec, stage):
    model = _model(kind, **cfg)
    trainable = {"full": None, "all_but_qk": _all_but_qk(model),
                 "v": names_of_kind(model.param_groups(), "v")}[stage]
    job = _job(model, spec=spec, trainable=trainable)
    assert fast.supports(job)
    _assert_close(fast.train_fast(job), train_sequential(job))


@pytest.mark.parametrize("kind", ["vit", "char"])
@pytest.mark.parametrize("stage", ["full", "all_but_qk", "v"])
def test_folded_layer_norm_affine_is_the_same_function(kind, stage, monkeypatch):
    """Folding each LayerNorm's affine into the next linears (the default; per-client
    affines, and shared frozen ones as in the value-only stage) gives the unfolded logits and
    gradients to float64 rounding, with affines away from (1, 0)."""
    from real_data.engines import stacked
    from real_data.engines.stacked import stacked_forward

    folded, norm = [], stacked._Net.layer_norm

    def spy(self, x, prefix, eps, consumers=()):
        y, fold = norm(self, x, prefix, eps, consumers)
        folded.append((prefix, fold is not None))
        return y, fold

    monkeypatch.setattr(stacked._Net, "layer_norm", spy)

    model = _model(kind)
    g = torch.Generator().manual_seed(5)
    c = 3
    names = [n for n, _ in model.named_parameters()]
    train = {"full": names, "all_but_qk": _all_but_qk(model),
             "v": names_of_kind(model.param_groups(), "v")}[stage]
    params = {n: (p.detach().unsqueeze(0).repeat(c, *[1] * p.dim())
                  + 0.3 * torch.randn(c, *p.shape, generator=g, dtype=p.dtype)
                  if n in train else p.detach()
                  + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
                  ).requires_grad_(n in train)
              for n, p in model.named_parameters()}
    if kind == "vit":
        x = torch.rand(c, 4, 1, 8, 8, generator=g, dtype=torch.float64)
    else:
        x = torch.randint(11, (c, 4, 6), generator=g)
    out = {}
    for fold in (True, False):
        y = stacked_forward(model, params, frozenset(train), x, fold_norms=fold)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1],
                                                        dtype=y.dtype)).sum(),
                                    [params[n] for n in train])
        out[fold] = (y, grads)
    # per run 2 depth + 1 LayerNorms; folded: norm1 where q, k and v train (or the affine is
    # frozen: stage v), norm2 and the last
    depth, half = model.cfg.depth, len(folded) // 2
    assert half == 2 * depth + 1
    assert sum(f for _, f in folded[:half]) == (depth + 1 if stage == "all_but_qk"
                                                else 2 * depth + 1)
    assert not any(f for _, f in folded[half:])
    assert torch.allclose(out[True][0], out[False][0], rtol=1e-10, atol=1e-12)
    for n, a, b in zip(train, out[True][1], out[False][1]):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), n


def test_ragged_epochs_adam_clipping():
    """Clients of different sizes train different numbers of steps (idle steps masked)."""
    model = _model("vit")
    for spec in (ADAM, MOMENTUM):
        job = _job(model, spec=spec, epochs=1.0, sizes=[6, 11, 23], batch=4)
        assert not bool(job.batches.active.all())
        _assert_close(fast.train_fast(job), train_sequential(job))


def test_regularizer_and_personalized_start():
    """FedProx's proximal term (vmap'ed, eager) and per-client start values of any parameter."""
    model = _model("vit")
    g = torch.Generator().manual_seed(5)
    params = dict(model.named_parameters())
    qk = _qk(model)
    over = {n: params[n].detach().unsqueeze(0) + 0.1 * torch.randn(
        4, *params[n].shape, generator=g, dtype=torch.float64) for n in (qk[0], "head.weight")}
    job = _job(model, algo=FedProx, algo_params=FedProxParams(mu=0.5), spec=MOMENTUM,
               trainable=_all_but_qk(model), overrides=over)
    _assert_close(fast.train_fast(job), train_sequential(job))


def test_chunks_padded_to_equal_size(monkeypatch):
    """Five clients in chunks of at most three: two chunks of three, the last one padded."""
    model = _model("char")
    job = _job(model, clients=5, spec=MOMENTUM)
    monkeypatch.setattr(fast, "_max_chunk", lambda job, setup, clients: 3)
    _assert_close(fast.train_fast(job), train_sequential(job))


def test_vectorized_dispatch_and_fallback(monkeypatch):
    """train_vectorized takes the fast path when it applies and the vmap path otherwise."""
    model = _model("vit")
    job = _job(model)
    calls = []
    real = fast.train_fast
    monkeypatch.setattr(fast, "train_fast", lambda j: calls.append(1) or real(j))
    train_vectorized(job)
    assert calls == [1]

    class Scaled(FedAvg):  # a custom forward: the fast path must not apply
        def forward(self, model, params, x):
            return 2.0 * super().forward(model, params, x)

    job = _job(model, algo=Scaled)
    assert not fast.supports(job)
    _assert_close(train_vectorized(job), train_sequential(job))
    assert calls == [1]
    _assert_close(train_vmap(_job(model)), train_sequential(_job(model)))


# -- CUDA: graphs, chunking and caching across rounds, bf16 ------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["vit", "char"])
def test_cuda_graph_path_matches_sequential_fp32(kind, monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(kind, dtype=torch.float32, dim=32, heads=4, mlp_dim=64)
    fast.clear_cache()
    for stage in ("full", "all_but_qk"):
        trainable = None if stage == "full" else _all_but_qk(model)
        for seed in (0, 1):  # the second round replays the cached graph with new values
            job = _job(model, spec=MOMENTUM, trainable=trainable, clients=7, device="cuda",
                       seed=seed)
            out = fast.train_fast(job)
            assert fast._CACHE, "the CUDA graph path was not taken"
            _assert_close(out, train_sequential(job), rtol=2e-4)
    monkeypatch.setattr(fast, "_max_chunk", lambda job, setup, clients: 3)
    job = _job(model, spec=ADAM, clients=7, device="cuda", epochs=1.0,
               sizes=[6, 11, 23, 9, 12, 30, 7], batch=4)
    _assert_close(fast.train_fast(job), train_sequential(job), rtol=2e-4)
    fast.clear_cache()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("steps", [1, 2])
def test_cuda_graph_path_with_fewer_local_steps_than_the_capture_warmup(steps):
    """The capture warms up with 3 steps; a round of 1 or 2 local steps (K = 2 in the P3 plan)
    has no minibatch column to read for the third: the graph path still runs and agrees."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model("vit", dtype=torch.float32, dim=32, heads=4, mlp_dim=64)
    fast.clear_cache()
    job = _job(model, spec=MOMENTUM, clients=5, device="cuda", steps=steps)
    out = fast.train_fast(job)
    torch.cuda.synchronize()
    assert fast._CACHE and next(iter(fast._CACHE.values())).graph is not None
    _assert_close(out, train_sequential(job), rtol=2e-4)
    fast.clear_cache()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind, compile", [("vit", False), ("vit", True), ("char", True)])
def test_cuda_graph_path_bf16_close_to_sequential(kind, compile):
    """bf16 autocast (the Triton attention kernels apply; compiled or not): both engines round
    differently; they agree to bf16 accuracy."""
    model = _model(kind, dtype=torch.float32, dim=32, heads=4, mlp_dim=64)
    job = _job(model, spec=MOMENTUM, clients=6, device="cuda", autocast=torch.bfloat16)
    a, b = fast.train_fast(job, compile=compile), train_sequential(job)
    for n in a.params:
        delta = (a.params[n] - job.global_params[n]).double()
        ref = (b.params[n] - job.global_params[n]).double()
        err = float((delta - ref).norm() / ref.norm().clamp(min=1e-12))
        assert err < 5e-2, (n, err)
    assert torch.allclose(a.data_loss, b.data_loss, rtol=2e-2)
    fast.clear_cache()


def test_setup_key_is_hashable():
    job = _job(_model("vit"))
    setup = fast._setup(job, graphs=True, compile=False)
    assert hash(setup) == hash(dataclasses.replace(setup))


@pytest.mark.slow
def test_compiled_forward_matches_sequential():
    """``compile=True`` (torch.compile of the stacked forward and loss), float64 on CPU."""
    model = _model("vit")
    job = _job(model, spec=MOMENTUM, trainable=_all_but_qk(model))
    _assert_close(fast.train_fast(job, compile=True), train_sequential(job))


@pytest.mark.slow
def test_compiled_step_adam_ragged_matches_sequential():
    """``compile=True`` also compiles the update (norm, clipping, Adam, accounting); clients
    with different numbers of steps (ragged) keep their parameters once done."""
    model = _model("char")
    job = _job(model, spec=ADAM, epochs=1.0, sizes=[6, 11, 23, 9], batch=4)
    _assert_close(fast.train_fast(job, compile=True), train_sequential(job))


def test_evicted_and_cleared_runners_release_their_graphs_at_once(monkeypatch):
    """A runner sits in a reference cycle; its CUDA graph must be freed when it leaves the
    cache, not by a later garbage collection that may fall inside another graph's capture."""

    class Runner:
        def __init__(self, *args):
            self.graph, self.job = object(), object()
            self.loss_fn = self.release  # a bound method: the cycle a real runner has

        release = fast._Runner.release

    monkeypatch.setattr(fast, "_Runner", Runner)
    monkeypatch.setattr(fast, "_CACHE_SIZE", 2)
    fast.clear_cache()
    @dataclasses.dataclass(frozen=True)
    class Setup:  # a hashable stand-in: _runner reads only .graphs before caching
        graphs: bool
        i: int

    made = [fast._runner(None, Setup(True, i), 8) for i in range(3)]
    assert made[0].graph is None and made[0].job is None  # evicted: released
    assert made[0].loss_fn is None  # and out of its reference cycle
    assert made[1].graph is not None and made[2].graph is not None
    fast.clear_cache()
    assert made[1].graph is None and made[2].graph is None and not fast._CACHE
