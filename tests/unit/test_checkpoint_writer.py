"""`kvswap checkpoint`: a preset saved as a checkpoint that transformers (and so vLLM and
SGLang) loads, computing what kvswap's own engine computes with that preset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvswap.cli import main
from kvswap.model.generate import generate_reference
from kvswap.model.loader import load_model
from kvswap.serve.builtin_text import builtin_tokenizer
from kvswap.serve.checkpoint_writer import FILES, write_checkpoint


def test_transformers_loads_the_checkpoint_and_generates_what_kvswap_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "tiny"
    assert main(["checkpoint", "tiny", str(directory)]) == 0
    assert "wrote tiny" in capsys.readouterr().out
    assert sorted(p.name for p in directory.iterdir()) == sorted(FILES)
    text = "Hello there, kvswap"
    expected_ids = builtin_tokenizer(256).encode(text).ids
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer(text).input_ids == expected_ids
    model = AutoModelForCausalLM.from_pretrained(directory)
    prompt = torch.tensor([expected_ids])
    hf_tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)[0, len(expected_ids) :]
    for source in ("tiny", str(directory)):  # the preset, and the checkpoint through kvswap
        ours, _ = load_model(source, None, torch.device("cpu"), batch_invariant=True)
        reference = generate_reference(ours, expected_ids, 8, block_tokens=16).token_ids
        assert list(reference) == hf_tokens.tolist()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in chat


def test_a_tied_head_is_saved_once(tmp_path: Path) -> None:
    """`small` ties its LM head to the embedding: saved once, as transformers saves it."""
    from safetensors import safe_open

    files = write_checkpoint("small", tmp_path / "small")
    with safe_open(str(files[FILES.index("model.safetensors")]), "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["checkpoint", "llama-3.1-8b", "x"], "invalid choice: 'llama-3.1-8b'"),
        (["checkpoint", "tiny"], "the following arguments are required: directory"),
    ],
)
def test_bad_arguments_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_directory_with_files_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["checkpoint", "tiny", str(tmp_path)]) == 2
    assert "is not empty; allowed: a new or empty directory" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
