"""The route of the plugin's absorbed up-projections (glm5_hal/vllm/up_projections.py): what decides it, the packed
kernels' check, and what a layer holds after each route. The served model's logits on each route are checked in
test_vllm_logits.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: the plugin's tests run in the vLLM environment")

import vllm._custom_ops  # noqa: E402,F401  (loads vLLM's CPU kernels, as an engine does)
from test_vllm_plugin import run_python  # noqa: E402

from glm5_hal.vllm import up_projections as up  # noqa: E402

# glm5-mini's (and the tiny glm_moe_dsa checkpoint's) up-projections
SHAPE = up.UpProjectionShape(heads=4, qk_nope=192, kv_lora=512, v_head=256, dtype=torch.bfloat16)


def exact_kernels(
    delay_s: float = 0.0, drop_last_input: bool = False, raises: str = "", off_by: float = 0.0
) -> up.PackedKernels:
    """Stand-ins for vLLM's packed kernels: "packing" is a copy, the product is fp32-accumulated and rounded once
    (as the real one); optionally slow, wrong (the last input feature left out of every sum, or every output
    (1 + off_by) times the product) or refusing."""

    def pack(w: torch.Tensor) -> torch.Tensor:
        if raises:
            raise RuntimeError(raises)
        return w.clone()

    def bmm(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, is_vnni: bool, scale: object) -> None:
        assert is_vnni and scale is None
        if delay_s:
            time.sleep(delay_s)
        w = packed.float()
        if drop_last_input:
            w[..., -1] = 0
        out.copy_(torch.bmm(x.float(), w.mT) * (1 + off_by))

    return up.PackedKernels(pack=pack, bmm=bmm)


def test_the_setting_and_the_dtype_decide_before_any_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_timing(*_: object) -> tuple[float, float]:
        raise AssertionError("timed where the setting or the dtype decides")

    monkeypatch.setattr(up, "_decode_seconds", no_timing)
    kernels = exact_kernels()
    monkeypatch.setenv(up.PACKED_ENV, "0")
    assert up.choose_route(SHAPE, kernels) == up.RouteChoice(up.BMM, f"torch.bmm ({up.PACKED_ENV}=0)")
    monkeypatch.setenv(up.PACKED_ENV, "1")
    assert up.choose_route(SHAPE, kernels).route == up.PACKED
    fp32 = up.UpProjectionShape(4, 192, 512, 256, torch.float32)
    assert up.choose_route(fp32, kernels).route == up.BMM  # fp32 tokens equal glm5-hal's bit for bit
    monkeypatch.setenv(up.PACKED_ENV, "yes")
    with pytest.raises(ValueError, match=f"{up.PACKED_ENV}: expected one of"):
        up.choose_route(SHAPE, kernels)


def test_auto_takes_the_faster_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(up.PACKED_ENV, raising=False)
    # measured for real: a packed product that sleeps 2 ms loses to torch.bmm at these dims
    slow = up.choose_route(SHAPE, exact_kernels(delay_s=2e-3))
    assert slow.route == up.BMM and "us torch.bmm" in slow.reason, slow
    monkeypatch.setattr(up, "_decode_seconds", lambda *_: (100e-6, 30e-6))
    fast = up.choose_route(SHAPE, exact_kernels())
    assert fast.route == up.PACKED
    assert fast.reason.endswith("(one decode token, both products: 30 us packed, 100 us torch.bmm)"), fast


@pytest.mark.parametrize(
    "kernels, reason",
    [
        (None, "this vLLM build has no bmm_cpu"),
        (exact_kernels(raises="invalid weight input features 16"), "refused W_UK: invalid weight input features 16"),
        (exact_kernels(drop_last_input=True), "disagreed with an fp64 W_UK product (token count 1)"),
    ],
)
def test_packed_kernels_that_are_missing_refuse_or_disagree_leave_torch_bmm(
    kernels: up.PackedKernels | None, reason: str
) -> None:
    choice = up._decide("1", SHAPE, kernels)  # not even where the setting asks for them
    assert choice.route == up.BMM and reason in choice.reason, choice


def test_the_rounding_bound_passes_a_correct_product_and_nothing_much_worse() -> None:
    """The bound packed_product_error checks is tight enough to catch one term left out of 192 or outputs 2^-6 too
    large (four times the bf16 rounding it allows), and loose enough for a product rounded once from an fp32 sum (the
    stand-in) and for torch's own bf16 bmm."""
    assert up.packed_product_error(exact_kernels(), SHAPE) == ""
    torch_bmm = up.PackedKernels(pack=lambda w: w, bmm=lambda out, x, w, *_: torch.bmm(x, w.mT, out=out))
    assert up.packed_product_error(torch_bmm, SHAPE) == ""
    assert up.packed_product_error(exact_kernels(drop_last_input=True), SHAPE) != ""
    assert up.packed_product_error(exact_kernels(off_by=2.0**-6), SHAPE) != ""


def stub_layer(dtype: torch.dtype, seed: int = 0) -> SimpleNamespace:
    """What route_after_loading reads and writes on vLLM's MLAAttention: W_UK_T / W_UV in vLLM's layouts (set by
    its process_weights_after_loading, counted), the impl, is_amx_bmm_enabled."""
    generator = torch.Generator().manual_seed(seed)
    kv_b = torch.randn(SHAPE.heads * (SHAPE.qk_nope + SHAPE.v_head), SHAPE.kv_lora, generator=generator).to(dtype)
    layer = SimpleNamespace(impl=SimpleNamespace(), is_amx_bmm_enabled=False, processed=[])

    def process_weights_after_loading(act_dtype: torch.dtype) -> None:
        # vLLM skips W_UK_T / W_UV where the packed route is already on: the plugin must turn it off first
        layer.processed.append(layer.is_amx_bmm_enabled)
        w = kv_b.view(SHAPE.heads, SHAPE.qk_nope + SHAPE.v_head, SHAPE.kv_lora)
        layer.W_UK_T = w[:, : SHAPE.qk_nope].contiguous()  # [heads, qk_nope, kv_lora]
        layer.W_UV = w[:, SHAPE.qk_nope :].transpose(1, 2)  # [heads, kv_lora, v_head], a view into kv_b's rows

    layer.process_weights_after_loading = process_weights_after_loading
    return layer


def test_a_layer_on_the_packed_route_computes_what_torch_bmm_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """After route_after_loading with the packed route, the layer holds packed weights whose products (as
    MLAAttention makes them) equal the ones over vLLM's W_UK_T / W_UV, and no unpacked copies; a reload derives
    the weights again. The same on the torch.bmm route, with the compact layout."""
    kernels = up.vllm_packed_kernels() or exact_kernels()  # vLLM's own where this build has them
    if up.packed_product_error(kernels, SHAPE):
        kernels = exact_kernels()  # vLLM's refuse these dims on this CPU (test_vllms_kernels_... says why)
    monkeypatch.setattr(up, "vllm_packed_kernels", lambda: kernels)
    q = torch.randn(3, SHAPE.heads, SHAPE.qk_nope).to(torch.bfloat16).transpose(0, 1)
    latent = torch.randn(3, SHAPE.heads, SHAPE.kv_lora).to(torch.bfloat16).transpose(0, 1)
    for setting in ("1", "0"):
        monkeypatch.setenv(up.PACKED_ENV, setting)
        layer = stub_layer(torch.bfloat16)
        layer.process_weights_after_loading(torch.bfloat16)
        w_uk, w_uv = layer.W_UK_T.clone(), layer.W_UV.clone()  # vLLM's [heads, in, out]
        up.route_after_loading(layer)
        for _ in range(2):  # the first load and a reload
            layer.process_weights_after_loading(torch.bfloat16)
            assert layer.processed[-1] is False
            if setting == "1":
                assert layer.is_amx_bmm_enabled and layer.W_UK_T is None and layer.W_UV is None
                got_uk = torch.empty(3, SHAPE.heads, SHAPE.kv_lora, dtype=torch.bfloat16).transpose(0, 1)
                got_uv = torch.empty(3, SHAPE.heads, SHAPE.v_head, dtype=torch.bfloat16).transpose(0, 1)
                kernels.bmm(got_uk, q, layer.impl._w_uk_packed, True, layer.impl._w_scale)
                kernels.bmm(got_uv, latent, layer.impl._w_uv_packed, True, layer.impl._w_scale)
            else:
                assert not layer.is_amx_bmm_enabled
                assert torch.equal(layer.W_UK_T, w_uk) and torch.equal(layer.W_UV, w_uv)  # the same values
                assert all(w.mT.is_contiguous() for w in (layer.W_UK_T, layer.W_UV))  # contracted dim contiguous
                got_uk, got_uv = torch.bmm(q, layer.W_UK_T), torch.bmm(latent, layer.W_UV)
            # each within the output's rounding of the exact product (the check the plugin makes of vLLM's kernels)
            assert up.within_rounding(got_uk, q, w_uk.mT), setting
            assert up.within_rounding(got_uv, latent, w_uv.mT), setting


def test_vllms_kernels_where_this_build_has_them() -> None:
    """On this machine's vLLM: either the packed kernels take glm5-mini's bf16 up-projections within the bound, or
    choose_route says why not."""
    kernels = up.vllm_packed_kernels()
    if kernels is None:
        assert "no bmm_cpu" in up._decide("1", SHAPE, None).reason
        return
    error = up.packed_product_error(kernels, SHAPE)
    choice = up._decide("1", SHAPE, kernels)
    assert (choice.route == up.PACKED) == (error == ""), (choice, error)
    assert error == "" or error in choice.reason
    # dims that are not multiples of 32: this vLLM's kernels refuse them on this project's Zen 4 ("invalid weight
    # input features 40", logged); whatever a build does, the route follows the check
    odd = up.UpProjectionShape(heads=2, qk_nope=40, kv_lora=512, v_head=24, dtype=torch.bfloat16)
    odd_error, odd_choice = up.packed_product_error(kernels, odd), up._decide("1", odd, kernels)
    assert (odd_choice.route == up.PACKED) == (odd_error == ""), (odd_choice, odd_error)
    assert odd_error == "" or odd_error in odd_choice.reason


def test_a_bad_packed_setting_stops_the_plugin_at_start() -> None:
    done = run_python("from glm5_hal.vllm import plugin\nplugin.activate()", GLM5_HAL_VLLM_PACKED_UP_PROJ="yes")
    assert done.returncode != 0
    assert f"{up.PACKED_ENV}: expected one of" in done.stderr, done.stderr[-3000:]
