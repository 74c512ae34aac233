"""QuaRot for MLA models (GLM-5, DeepSeek-V3.2) on a Hugging Face-named state dict: fold, then rotate.

    1. fold every RMSNorm gain into the linears that read the norm's output (W <- W diag(gamma), gamma <- 1):
       input_layernorm          -> q_a_proj, kv_a_proj_with_mqa, indexer.wk, indexer.weights_proj
       q_a_layernorm            -> q_b_proj, indexer.wq_b
       kv_a_layernorm           -> kv_b_proj
       post_attention_layernorm -> mlp.gate (router), gate_proj / up_proj (dense, shared, every routed expert)
       model.norm               -> lm_head
    2. rotate with four random Hadamards (nn.Linear weights [out, in]; "R" = input side W Q, "L" = output side
       Q^T W):
       Q    (hidden)       R: embed_tokens (rows), q_a_proj, kv_a_proj_with_mqa, indexer.wk, indexer.weights_proj,
                              mlp.gate, every gate_proj / up_proj, lm_head;   L: o_proj, every down_proj
       R_q  (q_lora)       L: q_a_proj;   R: q_b_proj, indexer.wq_b
       R_kv (kv_lora)      L: the c_kv rows of kv_a_proj_with_mqa (identity on the qk_rope k_pe rows);  R: kv_b_proj
       R_v  (v_head_dim)   L: the V rows of kv_b_proj, per head (K-nope rows untouched);  R: o_proj, per head

Why this is exact (the invariance test checks it): an RMSNorm without gain commutes with any orthogonal Q on
the whole normalised vector (|xQ| = |x|), and every rotated width here is such a vector (the residual stream,
the q latent, the kv latent's 512 c_kv dims); the RoPE dims (k_pe, q_pe) carry position rotations that do not
commute with Q, so they are never rotated; q_nope . k_nope = q_lat . c_kv is unchanged because both sides of
kv_b_proj's K half see R_kv. The indexer's k LayerNorm subtracts the mean, which a rotation does NOT preserve:
so wk must keep producing the unrotated k. It does: wk reads the rotated normalised stream and absorbs Q on its
input side (wk Q), its output is untouched. The same holds for weights_proj (reads the stream) and wq_b (reads
the q latent). This is msModelSlim's rotation map for GLM-5 (shared/reference/quarot_quant.md section 2).

Every tensor's fold and rotation depend only on its name, its own values, the (tiny) norm gains and the
rotations, so the map is applied one tensor at a time: `rotate_tensor(name, tensor, gains, config, rotations)`
is the one implementation; `fold_norms`, `rotate_state_dict` and `quarot` apply it to every tensor of a dict,
and quantization/streaming.py applies it to a checkpoint read tensor by tensor (a real GLM-5 never has to be in
memory). Fold and rotation run in float64 with one rounding to the tensor's dtype at the end.

No online rotation is added (msModelSlim applies none to the DeepSeek family): the quantized model keeps the
HF graph. MTP layers (index >= num_hidden_layers) are refused: their hidden input would need msModelSlim's
extra `rot` matrix (`glm5-hal quantize` drops them, see `is_mtp_tensor`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from glm5_hal.config import ModelConfig
from glm5_hal.model.weights import is_mtp_tensor  # re-exported: quantization's callers import it from here
from quantization.hadamard import HadamardRotation

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# MLP linears of a layer: dense, shared expert, or routed expert E (suffixes within a layer, without ".weight").
_MLP_PROJ = re.compile(r"^mlp\.(?:experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj)$")

# Per-layer tensors that neither fold nor rotate touches.
_UNTOUCHED_IN_LAYER = (
    "mlp.gate.e_score_correction_bias",
    "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias",
)
# The RMSNorm gains of a layer (suffixes), and the model's final norm: what fold_norms sets to 1.
_LAYER_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_a_layernorm.weight",
    "self_attn.kv_a_layernorm.weight",
)
_FINAL_NORM = "model.norm.weight"

# Rotation names: the four widths of QuaRotRotations. Input side: "v_head" rotates each head's v_head_dim
# columns (o_proj). Output side: "kv_c_rows" rotates the c_kv rows of kv_a_proj_with_mqa only, "v_head_rows"
# each head's V rows of kv_b_proj only.
_HIDDEN, _Q_LATENT, _KV_LATENT, _V_HEAD = "hidden", "q_latent", "kv_latent", "v_head"
_KV_C_ROWS, _V_HEAD_ROWS = "kv_c_rows", "v_head_rows"

# Per-layer linears outside the MLP: (the norm whose gain folds into it, input-side rotation, output-side one).
_ATTENTION_MAP: dict[str, tuple[str | None, str | None, str | None]] = {
    "self_attn.q_a_proj": ("input_layernorm.weight", _HIDDEN, _Q_LATENT),
    "self_attn.kv_a_proj_with_mqa": ("input_layernorm.weight", _HIDDEN, _KV_C_ROWS),
    "self_attn.indexer.wk": ("input_layernorm.weight", _HIDDEN, None),
    "self_attn.indexer.weights_proj": ("input_layernorm.weight", _HIDDEN, None),
    "self_attn.q_b_proj": ("self_attn.q_a_layernorm.weight", _Q_LATENT, None),
    "self_attn.indexer.wq_b": ("self_attn.q_a_layernorm.weight", _Q_LATENT, None),
    "self_attn.kv_b_proj": ("self_attn.kv_a_layernorm.weight", _KV_LATENT, _V_HEAD_ROWS),
    "self_attn.o_proj": (None, _V_HEAD, _HIDDEN),
}

# Row-independent transforms (fold and input side) of a large tensor run on blocks of rows, so the float64
# temporaries stay near this many elements (64 Mi = 512 MiB) instead of twice the tensor (GLM-5's embed_tokens
# and lm_head, [154880, 6144], would take 7.6 GB each in float64).
ROW_CHUNK_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class QuaRotRotations:
    """The four rotations of one model (the same for every layer).

    hidden: Q [hidden_size]; q_latent: R_q [q_lora_rank]; kv_latent: R_kv [kv_lora_rank]; v_head: R_v [v_head_dim].
    """

    hidden: HadamardRotation
    q_latent: HadamardRotation
    kv_latent: HadamardRotation
    v_head: HadamardRotation

    @classmethod
    def for_config(cls, config: ModelConfig, seed: int = 0) -> QuaRotRotations:
        """Random-sign Hadamards of the config's widths, deterministic in seed."""
        return cls(
            hidden=HadamardRotation.random(config.hidden_size, seed),
            q_latent=HadamardRotation.random(config.q_lora_rank, seed + 1),
            kv_latent=HadamardRotation.random(config.kv_lora_rank, seed + 2),
            v_head=HadamardRotation.random(config.v_head_dim, seed + 3),
        )


@dataclass(frozen=True)
class _Transform:
    """What fold + rotate do to one tensor. norm: an RMSNorm gain (folding sets it to 1); gain: the full name of
    the norm gain folded into the columns; input / output: the rotation of the input / output side (names above).
    All None / False: left as it is."""

    norm: bool = False
    gain: str | None = None
    input: str | None = None
    output: str | None = None


def _layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return None if m is None else int(m.group(1))


def is_norm_gain(name: str) -> bool:
    """Whether `name` is an RMSNorm gain that fold_norms folds (a layer's four norms, model.norm): the tensors
    `rotate_tensor` needs in `gains` (tiny: [hidden] or [lora rank] each)."""
    m = _LAYER.match(name)
    return name == _FINAL_NORM if m is None else m.group(2) in _LAYER_NORMS


def _transform_of(name: str) -> _Transform | None:
    """The rotation map of the module docstring for one tensor name (MTP layers excluded by the caller); None for
    a name the map does not know."""
    if name == "model.embed_tokens.weight":
        return _Transform(input=_HIDDEN)  # rows are residual-stream vectors
    if name == _FINAL_NORM:
        return _Transform(norm=True)
    if name == "lm_head.weight":
        return _Transform(gain=_FINAL_NORM, input=_HIDDEN)
    m = _LAYER.match(name)
    if m is None:
        return None
    prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest in _LAYER_NORMS:
        return _Transform(norm=True)
    if rest in _UNTOUCHED_IN_LAYER:
        return _Transform()
    if not rest.endswith(".weight"):
        return None
    base = rest.removesuffix(".weight")
    if base in _ATTENTION_MAP:
        gain, input_side, output_side = _ATTENTION_MAP[base]
        return _Transform(gain=None if gain is None else prefix + gain, input=input_side, output=output_side)
    proj = _MLP_PROJ.match(base)
    if base == "mlp.gate" or (proj is not None and proj.group(1) != "down_proj"):  # readers of the stream
        return _Transform(gain=prefix + "post_attention_layernorm.weight", input=_HIDDEN)
    if proj is not None:  # down_proj writes the residual stream
        return _Transform(output=_HIDDEN)
    return None


def _check_names(names: Iterable[str], config: ModelConfig) -> None:
    """Every tensor must be one the pipeline knows how to treat (a missed writer, or a missed reader of a folded
    norm, would silently break the model); MTP layers are refused."""
    names = list(names)
    mtp = sorted({_layer_of(n) for n in names if is_mtp_tensor(n, config)})
    if mtp:
        raise ValueError(
            f"state_dict: layers {mtp} are MTP layers (>= num_hidden_layers = {config.num_hidden_layers}); QuaRot "
            "does not rotate them here, drop them before rotating"
        )
    unknown = [n for n in names if _transform_of(n) is None]
    if unknown:
        raise ValueError(f"state_dict: tensors QuaRot does not know how to rotate: {unknown[:8]}")


def _input_side(w: Tensor, rotation: HadamardRotation) -> Tensor:
    """W [out, in] reading a rotated input x Q: W Q."""
    return rotation.rotate(w)


def _output_side(w: Tensor, rotation: HadamardRotation) -> Tensor:
    """W [out, in] whose output must come out rotated (y Q): Q^T W."""
    return rotation.rotate(w.T).T


def _rotate_input(w: Tensor, which: str, config: ModelConfig, rotations: QuaRotRotations) -> Tensor:
    """W [rows, in] float64 with its input side rotated (row-independent)."""
    if which == _V_HEAD:  # o_proj: each head's v_head_dim input columns see R_v
        heads = config.num_attention_heads
        return rotations.v_head.rotate(w.reshape(w.shape[0], heads, config.v_head_dim)).reshape(w.shape)
    return _input_side(w, getattr(rotations, which))


def _rotate_output(w: Tensor, which: str, config: ModelConfig, rotations: QuaRotRotations) -> Tensor:
    """W [out, in] float64 with its output side rotated (mixes rows)."""
    if which == _KV_C_ROWS:  # [kv_lora + rope, hidden]: the k_pe rows keep their RoPE basis
        kv_lora = config.kv_lora_rank
        return torch.cat([_output_side(w[:kv_lora], rotations.kv_latent), w[kv_lora:]])
    if which == _V_HEAD_ROWS:  # [H * (nope + v_head), kv_lora]: R_v^T W_v[h] per head, K-nope rows untouched
        heads, nope = config.num_attention_heads, config.qk_nope_head_dim
        per_head = w.reshape(heads, nope + config.v_head_dim, w.shape[1])
        v_rows = rotations.v_head.rotate(per_head[:, nope:].transpose(1, 2)).transpose(1, 2)
        return torch.cat([per_head[:, :nope], v_rows], dim=1).reshape(w.shape)
    return _output_side(w, getattr(rotations, which))


def rotate_tensor(
    name: str,
    tensor: Tensor,
    gains: Mapping[str, Tensor] | None,
    config: ModelConfig,
    rotations: QuaRotRotations | None,
) -> Tensor:
    """One checkpoint tensor folded and / or rotated as the module docstring's map says for its name.

    Args:
        name: the Hugging Face name ("model.layers.3.self_attn.q_a_proj.weight").
        tensor: its value (any float dtype; linears [out, in]).
        gains: the RMSNorm gains by name (every `is_norm_gain` tensor of the checkpoint, as stored): fold them.
            None: do not fold (the tensors are already folded, or only the rotation is wanted).
        config: the model config (head counts and widths).
        rotations: the rotations to apply; None: fold only.

    Returns:
        The transformed tensor, same shape and dtype (computed in float64, rounded once); a norm gain becomes 1
        when folding; a tensor neither step changes is returned as it is (not copied).

    Raises:
        ValueError: an MTP-layer tensor, or a name the map does not know; KeyError naming the gain when `gains`
        lacks the one this tensor folds.
    """
    if is_mtp_tensor(name, config):
        raise ValueError(
            f"name: {name!r} is in an MTP layer (>= num_hidden_layers = {config.num_hidden_layers}); QuaRot does not "
            "rotate MTP layers, drop them before rotating"
        )
    transform = _transform_of(name)
    if transform is None:
        raise ValueError(f"name: QuaRot does not know how to rotate the tensor {name!r}")
    if transform.norm:
        return tensor if gains is None else torch.ones_like(tensor)
    gain = None
    if gains is not None and transform.gain is not None:
        if transform.gain not in gains:
            raise KeyError(f"gains: {name!r} folds the norm gain {transform.gain!r}, which gains does not hold")
        gain = gains[transform.gain].to(torch.float64)
    input_side = None if rotations is None else transform.input
    output_side = None if rotations is None else transform.output
    if gain is None and input_side is None and output_side is None:
        return tensor

    def row_independent(rows: Tensor) -> Tensor:  # fold (W diag(g)) and the input side act on each row alone
        w = rows.to(torch.float64)
        if gain is not None:
            w = w * gain[None, :]
        return w if input_side is None else _rotate_input(w, input_side, config, rotations)

    if output_side is not None:  # mixes rows: the whole tensor at once (o_proj, down_proj, q_a / kv_a / kv_b_proj)
        return _rotate_output(row_independent(tensor), output_side, config, rotations).to(tensor.dtype)
    out = torch.empty_like(tensor)
    step = max(1, ROW_CHUNK_ELEMENTS // max(1, tensor[0].numel()))
    for start in range(0, tensor.shape[0], step):
        out[start : start + step] = row_independent(tensor[start : start + step]).to(tensor.dtype)
    return out


def norm_gains(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The RMSNorm gains of a state dict (the `gains` argument of rotate_tensor)."""
    return {name: value for name, value in state_dict.items() if is_norm_gain(name)}


def fold_norms(state_dict: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A copy of state_dict with every RMSNorm gain folded into the linears that read the norm (gains set to 1).

    Exact in real arithmetic: RMSNorm(x, g) W^T = RMSNorm(x, 1) (W diag(g))^T. Computed in float64, stored in
    each tensor's own dtype. Unknown tensors and MTP layers are refused as in rotate_state_dict (an unknown
    reader of a norm would silently miss its gain).
    """
    _check_names(state_dict, config)
    gains = norm_gains(state_dict)
    return {name: rotate_tensor(name, value, gains, config, None) for name, value in state_dict.items()}


def rotate_state_dict(
    state_dict: dict[str, Tensor], config: ModelConfig, rotations: QuaRotRotations
) -> dict[str, Tensor]:
    """A copy of a FOLDED state dict (see fold_norms) with the residual stream, q / kv latents and per-head V
    dims rotated as the module docstring lists. Computed in float64, stored in each tensor's dtype."""
    _check_names(state_dict, config)
    return {name: rotate_tensor(name, value, None, config, rotations) for name, value in state_dict.items()}


def quarot(
    state_dict: dict[str, Tensor], config: ModelConfig, seed: int = 0
) -> tuple[dict[str, Tensor], QuaRotRotations]:
    """Fold the norms and rotate: -> (rotated state dict, the rotations used). The model computes the same
    function with either state dict (up to rounding). Each tensor is folded and rotated in one float64 pass
    (rotate_tensor), so this equals transforming the checkpoint tensor by tensor, bit for bit."""
    _check_names(state_dict, config)
    rotations = QuaRotRotations.for_config(config, seed)
    gains = norm_gains(state_dict)
    rotated = {name: rotate_tensor(name, value, gains, config, rotations) for name, value in state_dict.items()}
    return rotated, rotations
