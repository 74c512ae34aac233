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

No online rotation is added (msModelSlim applies none to the DeepSeek family): the quantized model keeps the
HF graph. MTP layers (index >= num_hidden_layers) are refused: their hidden input would need msModelSlim's
extra `rot` matrix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from glm5_hal.config import ModelConfig
from quantization.hadamard import HadamardRotation

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

# Per-layer tensors that neither fold nor rotate touches (besides the norm gains, which fold sets to 1).
_UNTOUCHED_IN_LAYER = (
    "mlp.gate.e_score_correction_bias",
    "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias",
)

# Which linears read each RMSNorm's output (suffixes within a layer).
_ATTN_NORM_READERS = (
    "self_attn.q_a_proj",
    "self_attn.kv_a_proj_with_mqa",
    "self_attn.indexer.wk",
    "self_attn.indexer.weights_proj",
)
_Q_NORM_READERS = ("self_attn.q_b_proj", "self_attn.indexer.wq_b")
_KV_NORM_READERS = ("self_attn.kv_b_proj",)


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


def _input_side(w: Tensor, rotation: HadamardRotation) -> Tensor:
    """W [out, in] reading a rotated input x Q: W Q."""
    return rotation.rotate(w)


def _output_side(w: Tensor, rotation: HadamardRotation) -> Tensor:
    """W [out, in] whose output must come out rotated (y Q): Q^T W."""
    return rotation.rotate(w.T).T


def _layer_indices(state_dict: dict[str, Tensor]) -> list[int]:
    return sorted({int(m.group(1)) for name in state_dict if (m := _LAYER.match(name))})


def _mlp_linears(state_dict: dict[str, Tensor], prefix: str) -> tuple[list[str], list[str]]:
    """(readers of the post-attention norm, writers to the residual) of one layer's MLP, as full weight names
    without '.weight': dense gate/up/down, shared experts, every routed expert, and the router gate."""
    readers, writers = [], []
    for name in state_dict:
        if not name.startswith(prefix + "mlp.") or not name.endswith(".weight"):
            continue
        base = name[: -len(".weight")]
        if base.endswith(("gate_proj", "up_proj")) or base == prefix + "mlp.gate":
            readers.append(base)
        elif base.endswith("down_proj"):
            writers.append(base)
    return readers, writers


def fold_norms(state_dict: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A copy of state_dict with every RMSNorm gain folded into the linears that read the norm (gains set to 1).

    Exact in real arithmetic: RMSNorm(x, g) W^T = RMSNorm(x, 1) (W diag(g))^T. Computed in float64, stored in
    each tensor's own dtype.
    """
    out = dict(state_dict)

    def fold(norm: str, readers: list[str]) -> None:
        gamma = state_dict[norm].to(torch.float64)
        for reader in readers:
            w = state_dict[reader + ".weight"]
            out[reader + ".weight"] = (w.to(torch.float64) * gamma[None, :]).to(w.dtype)
        out[norm] = torch.ones_like(state_dict[norm])

    for i in _layer_indices(state_dict):
        p = f"model.layers.{i}."
        fold(p + "input_layernorm.weight", [p + r for r in _ATTN_NORM_READERS if p + r + ".weight" in state_dict])
        fold(p + "self_attn.q_a_layernorm.weight", [p + r for r in _Q_NORM_READERS if p + r + ".weight" in state_dict])
        fold(p + "self_attn.kv_a_layernorm.weight", [p + r for r in _KV_NORM_READERS])
        fold(p + "post_attention_layernorm.weight", _mlp_linears(state_dict, p)[0])
    fold("model.norm.weight", ["lm_head"])
    return out


def _check_names(state_dict: dict[str, Tensor], config: ModelConfig) -> None:
    """Every tensor must be one the pipeline knows how to treat (a missed writer would silently break the model)."""
    layers = _layer_indices(state_dict)
    mtp = [i for i in layers if i >= config.num_hidden_layers]
    if mtp:
        raise ValueError(
            f"state_dict: layers {mtp} are MTP layers (>= num_hidden_layers = {config.num_hidden_layers}); QuaRot "
            "does not rotate them here, drop them before rotating"
        )
    known_attn = {
        *_ATTN_NORM_READERS,
        *_Q_NORM_READERS,
        *_KV_NORM_READERS,
        "self_attn.o_proj",
    }
    unknown = []
    for name in state_dict:
        m = _LAYER.match(name)
        if m is None:
            if name not in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                unknown.append(name)
            continue
        rest = m.group(2)
        if rest.endswith("layernorm.weight") or rest in _UNTOUCHED_IN_LAYER:
            continue
        if rest.endswith(".weight") and (rest[: -len(".weight")] in known_attn or rest.startswith("mlp.")):
            continue
        unknown.append(name)
    if unknown:
        raise ValueError(f"state_dict: tensors QuaRot does not know how to rotate: {unknown[:8]}")


def rotate_state_dict(
    state_dict: dict[str, Tensor], config: ModelConfig, rotations: QuaRotRotations
) -> dict[str, Tensor]:
    """A copy of a FOLDED state dict (see fold_norms) with the residual stream, q / kv latents and per-head V
    dims rotated as the module docstring lists. Computed in float64, stored in each tensor's dtype."""
    _check_names(state_dict, config)
    out = dict(state_dict)
    q, r_q, r_kv, r_v = rotations.hidden, rotations.q_latent, rotations.kv_latent, rotations.v_head
    heads, nope, v_dim = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    kv_lora = config.kv_lora_rank

    def update(name: str, fn) -> None:
        w = out[name]
        out[name] = fn(w.to(torch.float64)).to(w.dtype)

    update("model.embed_tokens.weight", lambda w: _input_side(w, q))  # rows are residual-stream vectors
    update("lm_head.weight", lambda w: _input_side(w, q))
    for i in _layer_indices(state_dict):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        update(a + "q_a_proj.weight", lambda w: _output_side(_input_side(w, q), r_q))
        for reader in ("q_b_proj", "indexer.wq_b"):
            if a + reader + ".weight" in out:
                update(a + reader + ".weight", lambda w: _input_side(w, r_q))
        for reader in ("indexer.wk", "indexer.weights_proj"):
            if a + reader + ".weight" in out:
                update(a + reader + ".weight", lambda w: _input_side(w, q))

        def kv_a(w: Tensor) -> Tensor:
            w = _input_side(w, q)  # [kv_lora + rope, hidden]
            return torch.cat([_output_side(w[:kv_lora], r_kv), w[kv_lora:]])  # k_pe rows keep their RoPE basis

        update(a + "kv_a_proj_with_mqa.weight", kv_a)

        def kv_b(w: Tensor) -> Tensor:
            per_head = _input_side(w, r_kv).reshape(heads, nope + v_dim, kv_lora)
            v_rows = r_v.rotate(per_head[:, nope:].transpose(1, 2)).transpose(1, 2)  # R_v^T W_v[h]
            return torch.cat([per_head[:, :nope], v_rows], dim=1).reshape(w.shape)

        update(a + "kv_b_proj.weight", kv_b)

        def o_proj(w: Tensor) -> Tensor:
            per_head_input = r_v.rotate(w.reshape(w.shape[0], heads, v_dim)).reshape(w.shape)
            return _output_side(per_head_input, q)

        update(a + "o_proj.weight", o_proj)
        readers, writers = _mlp_linears(state_dict, p)
        for reader in readers:
            update(reader + ".weight", lambda w: _input_side(w, q))
        for writer in writers:
            update(writer + ".weight", lambda w: _output_side(w, q))
    return out


def quarot(
    state_dict: dict[str, Tensor], config: ModelConfig, seed: int = 0
) -> tuple[dict[str, Tensor], QuaRotRotations]:
    """Fold the norms and rotate: -> (rotated state dict, the rotations used). The model computes the same
    function with either state dict (up to rounding)."""
    rotations = QuaRotRotations.for_config(config, seed)
    return rotate_state_dict(fold_norms(state_dict, config), config, rotations), rotations
