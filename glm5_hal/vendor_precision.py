"""Where a vendor's kernel chain rounds what the contract keeps in fp32: the inputs the chain still serves within the
contract's tolerance (docs/ops.md), one rule per chain, shared by the vendor backends that run such a chain. Each rule
is measured on the strict fakes (parity_tests/fakes), which compute every kernel's documented arithmetic with its
roundings, against the float64 reference with the parity judge; inputs outside it take the backend's portable path.

The fused MoE chains (Ascend: npu_grouped_matmul -> npu_swiglu -> npu_grouped_matmul -> npu_moe_token_unpermute;
Kunlunxin: moe_fc -> SwiGLU -> moe_fc -> moe_post) return every intermediate in the activation dtype (no documented
fp32 output for bf16 / fp16 inputs): an output carries four roundings of that dtype where the portable backends round
once. Random configs in the fuzz suite's ranges (1-6 tokens, 1-5 experts, SwiGLU width 1-12), 2026-11-29:

- fp16, whose tolerance (1e-3) is two units of its rounding: at every width from 16 to 256, 0.3-1% of 300 configs per
  width came out 1.0e-3 to 1.4e-3 off on both chains (the long fuzz profile found one at width 4 on Kunlunxin).
- bf16 (tolerance 1.6e-2): from 16 outputs per token, at most 1.15e-2 off over 1000 configs per width (16, 32, 128,
  256) on both chains; narrower outputs do not average the rounding out and a cancelling output shows it whole
  (Kunlunxin: up to 5.7e-2 at width 1, 3 configs of 100 failing; Ascend: up to 19% at width 1 on its fake).
Real MoE layers have thousands of outputs per token; GLM-5 and DeepSeek-V3.2 run in bf16.

Ascend's MLA prolog (npu_mla_prolog_v3, or the unfused matmuls + npu_rms_norm + npu_interleave_rope that vllm-ascend
calls) keeps q and its absorption in bf16 / fp16. Each q_lat element is a sum over qk_nope_head_dim products of q_nope;
with a short sum, one q_nope element's rounding (after a q_lora sum that can cancel) shows whole. Random configs
(1-3 heads, 1-3 tokens, kv_lora 512, rope 64), 2026-11-29, 150-300 per shape: qk_nope 1 up to 13% off in bf16 and
4.3e-3 in fp16, qk_nope 2 4.4e-2 / 2.3e-3, qk_nope 4 in fp16 2.4e-3 (1 of 300); from qk_nope 8 every config held
(fp16 at most 8.8e-4 at 8, 6.8e-4 from 12 to 128; bf16 at most 8.6e-3), whatever q_lora and hidden (1 to 256).
GLM-5's qk_nope is 192, DeepSeek-V3.2's 128.
"""

from __future__ import annotations

import torch

MIN_FUSED_MOE_WIDTH = 16  # outputs per token (hidden size) from which a bf16 fused MoE chain holds the tolerance
MIN_MLA_PROLOG_NOPE = 16  # qk_nope_head_dim from which an MLA prolog with half-precision intermediates holds it


def fused_moe_chain_unsupported(dtype: torch.dtype, width: int) -> str | None:
    """Why a vendor's fused MoE chain (intermediates rounded to the activation dtype) cannot serve `fused_moe` on
    activations of `dtype` with `width` outputs per token within the contract's tolerance, or None where it can:
    bf16 from MIN_FUSED_MOE_WIDTH outputs, and fp32 (where a chain takes fp32, its intermediates are fp32)."""
    if dtype == torch.float16:
        return (
            "fp16: the fused chain rounds its intermediates to fp16 four times against a tolerance of two fp16 "
            "roundings (1e-3); random configs came out up to 1.4e-3 off"
        )
    if dtype == torch.bfloat16 and width < MIN_FUSED_MOE_WIDTH:
        return (
            f"outputs narrower than {MIN_FUSED_MOE_WIDTH}: the fused chain's bf16 intermediates are not averaged out "
            "there (up to 5.7e-2 off at width 1 against a tolerance of 1.6e-2)"
        )
    return None


def mla_prolog_chain_unsupported(dtype: torch.dtype, nope: int) -> str | None:
    """Why an MLA prolog whose q and absorption stay in bf16 / fp16 (Ascend's kernels) cannot serve `mla_prolog` on
    activations of `dtype` with qk_nope_head_dim `nope` within the contract's tolerance, or None where it can."""
    if dtype in (torch.bfloat16, torch.float16) and nope < MIN_MLA_PROLOG_NOPE:
        return (
            f"qk_nope_head_dim below {MIN_MLA_PROLOG_NOPE}: q_lat sums too few rounded q_nope values to hold the "
            "tolerance (qk_nope 1: up to 13% off in bf16)"
        )
    return None
