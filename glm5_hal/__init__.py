"""glm5-hal: one device-abstract interface for the hot operators of GLM-5 and DeepSeek-V3.2.

    import glm5_hal
    out, lse = glm5_hal.sparse_flash_attention(q, kv_cache, indices, block_table, seq_lens_k, cu_seqlens_q, 0.0625)

The backend that runs each op comes from `GLM5_HAL_BACKEND` (default `auto`), `GLM5_HAL_OP_BACKENDS`,
`set_backend` or the `use_backend` context manager (glm5_hal.selection). Importing this package never imports
a vendor library.
"""

from glm5_hal.config import DEEPSEEK_V32, GLM5, GLM5_MINI, PRESETS, ModelConfig, get_preset
from glm5_hal.ops import (
    EPDispatch,
    EPHandle,
    dynamic_quant,
    ep_combine,
    ep_dispatch,
    fused_moe,
    grouped_matmul,
    hadamard_transform,
    indexer_logits,
    indexer_prolog,
    lightning_indexer,
    mla_prolog,
    moe_combine,
    moe_dispatch,
    moe_gate,
    quant_matmul,
    sparse_flash_attention,
    w4a8_matmul,
)
from glm5_hal.registry import ALL_OP_NAMES, EP_OP_NAMES, OP_NAMES, Availability, Backend, registry
from glm5_hal.selection import (
    BackendError,
    BackendNotFoundError,
    BackendUnavailableError,
    Float64UnsupportedError,
    OpNotImplementedError,
    explain,
    resolve,
    set_backend,
    use_backend,
)

__version__ = "0.1.0"

__all__ = [
    # ops (docs/ops.md)
    "mla_prolog",
    "indexer_prolog",
    "indexer_logits",
    "lightning_indexer",
    "sparse_flash_attention",
    "moe_gate",
    "moe_dispatch",
    "grouped_matmul",
    "moe_combine",
    "fused_moe",
    "dynamic_quant",
    "quant_matmul",
    "w4a8_matmul",
    "hadamard_transform",
    # expert parallelism (collectives over torch.distributed)
    "ep_dispatch",
    "ep_combine",
    "EPDispatch",
    "EPHandle",
    # model configs
    "ModelConfig",
    "GLM5",
    "DEEPSEEK_V32",
    "GLM5_MINI",
    "PRESETS",
    "get_preset",
    # backends and selection
    "OP_NAMES",
    "EP_OP_NAMES",
    "ALL_OP_NAMES",
    "Backend",
    "Availability",
    "registry",
    "set_backend",
    "use_backend",
    "resolve",
    "explain",
    "BackendError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "OpNotImplementedError",
    "Float64UnsupportedError",
]
