"""Model shapes from Hugging Face config.json files (experiments/config/hf_config.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.config import (
    PRESETS,
    Cell,
    ModelConfig,
    hf_overrides,
    model_from_hf_config,
    resolve_model,
)

# The fields of the published config.json files (huggingface.co/<repo>/blob/main/config.json)
# that the shape reads, plus a few it ignores, as they appear there.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "vocab_size": 128256, "torch_dtype": "bfloat16",
}
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
    "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
    "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False,
    "max_window_layers": 64, "tie_word_embeddings": False, "vocab_size": 151936,
}


def _write(tmp_path, cfg: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def test_llama3_8b_config_is_the_preset(tmp_path):
    cfg, overrides = model_from_hf_config(_write(tmp_path, LLAMA3_8B))
    assert cfg == PRESETS["llama3-8b"]
    # every field is overridden: the result does not depend on the base preset
    assert {k for k, _ in overrides} == {f.name for f in dataclasses.fields(ModelConfig)}
    assert resolve_model("tiny", overrides) == cfg


def test_qwen3_32b_config_is_the_preset_shape(tmp_path):
    cfg, _ = model_from_hf_config(_write(tmp_path, QWEN3_32B))
    # head_dim 128 with hidden 5120 and 64 heads: H * d_h = 8192 > dim, as the preset has it.
    # The published rms_norm_eps is 1e-6; the preset keeps ModelConfig's default 1e-5 (the
    # epsilon changes neither memory nor time).
    assert cfg == dataclasses.replace(PRESETS["qwen3-32b"], norm_eps=1e-6)
    assert cfg.head_dim == 128 and cfg.n_heads * cfg.head_dim == 8192


def test_overrides_make_a_cell_with_that_model(tmp_path):
    path = _write(tmp_path, QWEN3_32B)
    preset, overrides = hf_overrides(path)
    cell = Cell(method="ulysses", model=preset, overrides=overrides, seq_len=8192, nproc=8)
    assert cell.validate() == model_from_hf_config(path)[0]


def test_a_folder_holding_config_json_and_defaults(tmp_path):
    small = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
             "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
             "vocab_size": 151936, "tie_word_embeddings": True,
             "sliding_window": 32768, "use_sliding_window": False,  # a window, switched off
             "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
    _write(tmp_path, small)
    cfg, _ = model_from_hf_config(tmp_path)
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.rope_theta, cfg.tie_embeddings) == \
        (64, 2, 1e6, True)
    assert cfg.norm_eps == 1e-6  # transformers' default when the file leaves it out


def test_mistral_without_window_and_gqa_default(tmp_path):
    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
               "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 32768,
               "sliding_window": None, "rope_theta": 1000000.0}
    cfg, _ = model_from_hf_config(_write(tmp_path, mistral))
    assert cfg.n_kv_heads == 32 and cfg.head_dim == 128  # defaults: heads, hidden / heads


@pytest.mark.parametrize("change, match", [
    ({"num_hidden_layers": None}, "lacks 'num_hidden_layers'"),
    ({"vocab_size": "big"}, "vocab_size must be a positive integer"),
    ({"model_type": "gpt2"}, r"model_type must be one of \['llama', 'mistral', 'qwen2', "
                             r"'qwen3'\], got 'gpt2'"),
    ({"model_type": "qwen3_moe", "num_experts": 128}, "num_experts = 128: a mixture-of-experts"),
    ({"model_type": "mistral", "num_local_experts": 8}, "num_local_experts = 8"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window = 4096"),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True},
     "sliding-window attention"),
    ({"num_key_value_heads": 5}, r"model.n_heads \(32\) must be a multiple of model.n_kv_heads"),
])
def test_refused_with_the_field(tmp_path, change, match):
    cfg = {k: v for k, v in (LLAMA3_8B | change).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        model_from_hf_config(_write(tmp_path, cfg))


def test_mistral_v01_default_window_is_refused(tmp_path):
    """MistralConfig's sliding_window defaults to 4096 (v0.1): a file without it has one."""
    cfg = LLAMA3_8B | {"model_type": "mistral"}
    with pytest.raises(ValueError, match="sliding_window = 4096"):
        model_from_hf_config(_write(tmp_path, cfg))


def test_unreadable_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable Hugging Face config.json"):
        model_from_hf_config(tmp_path)
