"""Issue 13, items 7 and 10: `kvswap plan` and the config reject what they cannot hold.

Every case is a user mistake: one line on stderr, exit code 2, never a traceback
(`main` lets anything but a KvSwapError through, so a traceback fails the test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvswap.cli import main
from kvswap.config_load import load_config
from kvswap.errors import ConfigError, KvSwapError
from kvswap.ledger import check_measured_link, make_plan
from tests.unit.test_ledger import article_plan

SIZE_FLAGS = ("--gpu-mem-gib", "--weights-gib", "--reserve-gib", "--cpu-pool-gib", "--nvme-gib")


def plan_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvswap: error: ")
    for needle in needles:
        assert needle in err


@pytest.fixture(autouse=True)
def _no_kvswap_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # A KVSWAP_* variable in the developer's shell must not change what these tests see.
    import os

    for name in [name for name in os.environ if name.startswith("KVSWAP_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300", "-1"])
@pytest.mark.parametrize("flag", SIZE_FLAGS)
def test_plan_size_flag_nan_inf_or_huge_is_a_one_line_error_naming_flag_and_range(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    code, out, err = plan_cli(capsys, f"{flag}={value}")  # `=`: "-inf" is not a flag
    assert_one_line_error(code, out, err, flag, "allowed: a finite number of GiB in 0..1048576")


@pytest.mark.parametrize("flag", ["--link-gb-per-s", "--link-gbps"])
@pytest.mark.parametrize("value", ["nan", "inf", "0", "-3", "1e-300", "1e300"])
def test_plan_link_gb_per_s_nan_inf_or_out_of_range_is_rejected(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    code, out, err = plan_cli(capsys, f"{flag}={value}", "--json")
    assert_one_line_error(code, out, err, "--link-gb-per-s", "allowed: a finite rate in")


def _bench_report(path: Path, gb_per_s: float) -> Path:
    row = {"memory": "pinned", "bytes": 1 << 24, "num_repeats": 3, "gb_per_s_min": gb_per_s,
           "gb_per_s_median": gb_per_s, "gb_per_s_max": gb_per_s}  # fmt: skip
    report = {
        "schema_version": 1,
        "device": "cuda",
        "device_name": "test GPU",
        "note": None,
        "torch_version": "0",
        "created_unix_s": 0.0,
        "results": [{"op": "h2d", **row}, {"op": "d2h", **row}],
    }
    path.write_text(json.dumps(report), encoding="utf-8")
    return path


def test_plan_bench_report_with_0_gb_per_s_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _bench_report(tmp_path / "bench.json", 0.0)
    code, out, err = plan_cli(capsys, "--bench", str(path))
    assert_one_line_error(code, out, err, str(path), "0 GB/s", "rerun `kvswap bench`")


def test_plan_bench_report_with_a_real_rate_still_plans(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _bench_report(tmp_path / "bench.json", 24.0)
    code, out, _ = plan_cli(capsys, "--bench", str(path), "--json")
    assert code == 0
    assert json.loads(out)["cpu_to_gpu_gb_per_s"] == 24.0


def test_the_measured_link_check_names_the_report_and_the_direction() -> None:
    # The one check `simulate` and `tune` share with `plan` (kvswap.ledger).
    with pytest.raises(KvSwapError, match=r"^r\.json: the measured d2h link = 0 GB/s"):
        check_measured_link(25.0, 0.0, "r.json")
    check_measured_link(25.0, 12.0, "r.json")


def test_plan_json_never_prints_nan_or_infinity_at_the_edges_of_every_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    edges = ["--gpu-mem-gib", "1048576", "--weights-gib", "0", "--reserve-gib", "0",
             "--cpu-pool-gib", "1048576", "--nvme-gib", "1048576", "--link-gb-per-s", "0.001",
             "--context-tokens", "1073741824", "--concurrency", "1048576", "--json"]  # fmt: skip

    def refuse(constant: str) -> object:
        raise AssertionError(f"plan --json printed {constant}, which is not JSON")

    code, out, _ = plan_cli(capsys, *edges)
    assert code == 0
    plan = json.loads(out, parse_constant=refuse)
    assert plan["swap_out_chunk_ms"] > 0


def test_ledger_refuses_a_zero_link_instead_of_dividing_by_it() -> None:
    with pytest.raises(KvSwapError, match="gpu_to_cpu_gb_per_s = 0 GB/s"):
        make_plan(article_plan(gpu_to_cpu_gb_per_s=0.0))
    with pytest.raises(KvSwapError, match="cpu_to_gpu_gb_per_s = nan GB/s"):
        make_plan(article_plan(cpu_to_gpu_gb_per_s=float("nan")))


@pytest.mark.parametrize(("flag", "value"), [("--context-tokens", "99999999999999999999"),
                                             ("--concurrency", "10000000000")])  # fmt: skip
def test_plan_huge_context_or_concurrency_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    code, out, err = plan_cli(capsys, flag, value)
    assert_one_line_error(code, out, err, flag, "allowed: 1..")


def test_plan_gpu_tier_from_gpu_size_no_larger_than_the_protected_blocks_is_rejected(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 40 GiB - 36 GiB of weights - 0 reserve = 4 GiB = 2048 blocks of 2 MiB.
    args = ["--weights-gib", "36", "--reserve-gib", "0"]
    code, out, err = plan_cli(capsys, *args, "--protected-sink-blocks", "2048")
    assert_one_line_error(code, out, err, "protected_sink_blocks = 2048", "allowed: 0..2047")
    code, _, _ = plan_cli(capsys, *args, "--protected-sink-blocks", "2047")
    assert code == 0


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "text",
    ["kv_block_tokens = true\n", "[cache]\nkv_block_tokens = true\n", "kv_block_tokens = false\n"],
)
def test_toml_kv_block_tokens_true_is_rejected_not_read_as_1_token_blocks(
    tmp_path: Path, text: str
) -> None:
    with pytest.raises(
        ConfigError, match=r"^kv_block_tokens = (True|False) \(from .*\): a boolean"
    ):
        load_config(_toml(tmp_path, text), environ={})


@pytest.mark.parametrize(
    "key", ["swap_out_high_watermark", "swap_out_chunk_blocks", "gpu_kv_capacity_blocks", "seed"]
)
def test_toml_boolean_for_any_number_field_is_rejected(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key} = True .*a boolean is not a number"):
        load_config(_toml(tmp_path, f"{key} = true\n"), environ={})


def test_toml_boolean_for_nvme_persist_is_still_accepted(tmp_path: Path) -> None:
    config = load_config(_toml(tmp_path, "nvme_persist = true\n"), environ={})
    assert config.tiers.nvme_persist is True


@pytest.mark.parametrize("key", ["swap_out_high_watermark", "cpu_demote_low_watermark"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_toml_nan_or_inf_watermark_is_rejected(tmp_path: Path, key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}.* {value}[ ;].*finite number"):
        load_config(_toml(tmp_path, f"{key} = {value}\n"), environ={})


def test_protected_sink_blocks_equal_to_the_gpu_tier_is_rejected() -> None:
    config = load_config(
        environ={}, overrides={"gpu_kv_capacity_blocks": 8, "protected_sink_blocks": 8}
    )
    with pytest.raises(ConfigError, match=r"protected_sink_blocks = 8: .* allowed: 0\.\.7$"):
        config.tier_capacities(1024)


def test_protected_sink_blocks_one_below_the_gpu_tier_is_allowed() -> None:
    config = load_config(
        environ={},
        overrides={"gpu_kv_capacity_blocks": 9, "protected_sink_blocks": 8,
                   "swap_out_chunk_blocks": 8},
    )  # fmt: skip
    assert config.tier_capacities(1024).num_gpu_blocks == 9


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_nvme_dir_is_rejected(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^nvme_dir = .*an empty path is not a directory"):
        load_config(environ={}, overrides={"nvme_dir": value})


def test_empty_nvme_dir_in_toml_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="an empty path is not a directory"):
        load_config(_toml(tmp_path, '[tiers]\nnvme_dir = ""\n'), environ={})


def test_nvme_dir_with_a_nul_byte_is_rejected() -> None:
    with pytest.raises(ConfigError, match="NUL byte"):
        load_config(environ={}, overrides={"nvme_dir": "/tmp/a\0b"})


def test_section_name_with_a_plain_value_says_it_is_a_section(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = plan_cli(capsys, "--config", str(_toml(tmp_path, 'model = "x"\n')))
    assert_one_line_error(code, out, err, "'model' is a section", "write [model]", "preset")
    assert "did you mean 'model'" not in err


@pytest.mark.parametrize(
    "overrides",
    [
        {"gpu_kv_capacity_bytes": "9" * 400 + "GiB"},
        {"cpu_kv_capacity_bytes": 10**400},
        {"nvme_kv_capacity_bytes": "2048TiB"},
    ],
)
def test_capacity_bytes_past_1_pib_is_a_short_one_line_error(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=r"too large; allowed: 0\.\.1125899906842624") as caught:
        load_config(environ={}, overrides=overrides)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


@pytest.mark.parametrize("value", [2**41, 1e300])
def test_capacity_blocks_past_2_to_the_40_is_rejected(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^cpu_kv_capacity_blocks = "):
        load_config(environ={}, overrides={"cpu_kv_capacity_blocks": value})


def test_plan_capacity_flag_with_hundreds_of_digits_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = plan_cli(capsys, "--swap-out-chunk-blocks", "9" * 400)
    assert_one_line_error(code, out, err, "swap_out_chunk_blocks")
    assert len(err) < 300


def test_plan_nvme_gib_plans_without_an_nvme_dir(capsys: pytest.CaptureFixture[str]) -> None:
    # `plan` makes no slab and has no --nvme-dir flag; `run` still needs the directory.
    code, out, _ = plan_cli(capsys, "--nvme-gib", "1", "--json")
    assert code == 0
    assert json.loads(out)["nvme_kv_capacity_blocks"] == 512
    config = load_config(environ={}, overrides={"nvme_kv_capacity_bytes": "1GiB"})
    with pytest.raises(ConfigError, match="needs nvme_dir"):
        config.tier_capacities(2 * 1024**2)


# --- an nvme_dir with no NVMe tier is refused, not ignored -----------------------------


@pytest.mark.parametrize(
    ("overrides", "capacity"),
    [
        ({"nvme_dir": "/nonexistent"}, "nvme_kv_capacity_blocks is unset"),
        ({"nvme_dir": "/nonexistent", "nvme_kv_capacity_blocks": 0}, "blocks is 0"),
        ({"nvme_dir": "/nonexistent", "nvme_kv_capacity_bytes": "0GiB"}, "bytes is 0"),
    ],
    ids=["unset", "zero-blocks", "zero-bytes"],
)
def test_nvme_dir_without_an_nvme_capacity_is_one_line_naming_both(
    overrides: dict[str, object], capacity: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(environ={}, overrides=overrides)
    message = str(caught.value)
    assert message.startswith("nvme_dir = '/nonexistent' (from command line) is set but nvme_kv")
    assert capacity in message and "drop --nvme-dir" in message and "\n" not in message


def test_nvme_dir_without_capacity_in_a_toml_file_or_the_environment_is_refused(
    tmp_path: Path,
) -> None:
    path = _toml(tmp_path, '[tiers]\nnvme_dir = "/var/tmp/kvswap"\n')
    with pytest.raises(ConfigError, match=rf"^nvme_dir = '/var/tmp/kvswap' \(from {path}\)"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match=r"\(from environment\) is set but"):
        load_config(environ={"KVSWAP_NVME_DIR": "/x"})


def test_an_nvme_dir_a_later_layer_turns_off_or_defaults_name_is_allowed(tmp_path: Path) -> None:
    # The article's file names a directory and a tier; a flag turning the tier off wins.
    article = Path(__file__).parents[2] / "configs" / "article-8b-40gb.toml"
    config = load_config(article, environ={})
    assert config.tiers.nvme_dir is not None and config.cache.nvme_kv_capacity_blocks
    off = load_config(article, environ={}, overrides={"nvme_kv_capacity_blocks": 0})
    assert off.cache.nvme_kv_capacity_blocks == 0
    # A command's own defaults (simulate's) may name a directory that goes unused.
    defaults = {"nvme_dir": "/var/tmp/kvswap", "nvme_kv_capacity_blocks": 40000}
    quiet = load_config(environ={}, defaults=defaults, overrides={"nvme_kv_capacity_blocks": 0})
    assert quiet.cache.nvme_kv_capacity_blocks == 0
    given = load_config(environ={}, overrides={"nvme_dir": "/x", "nvme_kv_capacity_blocks": 4})
    assert given.tiers.nvme_dir == "/x"


def test_run_with_nvme_dir_alone_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["run", "--model", "tiny", "--device", "cpu", "--nvme-dir", "/nonexistent"])
    out, err = capsys.readouterr()
    assert_one_line_error(code, out, err, "nvme_dir = '/nonexistent'", "nvme_kv_capacity_blocks")
