"""NumPy float64 references of every glm5-hal op: the specification in code (OPS.md).

NumPy only, float64 inside, written to be read: a backend is correct when it matches these within the
tolerance policy of DESIGN.md. Loops over tokens are deliberate where they make the rule obvious.
"""

from ops_reference.attention import dense_mla_attention, sparse_flash_attention
from ops_reference.expert_parallel import ep_combine, ep_dispatch
from ops_reference.hadamard import HADAMARD_BASE_SIZES, hadamard_base_size, hadamard_matrix, hadamard_transform
from ops_reference.indexer import indexer_logits, indexer_prolog, lightning_indexer
from ops_reference.kv_cache import (
    FORMATS,
    KVCacheFormat,
    cache_format,
    decode_e4m3,
    decode_rows,
    dequantize_cache,
    encode_e4m3,
    encode_rows,
)
from ops_reference.mla import mla_prolog
from ops_reference.moe import fused_moe, grouped_matmul, moe_combine, moe_dispatch, moe_gate, silu
from ops_reference.norms import layer_norm, rms_norm
from ops_reference.paged_cache import gather_keys, token_positions, token_sequences, write_cache
from ops_reference.quant import (
    dynamic_quant,
    int_matmul,
    pack_int4,
    quant_matmul,
    quantize_weight_int4,
    quantize_weight_int8,
    unpack_int4,
    w4a8_matmul,
)
from ops_reference.rope import rope, rope_cos_sin

__all__ = [
    "FORMATS",
    "HADAMARD_BASE_SIZES",
    "KVCacheFormat",
    "cache_format",
    "decode_e4m3",
    "decode_rows",
    "dequantize_cache",
    "encode_e4m3",
    "encode_rows",
    "dense_mla_attention",
    "dynamic_quant",
    "ep_combine",
    "ep_dispatch",
    "fused_moe",
    "gather_keys",
    "grouped_matmul",
    "hadamard_base_size",
    "hadamard_matrix",
    "hadamard_transform",
    "indexer_logits",
    "indexer_prolog",
    "int_matmul",
    "layer_norm",
    "lightning_indexer",
    "mla_prolog",
    "moe_combine",
    "moe_dispatch",
    "moe_gate",
    "pack_int4",
    "quant_matmul",
    "quantize_weight_int4",
    "quantize_weight_int8",
    "rms_norm",
    "rope",
    "rope_cos_sin",
    "silu",
    "sparse_flash_attention",
    "token_positions",
    "token_sequences",
    "unpack_int4",
    "w4a8_matmul",
    "write_cache",
]
