"""Client-level differential privacy for the Federated strategy (``[federated.dp]``): the
maths and the privacy spent (:mod:`.mechanism`), the round's server and client parts, the
job's checks and ``validate``'s description (:mod:`.dp`)."""

from __future__ import annotations

from .dp import ServerPrivacy, build_server_privacy, client_privatize, dp_lines, dp_problems
from .mechanism import PrivacyAccountant, rdp_epsilon

__all__ = ["PrivacyAccountant", "rdp_epsilon", "dp_lines", "dp_problems", "ServerPrivacy",
           "build_server_privacy", "client_privatize"]
