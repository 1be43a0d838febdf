"""Per-token estimators of KL(actor || reference), chosen by name.

Legend: N responses, R response tokens (right-padded). Log-probs are float32 (N, R) in nats: the
log-probability of the sampled token under the actor (``logprob``) and the reference
(``ref_logprob``). The estimators return a value on every position; callers mask padding.

With ``x ~ actor`` and ``d = ref_logprob - logprob = log(p_ref(x) / p_actor(x))``, the estimators of
J. Schulman, "Approximating KL divergence" (2020, http://joschu.net/blog/kl-approx.html) are

    k1 = -d                      unbiased, high variance, can be negative
    k2 = 0.5 * d**2              biased, low variance, >= 0
    k3 = exp(d) - d - 1          unbiased, low variance, >= 0

``low_var_kl`` is k3 with the clamps verl uses for numerical stability (verl
``core_algos.kl_penalty``): ``d`` clamped to [-20, 20] before ``exp`` and the result to [-10, 10].
"""

from __future__ import annotations

from typing import Callable

import torch

from rollplex_train.registry import Registry

KLEstimatorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry("algorithm.kl_estimator")
register_kl_estimator = KL_ESTIMATORS.register
get_kl_estimator = KL_ESTIMATORS.get
known_kl_estimators = KL_ESTIMATORS.names


@register_kl_estimator("k1")
def _k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


@register_kl_estimator("k2")
def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@register_kl_estimator("k3")
def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    d = ref_logprob - logprob
    return torch.exp(d) - d - 1.0


@register_kl_estimator("low_var_kl")
def _low_var_kl(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    d = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(actor || reference) estimate.

    Args:
        logprob: (N, R) float log-probs of the sampled tokens under the actor, nats.
        ref_logprob: (N, R) float log-probs of the same tokens under the reference, nats.
        estimator: ``k1``, ``k2``, ``k3`` or ``low_var_kl`` (formulas in the module docstring;
            Schulman 2020).

    Returns:
        (N, R) tensor of the dtype of ``logprob``, on every position (padding is not masked).
        Gradients flow to both inputs; detach ``ref_logprob`` upstream if it is frozen.

    Raises:
        ValueError: unknown ``estimator`` or mismatched shapes.
    """
    fn = get_kl_estimator(estimator)
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob {tuple(logprob.shape)} and ref_logprob {tuple(ref_logprob.shape)} differ")
    return fn(logprob, ref_logprob)

