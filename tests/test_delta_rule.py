"""The reference gated delta rule (engines/shared/delta_rule.py) against transformers 5's torch fallbacks
(torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule) and torch autograd through the chunked one:
the chunked forward, the recurrent step, the exact backward, segments, grouped key heads and an initial state."""
from __future__ import annotations

import inspect
import types

import numpy as np
import pytest

from tests.tolerances import assert_close
from wgpu_train.engines.shared import delta_rule as dr

torch = pytest.importorskip("torch")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

B, DK, DV, CHUNK = 2, 12, 10, 64


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """torch's thread pool on these tiny problems only contends with the other processes on the 2 cores (seen:
    0.7 s a backward with its default threads, 0.02 s with one); restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Float64Torch:
    """torch, but its float32 is float64: transformers' functions cast every input to torch.float32, so running
    their own code with this in place of their module's torch gives the same algorithm in float64."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _hf(name: str, dtype: str):
    """transformers' torch function `name` (unwrapped from its hub-kernel wrapper), in float64 or as it is."""
    fn = getattr(qwen3_next, name)
    if not inspect.isfunction(fn):  # an nn.Module wrapper whose forward closes over the function
        fn = next(c.cell_contents for c in type(fn).forward.__closure__ if inspect.isfunction(c.cell_contents))
    fn = inspect.unwrap(fn)
    assert fn.__name__ == name
    if dtype == "float32":
        return fn
    return types.FunctionType(fn.__code__, {**fn.__globals__, "torch": _Float64Torch()}, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _problem(t: int, hk: int, hv: int, seed: int = 0):
    """Raw (not yet normalised) q, k, and v, g, beta, an initial state and an output gradient, with g and beta
    made as the layer makes them: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); A in (0.01, 1) keeps
    the decays between about 0.3 and 1, where a wrong decay shows."""
    rng = np.random.default_rng(seed)
    a_log = np.log(rng.uniform(0.01, 1.0, size=hv))
    g = -np.exp(a_log) * np.logaddexp(0.0, rng.normal(size=(B, t, hv)) - 1.0)
    return dict(q=rng.normal(size=(B, t, hk, DK)), k=rng.normal(size=(B, t, hk, DK)),
                v=rng.normal(size=(B, t, hv, DV)), g=g, beta=1.0 / (1.0 + np.exp(-rng.normal(size=(B, t, hv)))),
                s0=rng.normal(size=(B, hv, DK, DV)), dout=rng.normal(size=(B, t, hv, DV)))


def _normalised(p):
    return dr.l2norm_forward(p["q"])[0], dr.l2norm_forward(p["k"])[0]


def _torch_inputs(p, requires_grad=False):
    return {n: torch.tensor(p[n], requires_grad=requires_grad) for n in ("q", "k", "v", "g", "beta", "s0")}


def _ours(p, chunk=CHUNK, init=True, segments=None):
    q, k = _normalised(p)
    return dr.gated_delta_rule_forward(q, k, p["v"], p["g"], p["beta"], chunk,
                                       initial_state=p["s0"] if init else None, segments=segments)


CASES = [  # (T, Hk, Hv, initial state): across chunk boundaries, shorter than a chunk, exactly one chunk
    (150, 2, 4, True), (40, 3, 3, False), (64, 1, 3, True)]


@pytest.mark.parametrize("t,hk,hv,init", CASES)
@pytest.mark.parametrize("oracle", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_chunked_forward_equals_transformers(t, hk, hv, init, oracle):
    """l2norm then the rule (ours) equals transformers' function with use_qk_l2norm_in_kernel, which repeats the
    Hk key heads to Hv itself; ours takes them as Hk heads and repeats them inside the op."""
    p = _problem(t, hk, hv)
    out, final, states = _ours(p, init=init)
    x = _torch_inputs(p)
    kwargs = {"chunk_size": CHUNK} if "chunk" in oracle else {}
    ref, ref_final = _hf(oracle, "float64")(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                            initial_state=x["s0"] if init else None, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, **kwargs)
    assert ref.dtype == torch.float64 and out.dtype == np.float64
    assert states.shape == (B, hv, -(-t // CHUNK), DK, DV)
    assert_close(out, ref.numpy(), "delta_rule_f64", "output")
    assert_close(final, ref_final.numpy(), "delta_rule_f64", "final state")


def test_float32_equals_transformers_as_it_runs():
    """float32 inputs run in float32 (the state too) and agree with transformers' unchanged float32 function."""
    p = {n: a.astype(np.float32) for n, a in _problem(150, 2, 4, seed=3).items()}
    out, final, states = _ours(p)
    assert out.dtype == final.dtype == states.dtype == np.float32
    x = _torch_inputs(p)
    ref, ref_final = _hf("torch_chunk_gated_delta_rule", "float32")(
        x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=CHUNK, initial_state=x["s0"],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close(out, ref.numpy(), "delta_rule_f32", "output")
    assert_close(final, ref_final.numpy(), "delta_rule_f32", "final state")


@pytest.mark.parametrize("chunk", [CHUNK, 16])
def test_step_equals_chunked_token_by_token(chunk):
    """The recurrent single-token form, token by token from the initial state, gives the chunked form's outputs,
    its final state, and each chunk's stored entering state at the chunk's first token."""
    t, hk, hv = 150, 2, 4
    p = _problem(t, hk, hv, seed=1)
    out, final, states = _ours(p, chunk=chunk)
    q, k = _normalised(p)
    s = p["s0"]
    for i in range(t):
        if i % chunk == 0:
            assert_close(states[:, :, i // chunk], s, "delta_rule_f64", f"state entering chunk {i // chunk}")
        o, s = dr.gated_delta_rule_step(q[:, i], k[:, i], p["v"][:, i], p["g"][:, i], p["beta"][:, i], s)
        assert_close(o, out[:, i], "delta_rule_f64", f"output at token {i}")
    assert_close(s, final, "delta_rule_f64", "final state")


def _autograd(p, segments=None, init=True):
    """torch autograd (float64) through l2norm and transformers' chunked rule: with segments, each real segment of
    each row separately, the row's first from the initial state and the others from zero, padding left out."""
    x = _torch_inputs(p, requires_grad=True)
    fn = _hf("torch_chunk_gated_delta_rule", "float64")
    ids = np.ones(p["g"].shape[:2], dtype=int) if segments is None else segments
    loss = 0.0
    for b in range(ids.shape[0]):
        starts = [i for i in range(ids.shape[1]) if ids[b, i] and (i == 0 or ids[b, i - 1] != ids[b, i])]
        for n, s in enumerate(starts):
            e = s + int(np.argmax(np.append(ids[b, s:], -1) != ids[b, s]))
            init_state = x["s0"][b:b + 1] if init and n == 0 else None
            out, _ = fn(*(x[name][b:b + 1, s:e] for name in ("q", "k", "v", "g", "beta")), chunk_size=CHUNK,
                        initial_state=init_state, use_qk_l2norm_in_kernel=True)
            loss = loss + (out * torch.tensor(p["dout"][b:b + 1, s:e])).sum()
    loss.backward()
    return {n: (t.grad.numpy() if t.grad is not None else np.zeros(t.shape)) for n, t in x.items()}


def _our_grads(p, chunk=CHUNK, segments=None, init=True):
    """Our backward, then l2norm_backward for q and k: gradients of the raw inputs."""
    _, _, states = _ours(p, chunk=chunk, init=init, segments=segments)
    (q, q_inv), (k, k_inv) = dr.l2norm_forward(p["q"]), dr.l2norm_forward(p["k"])
    grads = dr.gated_delta_rule_backward(p["dout"], q, k, p["v"], p["g"], p["beta"], states, chunk,
                                         initial_state=p["s0"] if init else None, segments=segments)
    dq, dk, dv, dg, dbeta = grads[:5]
    out = dict(q=dr.l2norm_backward(dq, q, q_inv), k=dr.l2norm_backward(dk, k, k_inv), v=dv, g=dg, beta=dbeta)
    if init:
        out["s0"] = grads[5]
    else:
        assert len(grads) == 5
    return out


@pytest.mark.parametrize("t,hk,hv,init", CASES)
def test_backward_equals_autograd_through_transformers(t, hk, hv, init):
    p = _problem(t, hk, hv, seed=2)
    ours, ref = _our_grads(p, init=init), _autograd(p, init=init)
    for name, grad in ours.items():
        assert grad.shape == p[name].shape, name
        assert_close(grad, ref[name], "delta_rule_grad_f64", f"d{name}")


def _segments(t):
    """Row 0: two packed samples (50 and 70 tokens, the boundary inside a chunk) then padding; row 1: left padding,
    then one sample."""
    ids = np.zeros((B, t), dtype=np.int32)
    ids[0, :50], ids[0, 50:120], ids[1, 30:] = 1, 2, 1
    return ids


@pytest.mark.parametrize("chunk", [CHUNK, 16])
def test_segments_restart_the_state(chunk):
    """A packed and a left-padded row: each sample equals transformers run on it alone (the row's first from the
    initial state, the next from zero), padding outputs 0, the final state is the one after the last real token,
    and the gradients equal autograd over the samples run apart (0 on padding)."""
    t = 150
    p = _problem(t, 2, 4, seed=4)
    ids = _segments(t)
    out, final, _ = _ours(p, chunk=chunk, segments=ids)
    x = _torch_inputs(p)
    fn = _hf("torch_chunk_gated_delta_rule", "float64")
    for b, spans in [(0, [(0, 50), (50, 120)]), (1, [(30, 150)])]:
        for n, (s, e) in enumerate(spans):
            ref, ref_final = fn(*(x[name][b:b + 1, s:e] for name in ("q", "k", "v", "g", "beta")), chunk_size=CHUNK,
                                initial_state=x["s0"][b:b + 1] if n == 0 else None, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
            assert_close(out[b, s:e], ref.numpy()[0], "delta_rule_f64", f"row {b} tokens {s}:{e}")
        assert_close(final[b], ref_final.numpy()[0], "delta_rule_f64", f"row {b} final state")
    assert np.all(out[ids == 0] == 0.0)
    whole, _, _ = _ours(p, chunk=chunk)
    assert np.abs(whole[0, 50:120] - out[0, 50:120]).max() > 1e-3  # the restart changes the second sample
    ours, ref = _our_grads(p, chunk=chunk, segments=ids), _autograd(p, segments=ids)
    for name, grad in ours.items():
        assert_close(grad, ref[name], "delta_rule_grad_f64", f"d{name}")
    for name in ("q", "k", "v", "g", "beta"):
        assert np.all(ours[name][ids == 0] == 0.0), name


def test_initial_state_reaches_the_output():
    """The initial state is read (outputs and its own gradient change with it), so the tests above check it."""
    p = _problem(40, 2, 2, seed=5)
    with_init, _, _ = _ours(p)
    without, _, _ = _ours(p, init=False)
    assert np.abs(with_init - without).max() > 1e-2
    assert np.abs(_our_grads(p)["s0"]).max() > 1e-2
