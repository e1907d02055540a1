"""Every validation rule of the configuration, and where values come from."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvswap.config_load import config_from_values, load_config
from kvswap.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ARTICLE = ROOT / "configs" / "article-8b-40gb.toml"


def test_the_article_template_loads_unchanged() -> None:
    config = load_config(ARTICLE)
    assert config.cache.kv_block_tokens == 16
    assert config.cache.gpu_kv_capacity_blocks == 3000
    assert config.cache.cpu_kv_capacity_blocks == 12000
    assert config.cache.nvme_kv_capacity_blocks == 40000
    assert config.swap.swap_out_high_watermark == 0.85
    assert config.swap.swap_out_low_watermark == 0.65
    assert config.swap.protected_sink_blocks == 8
    assert config.swap.swap_out_chunk_blocks == 8
    assert config.swap.swap_in_chunk_blocks == 4
    assert config.swap.prefetch_stream_count == 2


def test_sectioned_and_flat_keys_mean_the_same(tmp_path: Path) -> None:
    flat = tmp_path / "flat.toml"
    flat.write_text("swap_out_chunk_blocks = 16\n")
    sectioned = tmp_path / "sectioned.toml"
    sectioned.write_text("[swap]\nswap_out_chunk_blocks = 16\n")
    assert load_config(flat) == load_config(sectioned)


def test_precedence_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("swap_out_chunk_blocks = 16\nswap_in_chunk_blocks = 2\n")
    env = {"KVSWAP_SWAP_OUT_CHUNK_BLOCKS": "12", "KVSWAP_SWAP_IN_CHUNK_BLOCKS": "3"}
    config = load_config(path, environ=env, overrides={"swap_in_chunk_blocks": 5})
    assert config.swap.swap_out_chunk_blocks == 12
    assert config.swap.swap_in_chunk_blocks == 5


def test_capacity_in_bytes_becomes_blocks() -> None:
    config = load_config(environ={}, overrides={"cpu_kv_capacity_bytes": "24GiB"})
    assert config.tier_capacities(2 * 1024**2).num_cpu_blocks == 12288


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"swap_in_low_watermark": 0.9}, "must be below swap_out_high_watermark"),
        ({"swap_out_high_watermark": 1.5}, "swap_out_high_watermark = 1.5"),
        ({"cpu_demote_low_watermark": 0.95}, "must be below cpu_demote_high_watermark"),
        ({"kv_block_tokens": 12}, "power of two"),
        ({"swap_out_chunk_blocks": 0}, "swap_out_chunk_blocks = 0"),
        ({"swap_in_chunk_blocks": -1}, "swap_in_chunk_blocks = -1"),
        ({"gpu_kv_capacity_bytes": "6 gigs"}, "is not a size"),
        ({"dtype": "int4"}, "dtype = 'int4'"),
        ({"remote_url": "http://x"}, "not a store URL"),
    ],
)
def test_bad_values_name_the_field_and_what_is_allowed(
    overrides: dict[str, object], needle: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(environ={}, overrides=overrides)
    assert needle in str(caught.value)
    assert "\n" not in str(caught.value)


def test_high_watermark_of_one_is_allowed() -> None:
    # Legal, and `kvswap plan` warns about it (the ledger's warnings, tested there).
    config = load_config(environ={}, overrides={"swap_out_high_watermark": 1.0})
    assert config.swap.swap_out_high_watermark == 1.0


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            {"gpu_kv_capacity_blocks": 4, "swap_out_chunk_blocks": 8, "evict_protected_blocks": 2},
            "larger than the GPU tier",
        ),
        ({"cpu_kv_capacity_blocks": 2, "swap_in_chunk_blocks": 4}, "larger than the CPU tier"),
        ({"gpu_kv_capacity_blocks": 4}, "protected_sink_blocks = 8"),
        ({"nvme_kv_capacity_blocks": 4}, "needs nvme_dir"),
        ({"cpu_kv_capacity_blocks": 4, "cpu_kv_capacity_bytes": "1GiB"}, "both set"),
    ],
)
def test_rules_that_need_block_counts(overrides: dict[str, object], needle: str) -> None:
    config = load_config(environ={}, overrides=overrides)
    with pytest.raises(ConfigError, match=needle):
        config.tier_capacities(1024)


def test_unknown_keys_suggest_the_closest_name(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("swap_out_high_watermak = 0.9\n")
    with pytest.raises(ConfigError, match="did you mean 'swap_out_high_watermark'"):
        load_config(path, environ={})
    path.write_text("[swap]\nswap_out_chunk_block = 9\n")
    with pytest.raises(ConfigError, match="did you mean 'swap_out_chunk_blocks'"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match="did you mean KVSWAP_EVICT_PROTECTED_BLOCKS"):
        load_config(environ={"KVSWAP_EVICT_PROTECTED_BLOCK": "4"})


def test_file_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("swap_out_chunk_blocks = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, environ={})


def test_config_is_frozen() -> None:
    config = load_config(environ={})
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises its own ValidationError
        config.swap.swap_out_chunk_blocks = 99  # type: ignore[misc]


def test_a_capacity_in_one_unit_replaces_a_lower_layers_other_unit(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("cpu_kv_capacity_blocks = 100\n")
    config = load_config(path, environ={}, overrides={"cpu_kv_capacity_bytes": "1MiB"})
    assert config.cache.cpu_kv_capacity_blocks is None
    assert config.tier_capacities(1024).num_cpu_blocks == 1024
    config = load_config(path, environ={}, defaults={"cpu_kv_capacity_bytes": "1MiB"})
    assert config.cache.cpu_kv_capacity_bytes is None


def test_the_seeds_names_are_aliases_of_the_names_that_say_what_they_mean(
    tmp_path: Path,
) -> None:
    # swap_in_low_watermark is where swap-OUT stops; evict_protected_blocks counts the
    # protected sink blocks. Both old names still work in TOML, sections, env and flags.
    flat = tmp_path / "flat.toml"
    flat.write_text("swap_in_low_watermark = 0.5\nevict_protected_blocks = 3\n")
    sectioned = tmp_path / "sectioned.toml"
    sectioned.write_text("[swap]\nswap_in_low_watermark = 0.5\nevict_protected_blocks = 3\n")
    for path in (flat, sectioned):
        config = load_config(path, environ={})
        assert config.swap.swap_out_low_watermark == 0.5
        assert config.swap.protected_sink_blocks == 3
    env = {"KVSWAP_SWAP_IN_LOW_WATERMARK": "0.4", "KVSWAP_EVICT_PROTECTED_BLOCKS": "2"}
    config = load_config(None, environ=env)
    assert (config.swap.swap_out_low_watermark, config.swap.protected_sink_blocks) == (0.4, 2)
    config = load_config(None, environ={}, overrides={"evict_protected_blocks": 5})
    assert config.swap.protected_sink_blocks == 5
    # A bad value under the old name says both names.
    with pytest.raises(ConfigError, match=r"swap_in_low_watermark \(now swap_out_low_watermark\)"):
        load_config(None, environ={}, overrides={"swap_in_low_watermark": 1.5})


def test_help_shows_the_new_flag_and_the_old_one_it_replaces() -> None:
    import argparse

    from kvswap.cli import build_parser
    from kvswap.commands.common import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, ["swap"])
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    # What `kvswap run --help` prints, its line breaks aside (a flag is never split).
    text = " ".join(commands.choices["run"].format_help().split())
    assert "--swap-out-low-watermark" in text and "--swap-in-low-watermark" in text
    assert "replaces the seed's --evict-protected-blocks" in text
    args = parser.parse_args(["--evict-protected-blocks", "4"])
    assert config_from_args(args).swap.protected_sink_blocks == 4


def test_values_from_another_engine_s_dict_are_checked_as_a_file_s_and_name_it() -> None:
    config = config_from_values({"protected_sink_blocks": 4}, "kv_connector_extra_config")
    assert config.swap.protected_sink_blocks == 4 and config.swap.min_residency_steps == 64
    with pytest.raises(ConfigError) as info:
        config_from_values({"min_residency_steps": -1}, "kv_connector_extra_config")
    assert str(info.value).startswith("min_residency_steps = -1 (from kv_connector_extra_config): ")


@pytest.mark.parametrize("namespace", ["", " ", "team a", "x" * 201, "tab\there", "\udcff"])
def test_a_bad_remote_namespace_is_refused_from_every_source_without_a_store(
    tmp_path: Path, namespace: str
) -> None:
    # Issue 30: accepted while no remote_url was given (the simulator and vLLM's tier
    # use it without one), and "" quietly fell back to the model's fingerprint.
    path = tmp_path / "ns.toml"
    path.write_text(f"[tiers]\nremote_namespace = {namespace!r}\n".replace("'", '"'))
    flag = {"remote_namespace": namespace}
    sources = {
        "command line": lambda: load_config(None, environ={}, overrides=flag),
        "environment": lambda: load_config(None, environ={"KVSWAP_REMOTE_NAMESPACE": namespace}),
        str(path): lambda: load_config(path, environ={}),
    }
    for source, load in sources.items():
        if source == "environment" and not namespace.strip():
            continue  # a blank variable is an unset one (config_sources)
        if source == str(path) and namespace == "\udcff":
            continue  # TOML text is UTF-8: no lone surrogate there
        with pytest.raises(ConfigError) as refused:
            load()
        assert str(refused.value).startswith("remote_namespace = ")
        assert str(refused.value).endswith(
            f"(from {source}): allowed: 1 to 200 printable characters without spaces"
        )
    good = load_config(None, environ={}, overrides={"remote_namespace": "team-a:v2"})
    assert good.tiers.remote_namespace == "team-a:v2"


def test_a_hash_tag_namespace_is_refused_for_a_cluster_when_configured() -> None:
    """The store refuses it too (`RemoteStoreClient`); the configuration says so first,
    before any engine or server starts."""
    cluster = {"remote_url": "redis+cluster://127.0.0.1:7000", "remote_namespace": "{model}"}
    with pytest.raises(ConfigError) as refused:
        load_config(None, environ={}, overrides=cluster)
    message = str(refused.value)
    assert message.startswith("remote_namespace = '{model}' on a cluster: a '{...}' hash tag")
    assert "\n" not in message
    one_server = {**cluster, "remote_url": "redis://127.0.0.1:6379/0"}
    assert load_config(None, environ={}, overrides=one_server).tiers.remote_namespace == "{model}"
