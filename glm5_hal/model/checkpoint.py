"""Reading safetensors checkpoints tensor by tensor: shard discovery and a streaming reader.

    files = checkpoint_files("path/to/GLM-5")       # the shards, via model.safetensors.index.json when present
    reader = CheckpointReader("path/to/GLM-5")      # every shard's header: names, dtypes, shapes (no data read)
    reader.info(name).shape, reader.info(name).file
    w = reader.read(name)                           # one tensor, read from its file into a new CPU tensor
    reader.read(name, out=w13[e, :inter])           # ... or straight into (a contiguous slice of) a tensor

A safetensors file is an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}} and the tensors' bytes, offsets relative to the end of the
header (the format's specification, huggingface/safetensors README). The reader parses that header itself and
reads each tensor with one `readinto` into memory it owns: no memory map, so the process holds exactly the tensors
it keeps (the page cache is the kernel's), a tensor can land directly in its final place (a routed expert in its
slot of the stacked expert weights), and the peak while loading a model is the model plus one tensor.
(`safetensors.safe_open` maps the file and returns views of the mapping: every page a load touched stays in the
process until the mapping goes, so a loader copying into other tensors would hold the checkpoint twice.)

Errors name the file and the tensor: a header that does not parse, a tensor whose byte range disagrees with its
dtype and shape or leaves the file, a dtype torch lacks, a file cut short, a name stored twice.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # the Hugging Face index of a sharded checkpoint

# safetensors dtype names -> torch dtypes (the specification's list, where torch has the type).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
# The specification caps the header at 100 MB; a larger length means a file that is not safetensors.
MAX_HEADER_BYTES = 100_000_000
_HEADER_LENGTH = struct.Struct("<Q")


def checkpoint_files(path: str | Path, index_file: str = INDEX_FILE) -> list[Path]:
    """The safetensors files of a checkpoint, in a fixed order.

    path: one .safetensors file; or a directory: the files its index maps to (`index_file`, by default the Hugging
    Face model.safetensors.index.json; other layouts name theirs differently) when it has one, else its
    model.safetensors when present, else every *.safetensors in it.
    FileNotFoundError names what is missing; ValueError an index without a weight map.
    """
    path = Path(path)
    if not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint: {path} is neither a .safetensors file nor a directory")
        return [path]
    index = path / index_file
    if index.is_file():
        files = [path / name for name in sorted(set(_weight_map(index).values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: the shard(s) {missing[:3]} it maps tensors to do not exist")
        return files
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint: no *.safetensors file in {path}")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    """{tensor name: shard file name} of a Hugging Face index file."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{index}: not a Hugging Face index ({exc})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f'{index}: expected a non-empty "weight_map" {{tensor name: file}}')
    return weight_map


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor is stored: its file, safetensors dtype name, shape, and absolute byte range in the file."""

    name: str
    file: Path
    dtype_name: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype; ValueError naming the file and tensor for a safetensors dtype torch does not have."""
        if self.dtype_name not in DTYPES:
            raise ValueError(
                f"{self.file}: tensor {self.name!r} has dtype {self.dtype_name!r}, which this reader does not "
                f"support (known: {sorted(DTYPES)})"
            )
        return DTYPES[self.dtype_name]

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def read_header(file: str | Path) -> dict[str, TensorInfo]:
    """{name: TensorInfo} of one safetensors file, from its header alone (no tensor data is read).

    ValueError naming the file (and the tensor) when the header does not parse, or a tensor's byte range is not
    exactly its shape times its element size, or lies outside the file's data.
    """
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(_HEADER_LENGTH.size)
        if len(head) < _HEADER_LENGTH.size:
            raise ValueError(f"{file}: not a safetensors file ({size} bytes, shorter than the header length)")
        (length,) = _HEADER_LENGTH.unpack(head)
        if length > min(MAX_HEADER_BYTES, size - _HEADER_LENGTH.size):
            raise ValueError(f"{file}: not a safetensors file (header length {length} for a file of {size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{file}: not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: not a safetensors file (its header is not a JSON object)")
    data_start = _HEADER_LENGTH.size + length
    found = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{file}: tensor {name!r}: malformed header entry {entry!r}") from None
        info = TensorInfo(name, file, dtype_name, shape, data_start + begin, data_start + end)
        numel = 1
        for dim in shape:
            numel *= dim
        itemsize = DTYPES[dtype_name].itemsize if dtype_name in DTYPES else None
        if not 0 <= begin <= end or info.stop > size or (itemsize is not None and end - begin != numel * itemsize):
            raise ValueError(
                f"{file}: tensor {name!r}: bytes [{begin}, {end}) of the data do not hold a {dtype_name} tensor "
                f"of shape {shape} inside the file ({size - data_start} data bytes): a corrupt or truncated file"
            )
        found[name] = info
    return found


class CheckpointReader:
    """The tensors of a checkpoint (one safetensors file, or a directory: see checkpoint_files), by name.

    Reads every shard's header up front (names, dtypes, shapes: no data) and each tensor only when asked. With an
    index (`index_file`, see checkpoint_files), every tensor the index maps must be in the shard it names.
    """

    def __init__(self, path: str | Path, index_file: str = INDEX_FILE) -> None:
        self.path = Path(path)
        self.files = checkpoint_files(self.path, index_file)
        self._tensors: dict[str, TensorInfo] = {}
        for file in self.files:
            for name, info in read_header(file).items():
                if name in self._tensors:
                    raise ValueError(
                        f"checkpoint {self.path}: tensor {name!r} is stored twice, in {self._tensors[name].file} "
                        f"and in {file}"
                    )
                self._tensors[name] = info
        index = self.path / index_file
        if self.path.is_dir() and index.is_file():
            wrong = [(n, f) for n, f in _weight_map(index).items() if n not in self or self.info(n).file.name != f]
            if wrong:
                name, file = wrong[0]
                where = f"it is in {self.info(name).file}" if name in self else "no shard holds it"
                raise ValueError(f"{index}: maps {len(wrong)} tensor(s) wrongly, e.g. {name!r} to {file}, but {where}")

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        """Where `name` is stored; KeyError naming the checkpoint when it has no such tensor."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"checkpoint {self.path}: no tensor {name!r}") from None

    @property
    def total_bytes(self) -> int:
        """The bytes of every tensor in the checkpoint."""
        return sum(info.nbytes for info in self._tensors.values())

    def read(self, name: str, *, out: Tensor | None = None) -> Tensor:
        """The tensor `name`, read from its file.

        out: None (a new CPU tensor of the stored dtype and shape), or a contiguous CPU tensor of exactly that
        dtype and number of elements (its shape may differ, e.g. a slice of a stacked tensor), which is filled
        and returned. ValueError naming the file and tensor for a wrong `out` or a file cut short.
        """
        info = self.info(name)
        dtype = info.dtype
        if sys.byteorder != "little" and dtype.itemsize > 1:
            raise ValueError(f"{info.file}: tensor {name!r}: safetensors is little-endian; this machine is not")
        numel = 1
        for dim in info.shape:
            numel *= dim
        if out is None:
            out = torch.empty(info.shape, dtype=dtype)
        elif out.dtype != dtype or out.numel() != numel or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"out: expected a contiguous CPU {dtype} tensor of {numel} elements for {info.file}: {name!r} "
                f"(shape {info.shape}), got {'contiguous' if out.is_contiguous() else 'non-contiguous'} "
                f"{out.device.type} {out.dtype} of shape {tuple(out.shape)}"
            )
        if numel == 0:
            return out
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
        with open(info.file, "rb") as f:
            f.seek(info.start)
            got = f.readinto(buffer)
        if got != info.nbytes:
            raise ValueError(f"{info.file}: tensor {name!r}: read {got} of its {info.nbytes} bytes (file truncated)")
        return out


def load_state_dict(path: str | Path, index_file: str = INDEX_FILE) -> dict[str, Tensor]:
    """All tensors of a checkpoint (one safetensors file, or a directory: see checkpoint_files), in memory."""
    reader = CheckpointReader(path, index_file)
    return {name: reader.read(name) for name in reader}
