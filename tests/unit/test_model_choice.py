"""Which model the engine runs: flags, then what a configuration set, then the default."""

from __future__ import annotations

import pytest

from kvswap.errors import KvSwapError
from kvswap.model.choice import ConfiguredModel, ModelChoice, choose_engine_model


def choose(
    model_flag: str | None = None, dtype_flag: str | None = None, **configured: str
) -> ModelChoice:
    """`configured`: what a file or KVSWAP_* set in [model] (preset, hf_config, dtype)."""
    return choose_engine_model(
        model_flag, dtype_flag, ConfiguredModel(**configured), default_model="small"
    )


def test_flags_then_the_configuration_then_the_default() -> None:
    assert choose() == ModelChoice("small", None)
    assert choose(preset="tiny", dtype="bf16") == ModelChoice("tiny", "bf16")
    assert choose("small", "fp32", preset="tiny", dtype="fp8") == ModelChoice("small", "fp32")
    # A flag wins over what the engine could not run anyway.
    assert choose("tiny", hf_config="/x/config.json") == ModelChoice("tiny", None)


@pytest.mark.parametrize(
    ("configured", "needle"),
    [
        ({"preset": "article-8b"}, "preset = 'article-8b'"),
        ({"hf_config": "/x/config.json"}, "use --model DIR"),
        ({"dtype": "fp8"}, "use --dtype fp32|fp16|bf16"),
    ],
)
def test_what_the_engine_cannot_run_is_one_line_naming_the_flag(
    configured: dict[str, str], needle: str
) -> None:
    with pytest.raises(KvSwapError, match=needle.replace("|", r"\|")) as caught:
        choose(**configured)
    assert "\n" not in str(caught.value)
