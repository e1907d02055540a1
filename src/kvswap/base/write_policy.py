"""When blocks are written to a keyed tier: the control plane's choice, a tier's wish.

Shared vocabulary: the control plane writes each keyed tier by one of these
(`kvswap.control.remote_tier`), a `SecondaryTier` may ask for one
(`kvswap.data.tiers.base.SecondaryTier.write_policy`), and the configuration's
`remote_write_policy` names one by its value.
"""

from __future__ import annotations

import enum


class RemoteWritePolicy(enum.Enum):
    """When full blocks are written to a keyed tier (the value is the config's)."""

    ON_FINISH = "on_finish"  # a finished sequence's full blocks, once they have a CPU copy
    ON_DEMOTE = "on_demote"  # a block leaving the pinned pool (demoted, or dropped by demotion)
    OFF = "off"  # read only


#: The values a tier's `write_policy` may name (None aside: the configured policy).
WRITE_POLICIES: tuple[str, ...] = tuple(policy.value for policy in RemoteWritePolicy)
