"""Secondary tiers: KV blocks by key below the pinned host pool (`base.SecondaryTier`).

- `base.py`: the interface, `SecondaryTier`, `TransferJob`, `JobResult` (torch-free)
- `copy_adapter.py`: any tier as the control plane's remote tier (CopyEngine + RemoteIndex)
- `tier_list.py`: an ordered list of tiers as one (stores to each, loads falling through)
- `user_tier.py`: a user's tier whose exceptions stop kvswap in one line naming it
- `lanes.py`: `LaneTier`, the job bookkeeping of tiers whose copies run on threads
- `redis_tier.py`: the shared store on the Redis protocol
- `nvme_tier.py`: the NVMe slab by key, evicting its least valuable blocks for room
"""
