"""Backends of glm5-hal: one sub-package per backend, each exposing a `BACKEND` descriptor.

A backend package holds a small `Backend` descriptor (glm5_hal.registry) and its op implementations. It is
registered through the `glm5_hal.backends` entry-point group (pyproject.toml), exactly as an out-of-tree
vendor package would register its own. A backend never imports another backend: a vendor backend that runs
the portable `torch` path names it in `Backend.delegates` and the registry resolves it.
"""
