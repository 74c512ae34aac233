"""The causal LM users hold: the network (decoder.DecoderModel) with loading from a checkpoint directory
(pretrained.py) and generation through the paged cache (generate.py).

    model = CausalLM.from_pretrained("path/to/GLM-5", dtype=torch.bfloat16)
    out = model.generate([[1, 2, 3]], max_new_tokens=32)

It sits above the three modules it joins, which know the network only as DecoderModel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from glm5_hal.model.decoder import DecoderModel
from glm5_hal.model.generate import Generation, generate
from glm5_hal.model.pretrained import from_pretrained


class CausalLM(DecoderModel):
    """A GLM-5 / DeepSeek-V3.2 causal LM: DecoderModel (its module names, forward, step, prefill, new_cache) plus
    `from_pretrained` and `generate`. Build one from a config and a checkpoint-named state dict, or from a
    checkpoint directory."""

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        backend: str | None = None,
    ) -> CausalLM:
        """The model of a checkpoint directory (config.json + safetensors: floating, FP8 block-scaled, or a format
        registered under `glm5_hal.checkpoint_formats` such as `glm5-hal quantize`'s output), streamed tensor by
        tensor. dtype: the floating dtype (None: the checkpoint's); device: where weights and cache live;
        backend: the glm5_hal backend its ops run on (None: the usual selection). See pretrained.from_pretrained.
        """
        return from_pretrained(path, dtype=dtype, device=device, backend=backend, model_class=cls)

    def generate(
        self,
        prompts: Sequence[Sequence[int] | Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        max_batch_size: int | None = None,
        block_size: int = 16,
        progress: Callable[[int, int, str], None] | None = None,
        kv_cache_dtype: str = "auto",
        index_cache_dtype: str = "auto",
    ) -> Generation:
        """Continue every prompt (token ids) by up to max_new_tokens tokens, in continuous batches through the
        paged cache: greedy at temperature 0, else sampled (top_p nucleus, seeded); a sequence that emits a
        stop token leaves the batch; kv_cache_dtype / index_cache_dtype pick the cache formats (new_cache). Returns
        a Generation (.tokens per prompt, .finish_reasons, .stats); see glm5_hal.model.generate.generate for every
        argument."""
        return generate(
            self,
            prompts,
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=stop_token_ids,
            seed=seed,
            max_batch_size=max_batch_size,
            block_size=block_size,
            progress=progress,
            kv_cache_dtype=kv_cache_dtype,
            index_cache_dtype=index_cache_dtype,
        )
