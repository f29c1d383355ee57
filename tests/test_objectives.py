"""The preference objectives' math (training/objectives/): every derivative against central differences of its
loss, SimPO's and ORPO's losses and metrics against TRL's own loss functions, and the settings' checks."""
from __future__ import annotations

import types

import numpy as np
import pytest

from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives import PreferenceSettings, kto_objective, pair_objective

from tolerances import assert_close

CASES = [dict(objective="dpo", dpo_loss=loss) for loss in ("sigmoid", "ipo", "hinge")] + [
    dict(objective="dpo", dpo_loss="robust", label_smoothing=0.2), dict(objective="simpo", beta=2.0),
    dict(objective="simpo", label_smoothing=0.1), dict(objective="orpo", beta=0.3)]


def _pairs(seed=0, p=5):
    rng = np.random.default_rng(seed)
    nc, nr = rng.integers(3, 9, p), rng.integers(3, 9, p)
    chosen, rejected = -rng.uniform(0.3, 2.0, p) * nc, -rng.uniform(0.3, 2.0, p) * nr
    ref_c, ref_r = chosen + rng.normal(0, 1.5, p), rejected + rng.normal(0, 1.5, p)
    return chosen, rejected, nc, nr, ref_c, ref_r


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_pair_derivatives_match_central_differences(case):
    s = PreferenceSettings(**case)
    chosen, rejected, nc, nr, ref_c, ref_r = _pairs()
    result = pair_objective(s, chosen, rejected, nc, nr, ref_c, ref_r, nll=(4.0, 20))
    logps = np.concatenate([chosen, rejected])
    p, h = chosen.size, 1e-6
    for r in range(logps.size):
        plus, minus = logps.copy(), logps.copy()
        plus[r] += h
        minus[r] -= h
        numeric = (pair_objective(s, plus[:p], plus[p:], nc, nr, ref_c, ref_r, nll=(4.0, 20)).loss
                   - pair_objective(s, minus[:p], minus[p:], nc, nr, ref_c, ref_r, nll=(4.0, 20)).loss) / (2 * h)
        assert_close(np.float64(result.dlogps[r]), np.float64(numeric), "finite_difference_f64", f"row {r}")


def test_kto_derivatives_match_central_differences():
    s = PreferenceSettings("kto", beta=0.2, desirable_weight=1.3, undesirable_weight=0.7)
    rng = np.random.default_rng(1)
    logps, ref = -rng.uniform(2, 9, 6), -rng.uniform(2, 9, 6)
    good = np.array([1, 0, 1, 1, 0, 0], bool)
    kl, ref_kl = -rng.uniform(2, 9, 6), -rng.uniform(4, 12, 6)
    result = kto_objective(s, logps, ref, good, kl, ref_kl)
    assert result.metrics["kl"] > 0
    for r in range(logps.size):
        plus, minus = logps.copy(), logps.copy()
        plus[r] += 1e-6
        minus[r] -= 1e-6
        numeric = (kto_objective(s, plus, ref, good, kl, ref_kl).loss
                   - kto_objective(s, minus, ref, good, kl, ref_kl).loss) / 2e-6
        assert_close(np.float64(result.dlogps[r]), np.float64(numeric), "finite_difference_f64", f"row {r}")


def _trl_self(**fields):
    """The attributes TRL's loss methods read from their trainer."""
    import torch

    return types.SimpleNamespace(accelerator=types.SimpleNamespace(device=torch.device("cpu")), **fields)


@pytest.mark.parametrize("smoothing", [0.0, 0.15])
def test_simpo_equals_trl_cpo_loss(smoothing):
    torch = pytest.importorskip("torch")
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    s = PreferenceSettings("simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=smoothing)
    chosen, rejected, nc, nr, _, _ = _pairs(2)
    ours = pair_objective(s, chosen, rejected, nc, nr)
    this = _trl_self(alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0, label_smoothing=smoothing)
    losses, cr, rr = cpo.CPOTrainer.cpo_loss(this, torch.tensor(chosen / nc), torch.tensor(rejected / nr))
    assert_close(np.float64(ours.loss), np.float64(losses.mean()), "finite_difference_f64")
    assert_close(np.float64(ours.metrics["rewards/chosen"]), np.float64(cr.mean()), "finite_difference_f64")
    assert_close(np.float64(ours.metrics["rewards/margins"]), np.float64((cr - rr).mean()), "finite_difference_f64")


def test_orpo_equals_trl_odds_ratio_loss():
    torch = pytest.importorskip("torch")
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    s = PreferenceSettings("orpo", beta=0.25)
    chosen, rejected, nc, nr, _, _ = _pairs(3)
    nll = (13.5, 30)                        # the chosen rows' token losses over prompt and completion
    ours = pair_objective(s, chosen, rejected, nc, nr, nll=nll)
    losses, _, _, ratio, log_odds = orpo.ORPOTrainer.odds_ratio_loss(
        _trl_self(beta=0.25), torch.tensor(chosen / nc), torch.tensor(rejected / nr))
    assert_close(np.float64(ours.loss), np.float64(13.5 / 30 - losses.mean()), "finite_difference_f64")
    assert ours.nll_grad == 1 / 30 and ours.metrics["nll_loss"] == 13.5 / 30
    assert_close(np.float64(ours.metrics["log_odds_ratio"]), np.float64(ratio), "finite_difference_f64")
    assert_close(np.float64(ours.metrics["log_odds_chosen"]), np.float64(log_odds), "finite_difference_f64")


@pytest.mark.parametrize("bad, match", [
    (dict(objective="dpo", dpo_loss="nope"), "dpo_loss must be one of"),
    (dict(objective="dpo", label_smoothing=0.1), "label_smoothing applies to"),
    (dict(objective="dpo", dpo_loss="robust", label_smoothing=0.5), r"label_smoothing must lie in \[0, 0.5\)"),
    (dict(objective="kto", beta=0.0), "beta must be positive"),
    (dict(objective="ppo"), "objective must be one of"),
])
def test_bad_settings_are_one_line(bad, match):
    with pytest.raises(ConfigError, match=match):
        PreferenceSettings(**bad)
