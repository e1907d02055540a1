"""The vocabulary every layer speaks, below them all: tiers, directions and transfers
(`transfer`), block keys (`identity`), the remote index (`remote_index`) and the
eviction-policy interface (`eviction_policy`). Torch-free; imports only the standard
library and `kvswap.errors`."""
