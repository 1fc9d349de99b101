"""Client-level differential privacy for the Federated strategy (``[federated.dp]``):
DP-FedAvg (McMahan et al. 2018) with central or local noise, adaptive clipping (Andrew et
al. 2021) and Opacus's RDP accountant. :mod:`.mechanism` holds the maths as pure
functions (clip, noise, adaptive clip) and the privacy spent, :mod:`.dp`
the server's and clients' parts of a round, the job's checks and ``validate``'s
description."""

from __future__ import annotations

from .dp import ServerPrivacy, build_server_privacy, client_privatize, dp_lines, dp_problems
from .mechanism import PrivacyAccountant, rdp_epsilon

__all__ = ["PrivacyAccountant", "rdp_epsilon", "dp_lines", "dp_problems", "ServerPrivacy",
           "build_server_privacy", "client_privatize"]
