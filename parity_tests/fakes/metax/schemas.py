"""MetaX's op schemas, written into the project from the published sources (CI cannot reach GitHub; nothing of
MetaX's is on PyPI). Each string is the exact TORCH_LIBRARY `def` of the op, or for mcFlashMLA, whose kernels are
pybind functions without one, the C++ signature in flash_api.cpp written as a schema (same names, order, types).

Sources, each read at the commit given:
- MetaX-MACA/mcoplib @ f72232346b58f1ea6d9afa6b106c8d705f96ea4c
    op/vllm/torch_bindings.cpp (namespace _C, mcoplib/_C): dynamic_scaled_int8_quant, cutlass_scaled_mm
    op/vllm/moe/torch_bindings.cpp (namespace _moe_C, mcoplib/_moe_C): grouped_topk
    op/sglang/csrc/common_extension.cc (namespace sgl_kernel, mcoplib/sgl_kernel): fast_topk, moe_fused_gate
- MetaX-MACA/mcFlashMLA @ c2dbf6e9328f839b96970662e6ec379b6d79d6c8
    csrc/flash_api/flash_api.cpp (PYBIND11_MODULE flash_mla_cuda): sparse_prefill_fwd, fwd_kvcache_mla,
    get_mla_metadata; flash_mla/flash_mla_interface.py wraps them (the fake's flash_mla module keeps its signatures)
"""

from __future__ import annotations

MCOPLIB_COMMIT = "f72232346b58f1ea6d9afa6b106c8d705f96ea4c"
MCFLASHMLA_COMMIT = "c2dbf6e9328f839b96970662e6ec379b6d79d6c8"

# The real namespace of each group of ops -> the fake's own (backends/metax/runtime.py: GLM5_HAL_OP_NAMESPACES).
NAMESPACES = {
    "_C": "glm5_fake_metax_C",
    "_moe_C": "glm5_fake_metax_moe_C",
    "sgl_kernel": "glm5_fake_metax_sgl_kernel",
    "flash_mla_cuda": "glm5_fake_metax_flash_mla",
}

SCHEMAS: dict[str, dict[str, str]] = {
    "_C": {
        # op/vllm/torch_bindings.cpp, lines 375-377
        "dynamic_scaled_int8_quant": "dynamic_scaled_int8_quant(Tensor! result, Tensor input, Tensor! scale, "
        "Tensor!? azp) -> ()",
        # op/vllm/torch_bindings.cpp, lines 269-273
        "cutlass_scaled_mm": "cutlass_scaled_mm(Tensor! out, Tensor a,                  Tensor b, Tensor a_scales,"
        "                  Tensor b_scales, Tensor? bias) -> ()",
    },
    "_moe_C": {
        # op/vllm/moe/torch_bindings.cpp, lines 86-90
        "grouped_topk": "grouped_topk(Tensor scores, int n_group, int topk_group, int topk, bool renormalize, float "
        "routed_scaling_factor, Tensor bias, int scoring_func) -> (Tensor, Tensor)",
    },
    "sgl_kernel": {
        # op/sglang/csrc/common_extension.cc, line 124. `indices` is written although the schema does not mark it
        # (Tensor!): the fake writes it all the same, as the kernel does.
        "fast_topk": "fast_topk(Tensor score, Tensor indices, Tensor lengths, Tensor? row_starts) -> ()",
        # op/sglang/csrc/common_extension.cc, lines 258-261
        "moe_fused_gate": "moe_fused_gate(Tensor input, Tensor bias, int num_expert_group, int topk_group, int topk, "
        "int num_fused_shared_experts, float routed_scaling_factor, bool apply_routed_scaling_factor_on_output) -> "
        "(Tensor[])",
    },
    "flash_mla_cuda": {
        # csrc/flash_api/flash_api.cpp, lines 283-290 (std::vector<at::Tensor> sparse_prefill_fwd(...))
        "sparse_prefill_fwd": "sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, "
        "Tensor indices_all_valid_per_q) -> Tensor[]",
        # csrc/flash_api/flash_api.cpp, lines 95-112 (std::vector<at::Tensor> fwd_kvcache_mla(...))
        "fwd_kvcache_mla": "fwd_kvcache_mla(Tensor q, Tensor kcache, Tensor? vcache, int head_size_v, "
        "Tensor seqlens_k, Tensor block_table, float softmax_scale, bool is_causal, Tensor tile_scheduler_metadata, "
        "Tensor num_splits, bool is_fp8_kvcache, Tensor? indices, Tensor? indices_all_valid_per_q, "
        "int cp_world_size, int cp_rank, Tensor? cp_tot_seqused_k) -> Tensor[]",
        # csrc/flash_api/flash_api.cpp, lines 358-366 (get_mla_decoding_metadata, bound as get_mla_metadata)
        "get_mla_metadata": "get_mla_metadata(Tensor seqlens_k, int num_q_tokens_per_head_k, int h_k, int? h_q, "
        "bool is_fp8_kvcache, int? topk) -> Tensor[]",
    },
}
