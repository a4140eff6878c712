"""init.from_hf adopts the checkpoint's model fields and tokenizer: fields the user left alone
come from config.json (and are listed), a field set to another value is refused naming both,
and a tokenizer other than the folder's is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.core.problems import RecipeError
from pretrain.core.schema import RecipeConfig
from pretrain.dataprep.tokenizer import train_bpe
from pretrain.launcher.compose.from_hf import adopt_hf_model, adopted_lines

transformers = pytest.importorskip("transformers")

SCALING = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A Llama 3.2 1B-format config.json as transformers writes it (no weights needed)."""
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        rope_scaling=dict(SCALING), tie_word_embeddings=True, max_position_embeddings=131072,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def recipe(folder: Path) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.init.from_hf = str(folder)
    return cfg


def test_fields_left_alone_come_from_config_json_and_are_listed(folder: Path) -> None:
    cfg = recipe(folder)
    lines = adopted_lines(cfg, [])
    m = cfg.model
    assert (m.vocab_size, m.dim, m.ffn_dim, m.n_layers, m.n_heads, m.kv_heads) == (
        128256, 2048, 8192, 16, 32, 8,
    )  # fmt: skip
    assert (m.rope_theta, m.tie_embeddings, m.rope_scaling) == (500000.0, True, SCALING)
    assert m.max_seq_len == RecipeConfig().model.max_seq_len  # the run's length stays the run's
    assert lines[0] == f"from {folder}/config.json:"
    assert "  model.rope_theta=500000.0" in lines and "  model.tie_embeddings=True" in lines
    assert any(line.startswith('  model.rope_scaling={"rope_type": "llama3"') for line in lines)


def test_a_field_given_on_the_command_line_differently_is_refused_naming_both(
    folder: Path,
) -> None:
    cfg = recipe(folder)
    cfg.model.rope_theta, cfg.model.dim = 10000.0, 2048  # rope_theta: the default, but given
    with pytest.raises(RecipeError) as err:
        adopt_hf_model(cfg, ["model.rope_theta=10000.0", "model.dim=2048"])
    (problem,) = err.value.problems
    assert (problem.field, problem.value) == ("model.rope_theta", 10000.0)
    assert "has 500000.0 (config.json)" in problem.reason


def test_a_field_a_recipe_set_differently_is_refused_and_equal_ones_pass(folder: Path) -> None:
    cfg = recipe(folder)
    cfg.model.n_layers, cfg.model.dim = 8, 2048  # set by a recipe (not the defaults)
    with pytest.raises(RecipeError) as err:
        adopt_hf_model(cfg, [])
    assert [p.field for p in err.value.problems] == ["model.n_layers"]
    assert "has 16" in err.value.problems[0].reason


def _tokenizer(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe([[text] * 20], 300)
    tokenizer.save(str(path))
    return path


def test_the_folders_tokenizer_is_used_unless_another_is_given_which_is_refused(
    folder: Path, tmp_path: Path
) -> None:
    _tokenizer(folder / "tokenizer.json", "the quick brown fox jumps over the lazy dog")
    cfg = recipe(folder)
    assert f"  data.tokenizer={folder} (the checkpoint's tokenizer)" in adopted_lines(cfg, [])
    assert cfg.data.tokenizer == str(folder)

    other = _tokenizer(tmp_path / "other" / "tokenizer.json", "lorem ipsum dolor sit amet")
    cfg = recipe(folder)
    cfg.data.tokenizer = str(other)
    with pytest.raises(RecipeError) as err:
        adopt_hf_model(cfg, [f"data.tokenizer={other}"])
    (problem,) = err.value.problems
    assert problem.field == "data.tokenizer" and "is another tokenizer" in problem.reason

    cfg = recipe(folder)
    with pytest.raises(RecipeError, match="newly trained tokenizer"):
        adopt_hf_model(cfg, ["data.tokenizer=train"])
