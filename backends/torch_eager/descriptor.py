"""Descriptor of the `torch` backend: the portable PyTorch-eager implementation of every op."""

from glm5_hal.kv_formats import FORMATS
from glm5_hal.registry import ANY_DEVICE, Availability, Backend, BackendReport


def _load_ops():
    from backends.torch_eager import OPS

    return OPS


def _prepare(device: object) -> None:
    from backends.torch_eager.report import prepare

    prepare(device)


def _report() -> BackendReport:
    from backends.torch_eager.report import report

    return report()


BACKEND = Backend(
    name="torch",
    summary="portable PyTorch eager ops; runs on any torch device (cpu, cuda, npu, mlu, musa, gcu, ...)",
    probe=lambda: Availability(True, "PyTorch is installed", (ANY_DEVICE,)),
    load_ops=_load_ops,
    # The floor of `auto`: every device torch has runs it, so every op has somewhere to go.
    auto_priority=0,
    kv_cache_dtypes=tuple(FORMATS),
    prepare=_prepare,
    report=_report,
)
