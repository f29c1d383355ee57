"""The reference mixture-of-experts op pairs (engines/shared/moe.py) against torch autograd: routing, the routed
experts with a LoRA pair per expert, and the load-balancing loss, in float64."""
from __future__ import annotations

import numpy as np
import pytest

from wgpu_train.engines.shared import moe

torch = pytest.importorskip("torch")

N, C, E, I, K, R = 9, 6, 5, 4, 2, 3


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    return dict(x=rng.normal(size=(N, C)), logits=rng.normal(size=(N, E)), gu=rng.normal(size=(E, 2 * I, C)),
                dn=rng.normal(size=(E, C, I)), a1=rng.normal(size=(E, R, C)), b1=rng.normal(size=(E, 2 * I, R)),
                a2=rng.normal(size=(E, R, I)), b2=rng.normal(size=(E, C, R)), dy=rng.normal(size=(N, C)))


def _torch_moe(t, normalize, scale):
    """The routed experts as transformers' Qwen3MoeSparseMoeBlock computes them, with PEFT's delta weights."""
    probs = torch.softmax(t["logits"], -1)
    w, idx = torch.topk(probs, K, -1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    w1 = t["gu"] + scale * torch.einsum("eor,eri->eoi", t["b1"], t["a1"])
    w2 = t["dn"] + scale * torch.einsum("eor,eri->eoi", t["b2"], t["a2"])
    rows = []
    for n in range(N):
        row = 0
        for j in range(K):
            gate, up = (w1[idx[n, j]] @ t["x"][n]).chunk(2)
            row = row + w[n, j] * (w2[idx[n, j]] @ (torch.nn.functional.silu(gate) * up))
        rows.append(row)
    return torch.stack(rows), idx


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_pairs_match_autograd(normalize):
    p = _problem()
    t = {k: torch.tensor(v, requires_grad=True) for k, v in p.items() if k != "dy"}
    y, idx = _torch_moe(t, normalize, 0.7)
    (y * torch.tensor(p["dy"])).sum().backward()
    lora_gu, lora_dn = (p["a1"], p["b1"], 0.7), (p["a2"], p["b2"], 0.7)
    weights, experts = moe.moe_route_forward(p["logits"], K, normalize)
    assert (experts == idx.numpy()).all()
    ours, gate_up_out = moe.moe_experts_forward(p["x"], weights, experts, p["gu"], p["dn"], lora_gu, lora_dn)
    np.testing.assert_allclose(ours, y.detach().numpy(), atol=1e-12)
    dx, dweights, grads = moe.moe_experts_backward(p["dy"], p["x"], weights, experts, gate_up_out, p["gu"], p["dn"],
                                                   lora_gu, lora_dn, need_weight_grad=True)
    dlogits = moe.moe_route_backward(dweights, p["logits"], experts, normalize)
    for name, got in [("x", dx), ("logits", dlogits), ("gu", grads["gate_up"]), ("dn", grads["down"]),
                      ("a1", grads["gate_up.lora_A"]), ("b1", grads["gate_up.lora_B"]),
                      ("a2", grads["down.lora_A"]), ("b2", grads["down.lora_B"])]:
        np.testing.assert_allclose(got, t[name].grad.numpy(), atol=1e-11, err_msg=name)


def test_an_expert_with_every_token_and_experts_with_none():
    p = _problem(1)
    logits = np.full((N, E), -5.0)
    logits[:, 3], logits[:, 1] = 5.0, 4.0                   # every token to experts 3 and 1, none elsewhere
    weights, experts = moe.moe_route_forward(logits, K, True)
    assert (experts[:, 0] == 3).all() and (experts[:, 1] == 1).all()
    y, _ = moe.moe_experts_forward(p["x"], weights, experts, p["gu"], p["dn"])
    gate, up = np.split(p["x"] @ p["gu"][3].T, 2, axis=-1)
    gate1, up1 = np.split(p["x"] @ p["gu"][1].T, 2, axis=-1)
    silu = lambda z: z / (1 + np.exp(-z))                                       # noqa: E731
    want = weights[:, :1] * (silu(gate) * up) @ p["dn"][3].T + weights[:, 1:] * (silu(gate1) * up1) @ p["dn"][1].T
    np.testing.assert_allclose(y, want, atol=1e-12)


def test_load_balancing_loss_and_gradient_match_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    rng = np.random.default_rng(2)
    layers = [rng.normal(size=(N, E)) for _ in range(3)]
    mask = np.ones(N)
    mask[-2:] = 0
    t = [torch.tensor(x, requires_grad=True) for x in layers]
    want = load_balancing_loss_func(tuple(t), E, K, torch.tensor(mask.reshape(1, N)))
    (0.3 * want).backward()
    parts = [moe.load_balancing_counts(x, moe.moe_route_forward(x, K, False)[1], mask) for x in layers]
    counts, probs, rows = (sum(p[i] for p in parts) for i in range(3))
    # transformers sums the counts and probabilities in float32 whatever the logits' dtype: float32's rounding
    assert moe.load_balancing_loss(counts, probs, rows, E) == pytest.approx(float(want), rel=1e-6)
    for x, tx in zip(layers, t):
        dprobs = moe.load_balancing_dprobs(counts, rows, E, mask, 0.3)
        experts = moe.moe_route_forward(x, K, False)[1]
        got = moe.moe_route_backward(np.zeros((N, K)), x, experts, False, dprobs)
        np.testing.assert_allclose(got, tx.grad.numpy(), atol=1e-7)
