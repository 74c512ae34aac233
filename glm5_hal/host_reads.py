"""Whether an op may read a value back to the host (a count, a flag) to pick a cheaper path.

Eager code on a CPU reads such values for free; on an accelerator a read waits for the device, and while a CUDA
graph is being captured or torch.compile is tracing it is not allowed at all. Ops that use a host read to skip
work (the top-k tie check, sparse attention's invalid keys) ask this first and otherwise take the path that needs
none.
"""

from __future__ import annotations

import torch
from torch import Tensor


def host_reads_allowed(t: Tensor) -> bool:
    """Whether a value computed from `t` may be read back to the host here (not while capturing or tracing a
    graph)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())
