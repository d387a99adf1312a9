"""Model shapes from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2 and Qwen3 style).

``hf_overrides(path)`` gives what a ``Cell`` names, a preset and ``overrides`` setting every
``ModelConfig`` field, so that ``resolve_model(preset, overrides)`` is the HF model's shape;
``model_from_hf_config(path)`` gives that ``ModelConfig`` with the overrides. Nothing is
downloaded: ``path`` is a local ``config.json`` or a folder holding one.

What the suite's Llama-style decoder does not model is refused with the field that says so:
mixture-of-experts MLPs, sliding-window attention (the methods compute full causal attention),
model types outside ``SUPPORTED_MODEL_TYPES``. Differences that leave the shapes and costs of
the benchmarked layers alone are ignored: Qwen2's q/k/v biases, Qwen3's q/k norms (a few
thousand parameters per block), ``rope_scaling`` (it changes the frequencies, not the shapes).
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.config.model import ModelConfig, resolve_model

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
BASE_PRESET = "llama3-8b"  # every field is overridden: the preset is only the starting point
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
            "vocab_size")
# how HF configs name an expert count (Qwen2/3-MoE, Mixtral, DeepSeek, ERNIE)
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# transformers' defaults for what a config.json may leave out (LlamaConfig, MistralConfig,
# Qwen2Config and Qwen3Config agree; checked against transformers 5.23)
DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def _read(path) -> tuple[Path, dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable Hugging Face config.json ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a config.json must hold a JSON object")
    return path, raw


def _int(path: Path, raw: dict, field: str, default: int | None = None) -> int:
    value = raw.get(field)
    if value is None and default is not None:
        return default
    if value is None:
        raise ValueError(f"{path}: lacks {field!r} (needed for the model shape)")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{path}: {field} must be a positive integer, got {value!r}")
    return value


def _refuse_unmodelled(path: Path, raw: dict) -> None:
    """Raise for what the decoder does not model: experts, sliding windows, other types."""
    for field in MOE_FIELDS:
        n = raw.get(field)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            raise ValueError(f"{path}: {field} = {n}: a mixture-of-experts model; the suite's "
                             "decoder has one dense SwiGLU MLP per block")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{path}: model_type must be one of {list(SUPPORTED_MODEL_TYPES)}, got "
                         f"{model_type!r}")
    # Mistral applies its window whenever one is set (MistralConfig's default is 4096: v0.1);
    # Qwen2/3 only with use_sliding_window. transformers 5 also lists per-layer types.
    window = raw.get("sliding_window", 4096 if model_type == "mistral" else None)
    if model_type != "mistral" and not raw.get("use_sliding_window", False):
        window = None
    if window is not None or "sliding_attention" in (raw.get("layer_types") or ()):
        raise ValueError(f"{path}: sliding_window = {window!r}: sliding-window attention; the "
                         "methods compute full causal attention, so its memory and time would "
                         "not be this model's")


def _rope_theta(path: Path, raw: dict) -> float:
    """``rope_theta`` (transformers < 5) or ``rope_parameters.rope_theta`` (transformers 5)."""
    value = raw.get("rope_theta")
    params = raw.get("rope_parameters")
    if value is None and isinstance(params, dict):
        value = params.get("rope_theta")
    if value is None:
        value = DEFAULTS["rope_theta"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{path}: rope_theta must be a positive number, got {value!r}")
    return float(value)


def _format(value) -> str:
    """An override string ``resolve_model`` parses back to exactly ``value``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _head_dim(path: Path, raw: dict, hidden: int, heads: int) -> int:
    if raw.get("head_dim") is not None:
        return _int(path, raw, "head_dim")
    if raw["model_type"] == "qwen3":  # Qwen3Config's default; the others' is hidden / heads
        return 128
    if hidden % heads:
        raise ValueError(f"{path}: hidden_size ({hidden}) must be a multiple of "
                         f"num_attention_heads ({heads}) when head_dim is not given")
    return hidden // heads


def _values(path: Path, raw: dict) -> dict:
    """Every ModelConfig field, from the config.json's fields or transformers' defaults."""
    dims = {f: _int(path, raw, f) for f in REQUIRED}
    hidden, heads = dims["hidden_size"], dims["num_attention_heads"]
    eps = raw.get("rms_norm_eps", DEFAULTS["rms_norm_eps"])
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"{path}: rms_norm_eps must be a positive number, got {eps!r}")
    tie = raw.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])
    if not isinstance(tie, bool):
        raise ValueError(f"{path}: tie_word_embeddings must be true or false, got {tie!r}")
    return {
        "n_layers": dims["num_hidden_layers"], "dim": hidden, "n_heads": heads,
        "n_kv_heads": _int(path, raw, "num_key_value_heads", heads),
        "head_dim": _head_dim(path, raw, hidden, heads), "ffn_dim": dims["intermediate_size"],
        "vocab_size": dims["vocab_size"], "rope_theta": _rope_theta(path, raw),
        "norm_eps": float(eps), "tie_embeddings": tie,
    }


def model_from_hf_config(path) -> tuple[ModelConfig, tuple[tuple[str, str], ...]]:
    """(ModelConfig, overrides of ``BASE_PRESET``) of the model ``path``'s config.json
    describes. The config is what ``resolve_model`` makes of the overrides, so a Cell naming
    them gets exactly it. Raises ``ValueError`` naming the field for a config the suite cannot
    model (see the module docstring) or a shape that breaks a ``ModelConfig`` rule."""
    path, raw = _read(path)
    _refuse_unmodelled(path, raw)
    overrides = tuple((k, _format(v)) for k, v in _values(path, raw).items())
    try:
        return resolve_model(BASE_PRESET, overrides), overrides
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def hf_overrides(path) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(preset, overrides) for a Cell whose model is the one ``path``'s config.json describes:
    ``resolve_model(*hf_overrides(path))`` is ``model_from_hf_config(path)[0]``."""
    return BASE_PRESET, model_from_hf_config(path)[1]
