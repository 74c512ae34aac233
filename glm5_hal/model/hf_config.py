"""ModelConfig <-> the Hugging Face config.json of GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`).

    cfg = load_config("path/to/GLM-5")            # reads <dir>/config.json
    cfg = config_from_hf(json_dict, name="glm5")  # the same from a dict (e.g. transformers' `config.to_dict()`)
    hf = config_to_hf(cfg)                        # a config.json dict that transformers and config_from_hf read back

A file is read as transformers 5.23 reads it: a key missing from the file takes the default of its model
type's config class (`GlmMoeDsaConfig` / `DeepseekV32Config`, `_CLASS_DEFAULTS` below). Four keys are not
fields of those classes but of the checkpoints' config.json; a missing one takes the behaviour that transformers'
modeling code hard-codes (`_MODELING_DEFAULTS`): `scoring_func` "sigmoid", `topk_method` "noaux_tc",
`rope_interleave` true (MLA RoPE, both models), `indexer_rope_interleave` true for GLM-5 and false for
DeepSeek-V3.2 (its half-split indexer RoPE). `indexer_norm_eps` (the indexer k LayerNorm, 1e-6 in both
modeling files) is a glm5-hal key, written so that every ModelConfig round-trips. A key with no default (the
model type; YaRN's `factor`, `mscale`, `mscale_all_dim`), a value of the wrong type or a feature the model does
not implement (another activation, tied embeddings, IndexShare layers, RoPE types other than default / yarn) is
a ValueError naming the key and the file.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

from glm5_hal.config import ModelConfig, YarnScaling

CONFIG_FILE = "config.json"
# model_type -> the transformers causal-LM class (written as config.json's "architectures").
ARCHITECTURES: dict[str, str] = {
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)

# ModelConfig fields stored in config.json under their own name; their types come from ModelConfig's annotations.
_SAME_NAME_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "scoring_func",
    "first_k_dense_replace",
    "rms_norm_eps",
    "indexer_norm_eps",
)

# transformers 5.23 class defaults of the keys read here (parity_tests/test_quantize_checkpoint.py checks them
# against the installed classes). Shared values first, then what differs per model type.
_SHARED_CLASS_DEFAULTS: dict[str, object] = {
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "index_topk": 2048,
    "index_head_dim": 128,
    "first_k_dense_replace": 3,
}
_CLASS_DEFAULTS: dict[str, dict[str, object]] = {
    "glm_moe_dsa": _SHARED_CLASS_DEFAULTS
    | {
        "vocab_size": 154880,
        "hidden_size": 6144,
        "intermediate_size": 12288,
        "num_hidden_layers": 78,
        "num_attention_heads": 64,
        "q_lora_rank": 2048,
        "v_head_dim": 256,
        "qk_nope_head_dim": 192,
        "n_group": 1,
        "topk_group": 1,
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5,
        "index_n_heads": 32,
    },
    "deepseek_v32": _SHARED_CLASS_DEFAULTS
    | {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "index_n_heads": 64,
    },
}
# transformers' PreTrainedConfig.default_theta: the RoPE base when neither rope_parameters nor rope_theta has one.
_DEFAULT_ROPE_THETA = 10000.0
# Keys of the checkpoints' config.json that the transformers classes do not declare: the behaviour their modeling
# code hard-codes (sigmoid router with the bias-corrected top-k, interleaved MLA RoPE, the indexer RoPE layout
# of each model, LayerNorm(eps=1e-6) for the indexer keys).
_MODELING_DEFAULTS: dict[str, dict[str, object]] = {
    model_type: {
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rope_interleave": True,
        "indexer_rope_interleave": model_type == "glm_moe_dsa",
        "indexer_norm_eps": 1e-6,
    }
    for model_type in SUPPORTED_MODEL_TYPES
}
_SCORING_FUNCS = ("sigmoid", "softmax")  # what the moe_gate op implements
_ROPE_TYPES = ("default", "yarn")
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}  # transformers' documented YaRN defaults


class _Reader:
    """Typed reads of one config dict: the file's value, else the model type's default, else a ValueError."""

    def __init__(self, hf: dict, source: str, model_type: str) -> None:
        self.hf, self.source, self.model_type = hf, source, model_type
        self.defaults = _CLASS_DEFAULTS[model_type] | _MODELING_DEFAULTS[model_type]

    def get(self, key: str, kind: type, table: dict | None = None, prefix: str = "") -> typing.Any:
        """table[key] (the whole config by default), else its default, checked to be a `kind`."""
        table = self.hf if table is None else table
        if key in table:
            value = table[key]
        elif not prefix and key in self.defaults:
            value = self.defaults[key]
        elif prefix and key in _YARN_DEFAULTS:
            value = _YARN_DEFAULTS[key]
        else:
            raise ValueError(
                f"{self.source}: missing key {prefix + key!r}, which has no default for model_type {self.model_type!r}"
            )
        return self.check(prefix + key, value, kind)

    def check(self, key: str, value: object, kind: type) -> typing.Any:
        """value as a `kind` (an int is accepted for a float; a bool is never an int or a float)."""
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            raise ValueError(f"{self.source}: {key!r}: expected {kind.__name__}, got {value!r}")
        return value

    def require(self, key: str, value: object, expected: object, why: str) -> None:
        if value != expected:
            raise ValueError(f"{self.source}: {key!r}: expected {expected!r} ({why}), got {value!r}")


def config_from_hf(hf: dict, name: str | None = None, *, source: str = CONFIG_FILE) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json dict (GLM-5 `glm_moe_dsa` or DeepSeek-V3.2 `deepseek_v32`).

    hf: the parsed config.json, or transformers' `config.to_dict()` (legacy `rope_scaling` + top-level
        `rope_theta` and v5 `rope_parameters` are both read). Missing keys: see the module docstring.
    name: the ModelConfig's name; default: hf["_name_or_path"] when set, else the model type.
    source: what the errors call the file (load_config passes its path).
    Raises ValueError naming the key and `source` for a missing key without default, a wrong type or an
    unsupported feature, and listing the supported model types for another model_type.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: 'model_type': expected one of {list(SUPPORTED_MODEL_TYPES)}, got {model_type!r}")
    read = _Reader(hf, source, model_type)
    hints = typing.get_type_hints(ModelConfig)
    fields = {key: read.get(key, hints[key]) for key in _SAME_NAME_FIELDS}
    read.require("hidden_act", read.get("hidden_act", str), "silu", "the MLPs are SwiGLU")
    read.require("tie_word_embeddings", read.get("tie_word_embeddings", bool), False, "lm_head is its own weight")
    for key in ("attention_bias", "mlp_bias"):
        read.require(key, read.get(key, bool), False, "the projections have no bias")
    read.require("topk_method", read.get("topk_method", str), "noaux_tc", "moe_gate's bias-corrected top-k")
    if fields["scoring_func"] not in _SCORING_FUNCS:
        raise ValueError(
            f"{source}: 'scoring_func': expected one of {list(_SCORING_FUNCS)}, got {fields['scoring_func']!r}"
        )
    _check_layer_types(read, fields["num_hidden_layers"], fields["first_k_dense_replace"])
    rope_theta, rope_scaling = _read_rope(read)
    return ModelConfig(
        name=name or hf.get("_name_or_path") or model_type,
        **fields,
        indexer_rope_interleaved=read.get("indexer_rope_interleave", bool),
        mla_rope_interleaved=read.get("rope_interleave", bool),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )


def _check_layer_types(read: _Reader, num_layers: int, first_dense: int) -> None:
    """The per-layer lists transformers derives, when the file spells them out, must match what the model builds:
    dense MLPs up to first_k_dense_replace then MoE, and every layer running its own indexer."""
    dense = min(first_dense, num_layers)
    if "mlp_layer_types" in read.hf:
        expected = ["dense"] * dense + ["sparse"] * (num_layers - dense)
        read.require("mlp_layer_types", read.hf["mlp_layer_types"], expected, "first_k_dense_replace dense layers")
    if "indexer_types" in read.hf and read.hf["indexer_types"] is not None:
        indexer_types = list(read.hf["indexer_types"])
    elif read.hf.get("index_topk_pattern") is not None:
        pattern = read.hf["index_topk_pattern"]
        indexer_types = [{"F": "full", "S": "shared"}.get(kind, kind) for kind in pattern]
    else:  # transformers' schedule: layer i runs its indexer when max(i - offset + 1, 0) % freq == 0
        freq = max(read.check("index_topk_freq", read.hf.get("index_topk_freq", 1), int), 1)
        offset = read.check("index_skip_topk_offset", read.hf.get("index_skip_topk_offset", 2), int)
        indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    shared = [i for i, kind in enumerate(indexer_types) if kind != "full"]
    if shared:
        raise ValueError(
            f"{read.source}: layers {shared[:8]} reuse another layer's indexer top-k (IndexShare: indexer_types / "
            "index_topk_freq / index_topk_pattern); glm5-hal runs every layer's indexer, so only 'full' is supported"
        )


def _read_rope(read: _Reader) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling or None) from v5 `rope_parameters` or legacy `rope_scaling` + `rope_theta`, with
    transformers' precedence: rope_scaling over rope_parameters, the dict's rope_theta over the top-level one."""
    key = "rope_scaling" if read.hf.get("rope_scaling") else "rope_parameters"
    params = read.hf.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{read.source}: {key!r}: expected a dict, got {params!r}")
    prefix = f"{key}."
    theta = params.get("rope_theta", read.hf.get("rope_theta", _DEFAULT_ROPE_THETA))
    theta = read.check(prefix + "rope_theta", theta, float)
    rope_type = read.check(prefix + "rope_type", params.get("rope_type", params.get("type", "default")), str)
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"{read.source}: {prefix + 'rope_type'!r}: expected one of {list(_ROPE_TYPES)}, got {rope_type!r}"
        )
    if rope_type == "default":
        return theta, None
    if "attention_factor" in params:
        raise ValueError(
            f"{read.source}: {prefix + 'attention_factor'!r}: not supported (the YaRN softmax correction comes from "
            "mscale_all_dim, as in DeepSeek-V3.2)"
        )
    # mscale and mscale_all_dim are required: without them transformers rescales cos/sin by 0.1 ln(factor) + 1,
    # a different model from DeepSeek-V3.2's (mscale == mscale_all_dim, correction in the softmax scale only).
    original = params.get("original_max_position_embeddings", read.get("max_position_embeddings", int))
    yarn = YarnScaling(
        factor=read.get("factor", float, params, prefix),
        original_max_position_embeddings=read.check(prefix + "original_max_position_embeddings", original, int),
        beta_fast=read.get("beta_fast", float, params, prefix),
        beta_slow=read.get("beta_slow", float, params, prefix),
        mscale=read.get("mscale", float, params, prefix),
        mscale_all_dim=read.get("mscale_all_dim", float, params, prefix),
    )
    return theta, yarn


def config_to_hf(cfg: ModelConfig, model_type: str | None = None) -> dict:
    """A config.json dict for `cfg` that config_from_hf reads back to `cfg` and transformers loads as its config.

    model_type: "glm_moe_dsa" or "deepseek_v32"; default: from the indexer RoPE layout, the one structural
    difference transformers hard-codes per model (GLM-5 interleaved, DeepSeek-V3.2 half-split). Every value is
    written explicitly (`rope_interleave`, `indexer_rope_interleave` too), so the file never relies on a default.
    """
    if model_type is None:
        model_type = "glm_moe_dsa" if cfg.indexer_rope_interleaved else "deepseek_v32"
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type: expected one of {list(SUPPORTED_MODEL_TYPES)}, got {model_type!r}")
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        y = cfg.rope_scaling
        rope |= {
            "rope_type": "yarn",
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "mscale": y.mscale,
            "mscale_all_dim": y.mscale_all_dim,
        }
    return {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "_name_or_path": cfg.name,
        **{key: getattr(cfg, key) for key in _SAME_NAME_FIELDS},
        # MLA has one latent KV head shared by all query heads; transformers expands it to one per query head.
        "num_key_value_heads": cfg.num_attention_heads,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "topk_method": "noaux_tc",
        "rope_parameters": rope,
        "rope_interleave": cfg.mla_rope_interleaved,
        "indexer_rope_interleave": cfg.indexer_rope_interleaved,
    }


def read_config_json(directory: str | Path) -> dict:
    """The parsed <dir>/config.json: FileNotFoundError when there is none, ValueError (naming the file) when it is not
    a JSON object."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a Hugging Face checkpoint directory has a {CONFIG_FILE})")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    return hf


def load_config(directory: str | Path, name: str | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint directory's config.json (see config_from_hf); name defaults to the file's
    `_name_or_path`, else the directory's name. FileNotFoundError when the directory has no config.json."""
    hf = read_config_json(directory)
    path = Path(directory) / CONFIG_FILE
    return config_from_hf(hf, name or hf.get("_name_or_path") or Path(directory).resolve().name, source=str(path))
