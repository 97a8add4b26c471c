"""FedTP: hypernetwork gradient vs a brute-force Jacobian, the FedAvg limit, Personalized-T."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import federation, random_partition, tiny_config, train_rounds
from test_fedpart import engines_agree

from real_data.algorithms.fedtp import attention_projections
from real_data.algorithms.hypernet import HyperNetwork, hypernet_gradient, sgd_momentum_step
from real_data.federation import BYTES_PER_NUMBER
from real_data.metrics import evaluate
from real_data.models import ViT, ViTConfig

FEDTP = ["algorithm.name=fedtp", "train.precision=fp64", "train.optimizer=sgd", "train.lr=0.2"]


def _tiny_hypernet(num_clients=5, dim=4):
    cfg = ViTConfig(patch=4, dim=dim, depth=2, heads=2, mlp_dim=8, image_size=8, channels=1,
                    num_classes=3)
    model = ViT(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    specs = [{n: shapes[n] for n in layer if len(shapes[n]) == 2}
             for layer in attention_projections(model.param_groups())]
    torch.manual_seed(0)
    return HyperNetwork(num_clients, specs, embedding_dim=3, hidden_dim=5,
                        n_hidden=3).double()


def brute_force_gradient(hnet, ids, deltas, weights):
    """sum_k p_k J_k^T delta_k with J_k the full Jacobian dW_k / dphi (torch.func.jacrev)."""
    params = dict(hnet.named_parameters())
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    for c, k in enumerate(ids.tolist()):
        def out(ps, k=k):
            return torch.func.functional_call(hnet, ps, (torch.tensor([k]),))

        jac = torch.func.jacrev(out)({n: p.detach() for n, p in params.items()})
        for w_name, per_param in jac.items():  # (1, *W shape, *phi shape)
            d = deltas[w_name][c]
            for p_name, j in per_param.items():
                j = j[0].reshape(d.numel(), -1)  # (|W|, |phi|)
                grads[p_name] += weights[c] * (j.T @ d.flatten()).reshape(grads[p_name].shape)
    return [grads[n] for n in params]


def test_hypernetwork_gradient_matches_brute_force_jacobian():
    hnet = _tiny_hypernet()
    ids = torch.tensor([0, 2, 3])
    gen = torch.Generator().manual_seed(1)
    deltas = {n: torch.randn(3, *w.shape[1:], generator=gen, dtype=torch.float64)
              for n, w in hnet(ids).items()}
    weights = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    got = hypernet_gradient(hnet, ids, deltas, weights)
    want = brute_force_gradient(hnet, ids, deltas, weights)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
    emb = got[0]  # only the sampled clients' embedding rows receive gradient
    assert emb[[1, 4]].abs().max() == 0 and emb[[0, 2, 3]].norm(dim=1).min() > 0


def test_server_step_is_torch_sgd_with_momentum_and_weight_decay():
    gen = torch.Generator().manual_seed(0)
    mine = [torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(2)]
    ref = [p.clone().requires_grad_(True) for p in mine]
    opt = torch.optim.SGD(ref, lr=0.01, momentum=0.9, weight_decay=1e-3)
    buffers = None
    for _ in range(3):
        grads = [torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(2)]
        buffers = sgd_momentum_step(mine, grads, buffers, 0.01, 0.9, 1e-3)
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-14, atol=1e-15)


def _spy(fed, jobs):
    engine = fed.engine

    def spy(job):
        res = engine(job)
        jobs.append((job, res))
        return res

    fed.engine = spy


@pytest.mark.parametrize("server_lr", [None, 0.03])
def test_round_takes_one_sgd_step_on_the_p_weighted_delta(digits64, server_lr):
    """End to end: phi_1 = phi_0 - eta_phi (g + lambda phi_0), g from the brute-force Jacobian
    with delta_k = W_k (generated) - W_k (after local training), p_k = n_k / sum n; eta_phi
    is the clients' learning rate of the round (here 0.2 / 2 in the first round of a linear
    warm-up), or a fixed ``server_lr``."""
    part = random_partition(digits64, 4, seed=2, alpha=0.5)
    fixed = [] if server_lr is None else [f"algorithm.server_lr={server_lr}"]
    fed = federation(tiny_config(*FEDTP, "train.clients_per_round=3", "model.dim=4",
                                 "algorithm.embedding_dim=3", "algorithm.hidden_dim=5",
                                 "train.lr_schedule={kind: constant, warmup_rounds: 2}",
                                 *fixed),
                     digits64, part)
    state, jobs = fed.initial_state(), []
    _spy(fed, jobs)
    hnet = state.server_state.hypernet
    before = [p.detach().clone() for p in hnet.parameters()]
    state, _ = fed.run_round(state, 1)
    (job, res), = jobs
    ids = torch.as_tensor(job.client_ids)
    algo = fed.algorithm
    for a in algo.attn:  # the clients started from their generated attention weights
        assert not torch.equal(job.overrides[a][0], job.overrides[a][1])
    n = torch.as_tensor(part.sizes[job.client_ids], dtype=torch.float64)
    # reference on a copy holding phi_0
    ref = _copy_with(hnet, before)
    deltas = {a: job.overrides[a] - res.params[a] for a in algo.attn}
    for a in algo.attn:
        torch.testing.assert_close(ref(ids)[a].detach(), job.overrides[a], rtol=0, atol=0)
    g = brute_force_gradient(ref, ids, deltas, n / n.sum())
    p = algo.params
    eta = 0.1 if server_lr is None else server_lr  # train.lr 0.2, warm-up multiplier 1/2
    assert fed.round_lr(fed.initial_state(), 1) == pytest.approx(0.1, rel=1e-15)
    for new, old, gr in zip(hnet.parameters(), before, g):
        want = old - eta * (gr + p.server_weight_decay * old)
        torch.testing.assert_close(new.detach(), want, rtol=1e-10, atol=1e-13)


def test_hypernetwork_follows_the_clients_lr_schedule(digits64):
    """Over 4 rounds of a step schedule (0.2, 0.2, 0.02, 0.02), the hypernetwork equals
    ``torch.optim.SGD`` (momentum 0.9, weight decay 1e-3, state kept across rounds) whose lr
    is set to the clients' learning rate before each round's step, within 1e-12."""
    part = random_partition(digits64, 4, seed=3, alpha=0.5)
    fed = federation(tiny_config(*FEDTP, "train.clients_per_round=3", "model.dim=4",
                                 "algorithm.embedding_dim=3", "algorithm.hidden_dim=5",
                                 "train.rounds=4",
                                 "train.lr_schedule={kind: step, milestones: [0.5], factor: 0.1}"),
                     digits64, part)
    state, jobs = fed.initial_state(), []
    _spy(fed, jobs)
    hnet = state.server_state.hypernet
    ref = _copy_with(hnet, [p.detach() for p in hnet.parameters()])
    opt = torch.optim.SGD(ref.parameters(), lr=1.0, momentum=0.9, weight_decay=1e-3)
    lrs = []
    for rnd in range(1, 5):
        lrs.append(fed.round_lr(state, rnd))
        state, _ = fed.run_round(state, rnd)
        job, res = jobs[-1]
        ids = torch.as_tensor(job.client_ids)
        n = torch.as_tensor(part.sizes[job.client_ids], dtype=torch.float64)
        deltas = {a: job.overrides[a] - res.params[a] for a in fed.algorithm.attn}
        grads = hypernet_gradient(ref, ids, deltas, n / n.sum())
        for group in opt.param_groups:
            group["lr"] = lrs[-1]
        for p, g in zip(ref.parameters(), grads):
            p.grad = g
        opt.step()
        for a, b in zip(hnet.parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-12)
    assert lrs == pytest.approx([0.2, 0.2, 0.02, 0.02], rel=1e-12)


def _copy_with(hnet, values):
    import copy

    ref = copy.deepcopy(hnet)
    with torch.no_grad():
        for p, v in zip(ref.parameters(), values):
            p.copy_(v)
    return ref


def test_zero_embedding_and_identical_clients_is_fedavg_on_the_rest(digits64):
    """All clients get the same W; every round's non-attention update is a FedAvg round."""
    part = random_partition(digits64, 3, seed=0)
    same = type(part)((part.train[0],) * 3, part.test, "iid", {}, 0)
    fed = federation(tiny_config(*FEDTP, "model.dim=4", "algorithm.embedding_dim=3",
                                 "algorithm.hidden_dim=5"), digits64, same)
    avg = federation(tiny_config(*FEDTP[1:], "algorithm.name=fedavg", "model.dim=4"),
                     digits64, same)
    for f in (fed, avg):  # every client uses client 0's batches
        engine = f.engine

        def twin(job, engine=engine):
            k = len(job.client_ids)
            job.batches = type(job.batches)(job.batches.idx[[0] * k],
                                            job.batches.active[[0] * k],
                                            job.batches.steps[[0] * k])
            return engine(job)

        f.engine = twin
    state = fed.initial_state()
    with torch.no_grad():
        state.server_state.hypernet.embeddings.weight.zero_()
    algo = fed.algorithm
    for rnd in range(1, 4):
        w = algo.client_start(np.arange(3), state.global_params, {}, state.server_state)
        for a in algo.attn:
            torch.testing.assert_close(w[a][1], w[a][0], rtol=1e-14, atol=0)
            torch.testing.assert_close(w[a][2], w[a][0], rtol=1e-14, atol=0)
        start = {**state.global_params, **{a: w[a][0] for a in algo.attn}}
        ref, _ = avg.run_round(type(state)(rnd - 1, start), rnd)
        state, _ = fed.run_round(state, rnd)
        for n in algo.rest:
            torch.testing.assert_close(state.global_params[n], ref.global_params[n],
                                       rtol=1e-12, atol=1e-14)
    emb = state.server_state.hypernet.embeddings.weight
    torch.testing.assert_close(emb[1], emb[0], rtol=1e-12, atol=1e-14)


def test_personalized_evaluation_uses_generated_attention(digits64):
    part = random_partition(digits64, 3, seed=4, alpha=0.3)
    fed = federation(tiny_config(*FEDTP), digits64, part)
    state, rec = train_rounds(fed, 2)
    get = {(c, k): v for r, c, k, v in rec if r == 2}
    algo = fed.algorithm
    for m in range(3):
        own = algo.eval_params(m, state.global_params, state.client_state, state.server_state)
        ix = torch.as_tensor(part.test[m])
        _, hit = evaluate(lambda xb, own=own: algo.forward(fed.model, own, xb),
                          fed.x_test[ix], fed.y_test[ix], 512)
        assert get[(str(m), "local_test_acc")] == pytest.approx(float(hit.mean()), abs=1e-12)
    sizes = np.array([len(t) for t in part.test])
    accs = np.array([get[(str(m), "local_test_acc")] for m in range(3)])
    micro = float((accs * sizes).sum() / sizes.sum())
    assert get[("global", "local_acc_micro")] == pytest.approx(micro, abs=1e-12)


def test_vanilla_keeps_each_clients_attention_and_does_not_send_it(digits64):
    part = random_partition(digits64, 4, seed=5, alpha=0.5)
    fed = federation(tiny_config(*FEDTP, "algorithm.variant=vanilla",
                                 "train.clients_per_round=2"), digits64, part)
    algo = fed.algorithm
    state, jobs = fed.initial_state(), []
    _spy(fed, jobs)
    init = {a: v.clone() for a, v in state.client_state.items()}
    records = []
    for rnd in (1, 2):
        state, rec = fed.run_round(state, rnd)
        records += rec
    seen = set(jobs[0][0].client_ids) | set(jobs[1][0].client_ids)
    for a in algo.attn:
        for m in range(4):
            if m not in seen:
                assert torch.equal(state.client_state[a][m], init[a][m])
        m = int(jobs[1][0].client_ids[0])  # a client of round 2 keeps what it trained
        assert torch.equal(state.client_state[a][m], jobs[1][1].params[a][0])
        assert torch.equal(state.global_params[a], init[a][0])  # never aggregated
    shapes = algo.ctx.shapes
    rest = sum(int(np.prod(shapes[n])) for n in algo.rest)
    up = next(v for r, c, k, v in records if r == 2 and c == "global" and k == "bytes_up")
    assert up == BYTES_PER_NUMBER * 2 * rest


@pytest.mark.parametrize("variant", ["hypernetwork", "vanilla"])
def test_engines_agree(digits64, variant):
    part = random_partition(digits64, 4, seed=1, alpha=0.5)
    out = engines_agree(digits64, part, 3, "train.optimizer=sgd", "train.lr=0.1",
                        "train.momentum=0.9", "algorithm.name=fedtp",
                        f"algorithm.variant={variant}", "train.clients_per_round=3")
    if variant == "hypernetwork":
        a = out["vectorized"].server_state.hypernet.parameters()
        b = out["sequential"].server_state.hypernet.parameters()
        for p, q in zip(a, b):
            p, q = p.detach(), q.detach()
            err = float((p - q).abs().max()) / max(float(p.abs().max()), 1e-12)
            assert err <= 1e-6


@pytest.mark.parametrize("variant", ["hypernetwork", "vanilla"])
def test_digits_beats_chance(digits, variant):
    part = random_partition(digits, 5, seed=0, alpha=0.5)
    cfg = tiny_config("algorithm.name=fedtp", f"algorithm.variant={variant}",
                      "model.dim=16", "model.mlp_dim=32", "train.batch_size=32",
                      "train.local_steps=20", "train.optimizer=adam", "train.lr=0.01",
                      "train.rounds=8", "eval.every=8")
    _, rec = train_rounds(federation(cfg, digits, part), 8)
    acc = next(v for r, c, k, v in rec if r == 8 and c == "global" and k == "local_acc_micro")
    # the generated attention moves one server step (eta_phi = lr = 0.01) a round, so FedTP starts
    # slowly; 8 rounds reach about 0.36 (hypernetwork) and 0.58 (vanilla); chance is 0.1
    assert acc > 0.2, acc


def test_checkpoint_resume_is_exact(tmp_path, digits64):
    """The hypernetwork and its momentum survive a checkpoint: resumed = uninterrupted."""
    from real_data.checkpoint import load_checkpoint, save_checkpoint

    part = random_partition(digits64, 4, seed=1, alpha=0.5)
    cfg = tiny_config(*FEDTP, "train.clients_per_round=2")
    straight, _ = train_rounds(federation(cfg, digits64, part), 3)
    fed = federation(cfg, digits64, part)
    state, _ = train_rounds(fed, 2)
    save_checkpoint(tmp_path / "c.pt", state, {})
    fed = federation(cfg, digits64, part)
    state, _, _ = load_checkpoint(tmp_path / "c.pt", torch.device("cpu"))
    state, _ = fed.run_round(state, 3)
    for n, p in straight.global_params.items():
        assert torch.equal(p, state.global_params[n]), n
    for a, b in zip(straight.server_state.hypernet.parameters(),
                    state.server_state.hypernet.parameters()):
        assert torch.equal(a, b)


def test_native_config_loads():
    from real_data.config import load_config

    cfg = load_config("fmnist_vit_fedtp_native")
    assert cfg.algorithm.name == "fedtp" and cfg.train.clients_per_round == 5  # 10% of 50
    assert (cfg.train.optimizer, cfg.train.lr, cfg.train.momentum) == ("sgd", 0.01, 0.9)
    p = cfg.algorithm.params
    assert (p.embedding_dim, p.hidden_dim, p.n_hidden, p.server_lr) == (128, 150, 3, None)
