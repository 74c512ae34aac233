"""The vllm-kunlun 0.11.1 wheel from PyPI, read (never installed, never imported) for its kernels' schemas.

vllm_kunlun/vllm_utils_wrapper.py wraps each kernel of the closed `kunlun_ops` in a typed
`@custom_op("_C::<name>", mutates_args=())` function. Importing it needs vLLM and kunlun_ops, so the schemas are
rebuilt from the source instead: the file is parsed (ast), each wrapper's parameters (names, annotations,
defaults) become an inspect.Signature, and torch.library.infer_schema turns that into the schema PyTorch would
have registered. One correction: the wrappers declare mutates_args=() although the kernels write their output
arguments (`out`, `lse`, `logits`, `y`, ...); the caller passes the real outputs (OUTPUTS in fakes/kunlun) so that
the schema marks them written (`Tensor(a!)`), as it must for PyTorch to know.
"""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from fakes.wheels import WheelUnavailable, cached_wheel, read_member

VERSION = "0.11.1"
WRAPPER_FILE = "vllm_kunlun/vllm_utils_wrapper.py"
NAMESPACE = "_C"  # the wrappers' namespace: torch.ops._C.<name>

# What the wrappers' annotations may name (evaluated in this namespace only: no import of the wrapper's module).
_ANNOTATION_NAMES: dict[str, object] = {
    "torch": torch,
    "Optional": typing.Optional,
    "List": typing.List,  # noqa: UP006 (the wrapper's own spelling)
    "Tuple": typing.Tuple,  # noqa: UP006
    "Union": typing.Union,
    "list": list,
    "tuple": tuple,
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "None": None,
}


def vllm_kunlun_wheel() -> Path:
    """The cached wheel (pure Python), downloaded with `pip download --no-deps` on first use; WheelUnavailable
    otherwise."""
    return cached_wheel(f"vllm-kunlun=={VERSION}", f"vllm_kunlun-{VERSION}-*.whl", WRAPPER_FILE)


def _registered_name(function: ast.FunctionDef) -> tuple[str, ast.expr | None] | None:
    """("name", the mutates_args expression) if `function` is decorated @custom_op("_C::name", ...), else None."""
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "custom_op"):
            continue
        qualified = ast.literal_eval(decorator.args[0])
        namespace, _, name = qualified.partition("::")
        if namespace == NAMESPACE:
            mutates = next((k.value for k in decorator.keywords if k.arg == "mutates_args"), None)
            return name, mutates
    return None


def _signature(function: ast.FunctionDef) -> inspect.Signature:
    """The wrapper's signature rebuilt from its source: annotations evaluated over typing/torch names only."""
    args = function.args
    positional = args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    parameters = [
        inspect.Parameter(
            arg.arg,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=default,
            annotation=eval(ast.unparse(arg.annotation), {"__builtins__": {}}, _ANNOTATION_NAMES),  # noqa: S307
        )
        for arg, default in zip(positional, defaults, strict=True)
    ]
    returns = eval(ast.unparse(function.returns), {"__builtins__": {}}, _ANNOTATION_NAMES)  # noqa: S307
    return inspect.Signature(parameters, return_annotation=returns)


def wrappers(wheel: Path) -> dict[str, tuple[inspect.Signature, str]]:
    """{op name: (its wrapper's signature, its mutates_args as written)} for every `_C` wrapper in the wheel."""
    tree = ast.parse(read_member(wheel, WRAPPER_FILE))
    found: dict[str, tuple[inspect.Signature, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            registered = _registered_name(node)
            if registered is not None:
                name, mutates = registered
                found[name] = (_signature(node), ast.unparse(mutates) if mutates is not None else "")
    return found


def schemas(wheel: Path, outputs: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """{op name: "name(args) -> returns"} for the ops named in `outputs`, each with its output arguments marked
    written. WheelUnavailable if the wheel lacks one of them."""
    found = wrappers(wheel)
    missing = sorted(set(outputs) - set(found))
    if missing:
        raise WheelUnavailable(f"{wheel.name} has no `_C` wrapper for {missing}")
    result = {}
    for name, written in outputs.items():
        signature, _ = found[name]

        def prototype():  # infer_schema reads __signature__, nothing else of the function
            pass

        prototype.__signature__ = signature
        result[name] = name + torch.library.infer_schema(prototype, mutates_args=tuple(written))
    return result
