"""Turning the plugin on inside one vLLM process (`activate`, called by `glm5_hal.vllm.register`).

Order of what it does, once per process:
1. GLM5_HAL_VLLM=0, or a vLLM outside TESTED_VLLM: one log line, nothing else.
2. The platform's attention choice: for sparse MLA (`use_mla` and `use_sparse`) it asks the platform first and
   takes glm5-hal's backend only where the platform has none (it raises), or always with GLM5_HAL_VLLM=1.
3. The platform's config hook: on a CPU whose `rotary_embedding` op is defective (rope.py), MLA models run vLLM's
   PyTorch RoPE instead. The DSA models glm5-hal serves on a CPU run vLLM's compiled mode (vLLM's default for them,
   breakable CUDA graphs, means no torch.compile there), unless VLLM_USE_BREAKABLE_CUDAGRAPH is set.
4. Out-of-tree layers (mla_layer.py): the MLA layer that runs glm5-hal's indexer where glm5-hal's backend was
   chosen.
5. MoE methods (moe.py): the compressed-tensors W8A8 / W4A8 experts where vLLM has no kernel for them; with
   GLM5_HAL_VLLM_MOE=1, every routed-experts layer glm5-hal can run.
6. With GLM5_HAL_VLLM_QUANT_LINEAR=1, compressed-tensors W8A8 linear layers through glm5-hal (quant_linear.py).
"""

from __future__ import annotations

import re
from typing import Any

from glm5_hal.environment import setting
from glm5_hal.vllm.settings import LOGGER, OFF, ON, TESTED_VLLM, switch

MODE_ENV = "GLM5_HAL_VLLM"
MOE_ENV = "GLM5_HAL_VLLM_MOE"
QUANT_LINEAR_ENV = "GLM5_HAL_VLLM_QUANT_LINEAR"
BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"  # vLLM's: set, it decides the compile mode whatever the plugin says
AUTO = "auto"
_MODES = (AUTO, ON, OFF)

# Where vLLM finds the backend (AttentionBackend classes are named by their import path).
SPARSE_MLA_BACKEND = "glm5_hal.vllm.sparse_mla.Glm5HalSparseMLABackend"

_activated: bool | None = None  # None: not asked yet in this process; then whether the plugin is on


def plugin_mode() -> str:
    """GLM5_HAL_VLLM: "auto" (unset or empty too), "1" or "0"; a ValueError names any other value."""
    value = setting(MODE_ENV, AUTO).strip().lower() or AUTO
    if value not in _MODES:
        raise ValueError(f"{MODE_ENV}: expected one of {_MODES}, got {value!r}")
    return value


def minor_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.32.0", "0.32.1+cpu", "0.32.0rc1.dev12"); None if unreadable."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def version_supported(version: str) -> bool:
    """Whether a vLLM version lies in the tested window (TESTED_VLLM, by minor version)."""
    return minor_version(version) in TESTED_VLLM


def window_text() -> str:
    return ", ".join(f"{major}.{minor}.x" for major, minor in TESTED_VLLM)


def activate() -> bool:
    """Turn the plugin on in this process if its settings and vLLM's version allow (module docstring); returns
    whether it is on. Later calls return the first answer."""
    global _activated
    if _activated is not None:
        return _activated
    from vllm.logger import init_logger

    logger = init_logger(LOGGER)
    mode = plugin_mode()
    if mode == OFF:
        logger.info("glm5-hal vLLM plugin: %s=0, doing nothing", MODE_ENV)
        _activated = False
        return False
    import vllm

    if not version_supported(vllm.__version__):
        logger.warning(
            "glm5-hal vLLM plugin: tested with vLLM %s, found %s; the plugin does nothing (vLLM runs as without it)",
            window_text(),
            vllm.__version__,
        )
        _activated = False
        return False
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform

    from glm5_hal.vllm.caches import HUGE_PAGES_ENV
    from glm5_hal.vllm.mla_layer import register_mla_layer
    from glm5_hal.vllm.moe import register_moe
    from glm5_hal.vllm.quant_linear import register_quant_linear
    from glm5_hal.vllm.up_projections import packed_setting

    # read where the weights and the ops are processed; a bad value fails here, at start, not in a step
    switch(HUGE_PAGES_ENV, default=True)
    packed_setting()
    _install_platform_hooks(type(current_platform), mode)
    _install_compiled_default(VllmConfig, mode)
    register_mla_layer()
    register_moe(enabled=switch(MOE_ENV))
    if switch(QUANT_LINEAR_ENV):
        register_quant_linear()
    _activated = True
    return True


def _selector_config(args: tuple, kwargs: dict) -> Any:
    """The AttentionSelectorConfig of a get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
    call, however vLLM passed it."""
    return kwargs["attn_selector_config"] if "attn_selector_config" in kwargs else args[1]


_SCHEDULING = (
    ("scheduler_config", "enable_chunked_prefill"),
    ("scheduler_config", "max_num_batched_tokens"),
    ("cache_config", "enable_prefix_caching"),
    ("cache_config", "block_size"),  # last: restored only where the user chose it
)


def _scheduling(vllm_config: Any) -> tuple:
    """The settings the CPU platform overrides for MLA models (chunked prefill, the token budget per step, prefix
    caching, the block size)."""
    return tuple(getattr(getattr(vllm_config, part), name) for part, name in _SCHEDULING)


def _restore_scheduling(vllm_config: Any, values: tuple) -> None:
    for (part, name), value in zip(_SCHEDULING[:-1], values[:-1], strict=True):
        setattr(getattr(vllm_config, part), name, value)
    # A block size the user chose is kept too (the CPU platform forces 16 for its own MLA decode kernel; glm5-hal's
    # ops take any block size); without one, the platform's choice stands.
    cache = vllm_config.cache_config
    if getattr(cache, "user_specified_block_size", False) and cache.block_size != values[-1]:
        cache.block_size = values[-1]


def _serves_sparse_mla(vllm_config: Any, mode: str) -> bool:
    """Whether glm5-hal's backend will serve the model's attention: a DSA model (MLA with an indexer) on a platform
    without sparse MLA, or any platform with GLM5_HAL_VLLM=1. Platforms say they lack sparse MLA by raising from their
    choice; the CPU platform does."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or not getattr(model_config, "use_mla", False):
        return False
    if getattr(model_config.hf_text_config, "index_topk", None) is None:
        return False
    from vllm.platforms import current_platform

    return mode == ON or current_platform.is_cpu()


def _install_compiled_default(config_cls: type, mode: str) -> None:
    """DSA models glm5-hal serves on a CPU run vLLM's compiled mode (Dynamo traced once, Inductor), as vLLM runs every
    other architecture there, unless the user set BREAKABLE_ENV.

    Why: vLLM's default for GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM is breakable CUDA graphs, which on a CPU
    means no torch.compile at all, so every small op around attention runs eagerly. Measured on a 2-core AMD EPYC
    (Zen 3, AVX2), glm5-mini dims, bf16, 4K context, the two engines decoding at the same time on one core each
    (perf/vllm_modes.py): compiled 1.14-1.26x the eager decode tokens/s over five rounds. The cost is the compile at
    engine start (~30 s there, cached by vLLM). The wrapper is installed once per class."""
    default = getattr(config_cls, "_uses_breakable_cudagraph_by_default", None)
    if default is None or getattr(config_cls, "_glm5_hal_compiled_default", False):
        return  # a vLLM without the rule (the version window keeps this to 0.32) or already wrapped
    from vllm.logger import init_logger

    logger = init_logger(LOGGER)

    def uses_breakable_cudagraph_by_default(self: Any) -> bool:
        if not default(self):
            return False
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and _serves_sparse_mla(self, mode):
            if not self.model_config.enforce_eager:  # eager: nothing to say (and no process-wide setting made)
                logger.info_once(
                    "glm5-hal vLLM plugin: breakable CUDA graphs (no torch.compile on a CPU) stay off for this DSA "
                    "model, so it runs vLLM's compiled CPU mode; set %s=1 for vLLM's default",
                    BREAKABLE_ENV,
                )
            return False
        return True

    config_cls._uses_breakable_cudagraph_by_default = uses_breakable_cudagraph_by_default
    config_cls._glm5_hal_compiled_default = True


def _install_platform_hooks(platform_cls: type, mode: str) -> None:
    """Wrap the platform class's attention choice and config hook (the wrappers are installed once per class)."""
    if getattr(platform_cls, "_glm5_hal_hooks", False):
        return
    from vllm.logger import init_logger

    from glm5_hal.vllm.rope import apply_rope_workaround

    logger = init_logger(LOGGER)
    choose = platform_cls.get_attn_backend_cls  # bound to the class: call without it
    update = platform_cls.check_and_update_config

    def get_attn_backend_cls(cls, *args: Any, **kwargs: Any) -> str:
        selector = _selector_config(args, kwargs)
        if not (selector.use_mla and selector.use_sparse):
            return choose(*args, **kwargs)
        if mode == AUTO:
            try:
                return choose(*args, **kwargs)
            except (NotImplementedError, ValueError) as exc:
                logger.info_once(
                    "glm5-hal vLLM plugin: %s has no sparse MLA backend (%s); using glm5-hal's (%s)",
                    platform_cls.__name__,
                    exc,
                    SPARSE_MLA_BACKEND,
                )
        from glm5_hal.vllm.sparse_mla import check_selection

        check_selection(selector)
        return SPARSE_MLA_BACKEND

    def check_and_update_config(cls, vllm_config: Any) -> None:
        kept = _scheduling(vllm_config)
        update(vllm_config)
        if _serves_sparse_mla(vllm_config, mode) and _scheduling(vllm_config) != kept:
            # vLLM's CPU platform turns chunked prefill and prefix caching off for every MLA model because its own CPU
            # MLA prefill cannot take them, and forces block size 16 for its decode kernel; glm5-hal's sparse MLA
            # takes any batch of new tokens over any cached context in blocks of any size, so a DSA model it serves
            # keeps what the user (or vLLM's defaults) chose.
            _restore_scheduling(vllm_config, kept)
            logger.info(
                "glm5-hal vLLM plugin: chunked prefill, prefix caching and a chosen block size stay as configured "
                "for this DSA model (glm5-hal's sparse MLA takes them)"
            )
        apply_rope_workaround(cls, vllm_config)

    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    platform_cls._glm5_hal_hooks = True
