"""Runs one vLLM engine in a fresh process for the plugin's tests: `python vllm_runner.py SPEC.json OUT.json`.

A fresh process per engine keeps each test's settings (GLM5_HAL_VLLM*, vLLM's compile mode, multiprocessing) to
that engine, and lets the test bound it with a timeout. SPEC:

    {"engine": {...LLM keyword arguments...},
     "batches": [{"prompts": [[ids], ...], "max_tokens": 32, "prompt_logprobs": null | n, "logprobs": null | n}],
     "inspect": true}

OUT: {"batches": [{"tokens": [[ids], ...], "prompt_logprobs": [[{token: logprob}, ...], ...] | null}],
      "layers": {...what serves each layer...}, "prefix_cache_hits": int | null}
"""

from __future__ import annotations

import json
import sys
from typing import Any


def describe_model(model: Any) -> dict[str, list[str]]:
    """What serves each layer: attention backend names, index-cache backend names, MoE method classes, the layout
    of the MLA layers' up-projections, and the pages of the KV caches the plugin's ops read."""
    seen: dict[str, list[str]] = {"attention": [], "indexer_cache": [], "moe": [], "linear_schemes": []}
    # name, dtype, the stride of the dim torch.bmm contracts, and whether the heads' matrices lie end to end; or
    # "packed" and the dtype where the layer multiplies by vLLM's bmm_cpu (glm5_hal/vllm/up_projections.py)
    seen["up_projections"] = []
    for _, module in model.named_modules():
        kind = type(module).__name__
        if kind == "MLAAttention":
            seen["attention"].append(module.attn_backend.get_name())
            if getattr(module, "is_amx_bmm_enabled", False):  # vLLM's bmm_cpu over weights packed for it
                packed = module.impl._w_uk_packed
                seen["up_projections"].append(f"packed {str(packed.dtype).removeprefix('torch.')}")
            for name in ("W_UK_T", "W_UV"):
                w = getattr(module, name, None)
                if w is not None:
                    packing = "compact" if w.mT.is_contiguous() or w.is_contiguous() else "strided"
                    seen["up_projections"].append(
                        f"{name} {str(w.dtype).removeprefix('torch.')} {w.stride(-2)} {packing}"
                    )
        elif kind == "DeepseekV32IndexerCache":
            seen["indexer_cache"].append(module.get_attn_backend().get_name())
        elif hasattr(module, "quant_method") and hasattr(module, "w13_weight"):
            seen["moe"].append(type(module.quant_method).__name__)
        elif getattr(module, "scheme", None) is not None:
            seen["linear_schemes"].append(type(module.scheme).__name__)
    # the KV caches the plugin's ops saw, and whether they are on huge pages now (glm5_hal.vllm.caches)
    from glm5_hal.vllm.caches import seen as caches_seen

    seen["kv_cache_pages"] = [
        f"{kind} {'huge' if r.collapsed else 'asked' if r.asked else 'base'}" for kind, r in caches_seen()
    ]
    return {k: sorted(set(v)) for k, v in seen.items()}


def _prefix_cache_hits(llm: Any) -> int | None:
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics are optional in some configurations
        return None
    hits = [m for m in metrics if m.name == "vllm:prefix_cache_hits"]
    return int(sum(getattr(m, "value", 0) for m in hits)) if hits else None


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(skip_tokenizer_init=True, disable_log_stats=False, **spec["engine"])
    results = []
    for batch in spec["batches"]:
        params = SamplingParams(
            max_tokens=batch["max_tokens"],
            temperature=0.0,
            ignore_eos=True,  # random checkpoints: the reference has no stop token either
            detokenize=False,
            prompt_logprobs=batch.get("prompt_logprobs"),
            logprobs=batch.get("logprobs"),
        )
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]], params)
        prompt_logprobs = None
        if batch.get("prompt_logprobs") is not None:
            prompt_logprobs = [
                [None if d is None else {str(t): lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs]
                for o in outputs
            ]
        results.append({"tokens": [list(o.outputs[0].token_ids) for o in outputs], "prompt_logprobs": prompt_logprobs})
    out = {
        "batches": results,
        "prefix_cache_hits": _prefix_cache_hits(llm),
        "compile_mode": llm.llm_engine.vllm_config.compilation_config.mode.name,
    }
    if spec.get("inspect"):
        # by module name, not __main__'s: in multiprocess mode the function travels to the worker by pickle, and the
        # worker imports this module (plugin_fixtures puts its folder on PYTHONPATH)
        import vllm_runner

        out["layers"] = llm.apply_model(vllm_runner.describe_model)[0]
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
