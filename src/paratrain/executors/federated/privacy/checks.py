"""``[federated.dp]`` against the rest of the job: what cannot work (a ConfigError naming
the field) and what is in effect (``paratrain validate``'s lines)."""

from __future__ import annotations

from typing import Any

from .dp import CENTRAL_AGGREGATIONS, sample_rate
from .mechanism import update_noise_multiplier

__all__ = ["dp_problems", "dp_lines"]

# client parts that leave the client beside the update, outside the mechanism
UNPRIVATISED = {"SCAFFOLD": "its control-variate change dc_i", "FedNova": "its local step count tau_i"}


def dp_problems(job: Any) -> list[tuple[str, str]]:
    """Why this job's ``[federated.dp]`` cannot run (empty when it can)."""
    spec = job.federated.dp
    if spec is None:
        return []
    out: list[tuple[str, str]] = []
    method = str(getattr(job.strategy.aggregation, "method", ""))
    if method in UNPRIVATISED:
        out.append(("strategy.aggregation.method", (
            f"{method} sends {UNPRIVATISED[method]} next to each update, which [federated.dp] "
            f"does not clip or noise; use {', '.join(CENTRAL_AGGREGATIONS)} (central or local "
            f"DP) or a robust aggregator with mode = \"local\"")))
    elif spec.mode == "central" and method not in CENTRAL_AGGREGATIONS:
        out.append(("federated.dp.mode", (
            f"central DP noises the sum of the clipped updates, but {method} needs the single "
            f"updates (a median, a trimmed mean or Krum's scores of noise-free updates would "
            f"each be a release of their own); use mode = \"local\" (every client noises its "
            f"own update) or one of {', '.join(CENTRAL_AGGREGATIONS)}")))
    if spec.target_quantile is not None:
        q = sample_rate(job.strategy, spec.mode)
        std = (spec.clipped_count_stddev if spec.clipped_count_stddev is not None
               else q * int(job.strategy.num_clients) / 20.0)
        try:
            update_noise_multiplier(float(spec.noise_multiplier), float(std))
        except ValueError as e:
            out.append(("federated.dp.clipped_count_stddev", str(e)))
    return out


def dp_lines(job: Any) -> list[str]:
    """What ``[federated.dp]`` puts in effect, for ``paratrain validate``."""
    spec = job.federated.dp
    if spec is None or getattr(job.strategy, "type", None) != "Federated" or dp_problems(job):
        return []
    from .accountant import last_round_within, rdp_epsilon

    strat = job.strategy
    q = sample_rate(strat, spec.mode)
    z = float(spec.noise_multiplier)
    clip = "inf (no clipping)" if spec.clip is None else f"{spec.clip:g}"
    if spec.target_quantile is not None:
        clip += (f", adaptive to the {spec.target_quantile:g} quantile (eta "
                 f"{spec.clip_learning_rate:g})")
    if spec.mode == "central":
        how = (f"central DP-FedAvg: the server clips each update to L2 {clip}, adds "
               f"N(0, ({z:g} x clip x {spec.weight_cap})^2) to the sum of min(n_k, "
               f"{spec.weight_cap})-weighted updates and divides by the expected total weight")
    else:
        how = (f"local DP: each client clips its update to L2 {clip} and adds "
               f"N(0, ({z:g} x clip)^2) before compressing")
    rounds = int(strat.rounds)
    eps = rdp_epsilon([(z, q, rounds)], float(spec.delta))
    lines = [f"differential privacy: {how}",
             f"differential privacy: accountant Opacus RDP, sample rate {q:g} per round, delta "
             f"{spec.delta:g}: epsilon {eps:.4g} after all {rounds} rounds"]
    if spec.target_epsilon is not None and eps > spec.target_epsilon:
        last = last_round_within(z, q, float(spec.delta), float(spec.target_epsilon), rounds)
        lines.append(f"differential privacy: target_epsilon {spec.target_epsilon:g} stops the "
                     f"run after round {last}")
    return lines
