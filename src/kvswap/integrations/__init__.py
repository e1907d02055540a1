"""Thin adapters onto the engines users run: transformers (`integrations.transformers`),
SGLang's HiCache (`integrations.sglang`).

An adapter translates an engine's calls into kvswap's and back; it holds no policy
and no tier logic of its own. Which block leaves the device is an `EvictionPolicy`'s
call, moves are the `Swapper`'s and the copy engine's, values are checked by
`remote_format`, block keys come from `control.identity`. Each adapter imports its
engine's package, which kvswap itself does not depend on.
"""
