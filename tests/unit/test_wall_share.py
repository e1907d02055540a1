"""benchmarks/wall_share.py: the sampler charges each sample to the innermost kvswap module
on the sampled thread's stack, and to nothing else."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvswap.base.identity import KEY_BYTES, chain_key

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from wall_share import WallShare


def test_samples_are_charged_to_the_innermost_kvswap_module() -> None:
    with WallShare(interval_s=0.001) as share:
        while share.num_samples < 20:
            chain_key(bytes(KEY_BYTES), range(16))  # kvswap code, called from here
            time.sleep(0)
    shares = share.by_module()
    assert sum(shares.values()) >= 0.99
    assert set(shares) <= {"base/identity.py", "(outside kvswap)"}
    assert share.of(["base/"]) == shares.get("base/identity.py", 0.0)
    assert share.of(["control/"]) == 0.0
