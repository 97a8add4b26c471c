"""Models: declared parameter groups, attention variants, causality."""

from __future__ import annotations

import pytest
import torch

from linattn.errors import ConfigError
from real_data.models import (
    CharTransformerConfig,
    ViTConfig,
    build_model,
    complete_model_config,
    names_of_kind,
)


def _vit(**kw):
    cfg = complete_model_config("vit", ViTConfig(patch=2, dim=16, depth=2, heads=2, mlp_dim=32,
                                                 **kw), (1, 8, 8), 10)
    return build_model("vit", cfg, seed=0)


def _char(**kw):
    cfg = complete_model_config("char_transformer",
                                CharTransformerConfig(dim=16, depth=2, heads=2, mlp_dim=32, **kw),
                                (12,), 30)
    return build_model("char_transformer", cfg, seed=0)


@pytest.mark.parametrize("make", [_vit, _char])
def test_groups_partition_the_parameters(make):
    model = make()
    groups = model.param_groups()
    names = [n for g in groups for n in g.params]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert [g.kind for g in groups[:6]] == ["embed", "norm", "qk", "v", "attn_out", "mlp"]
    assert groups[-1].kind == "head"
    qk = names_of_kind(groups, "qk")
    modules = dict(model.named_modules())
    for blk in ("blocks.0", "blocks.1"):
        attn = modules[f"{blk}.attn"]
        ids = {id(p) for p in (*attn.q.parameters(), *attn.k.parameters())}
        params = dict(model.named_parameters())
        assert ids == {id(params[n]) for n in qk if n.startswith(blk + ".")}


def test_unknown_group_kind_is_an_error():
    with pytest.raises(ValueError, match="valid"):
        names_of_kind(_vit().param_groups(), "query")


@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_vit_shapes_and_same_seed_same_weights(attention, activation):
    a, b = _vit(attention=attention, activation=activation), _vit(attention=attention,
                                                                  activation=activation)
    x = torch.randn(5, 1, 8, 8)
    assert a(x).shape == (5, 10)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_char_transformer_is_causal(attention):
    model = _char(attention=attention)
    x = torch.randint(0, 30, (2, 12))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 30  # change the future only
    out_x, out_y = model(x), model(y)
    assert out_x.shape == (2, 12, 30)
    torch.testing.assert_close(out_x[:, :7], out_y[:, :7])
    assert not torch.allclose(out_x[:, 7:], out_y[:, 7:])


def test_linear_attention_matches_its_definition():
    """Non-causal linear attention equals phi(q) phi(k)^T v normalized row-wise."""
    model = _vit(attention="linear")
    attn = model.blocks[0].attn
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    attn.double()
    q, k, v = (f(x).view(3, 5, 2, 8).transpose(1, 2) for f in (attn.q, attn.k, attn.v))
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    a = fq @ fk.transpose(-2, -1)
    ref = ((a / a.sum(-1, keepdim=True)) @ v).transpose(1, 2).reshape(3, 5, 16)
    torch.testing.assert_close(attn(x), attn.out(ref), rtol=1e-5, atol=1e-8)


def test_data_dependent_fields_must_match_the_data():
    with pytest.raises(ConfigError, match="model.num_classes=3 contradicts"):
        complete_model_config("vit", ViTConfig(num_classes=3), (1, 8, 8), 10)
    with pytest.raises(ConfigError, match="model.patch=3"):
        complete_model_config("vit", ViTConfig(patch=3), (1, 8, 8), 10)
