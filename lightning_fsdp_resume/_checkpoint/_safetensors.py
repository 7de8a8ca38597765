"""Writing a safetensors file one tensor at a time, without the ``safetensors`` package; no torch here. The header needs
only shapes and dtypes, so it is written first and each tensor's bytes follow as they are read: memory stays near the
largest tensor. The format's layout: docs/behaviour.md#consolidate-in-detail.
"""
import json
import struct
import sys
from typing import IO, Dict, Iterable, NamedTuple, Optional, Sequence, Tuple

# torch dtype (its name after "torch.") -> safetensors dtype; the unsigned and float8 ones exist in newer torch only.
DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
_ALIGNMENT = 8
# The safetensors readers refuse larger headers.
_MAX_HEADER_BYTES = 100 * 2**20


class TensorSpec(NamedTuple):
    """One tensor of the file: its key, safetensors dtype, shape and size in bytes."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int


def dtype_name(torch_dtype_name: str) -> Optional[str]:
    """The safetensors name of a torch dtype (``"float32"`` or ``"torch.float32"``), or None where it has none."""
    return DTYPES.get(torch_dtype_name.rsplit(".", 1)[-1])


def header(specs: Sequence[TensorSpec], metadata: Dict[str, str]) -> bytes:
    """The length prefix and the padded JSON header for ``specs`` laid out in their order."""
    entries: Dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in specs:
        if spec.name == "__metadata__" or spec.name in entries:
            raise ValueError(f"The tensor name {spec.name!r} appears twice or is reserved in a safetensors header.")
        entries[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % _ALIGNMENT)  # so that the data starts aligned
    if len(text) > _MAX_HEADER_BYTES:
        raise ValueError(f"The safetensors header would take {len(text)} bytes; readers accept at most {_MAX_HEADER_BYTES}.")
    return struct.pack("<Q", len(text)) + text


def write(handle: IO[bytes], specs: Sequence[TensorSpec], metadata: Dict[str, str], chunks: Iterable[memoryview]) -> None:
    """Write the file to ``handle``: the header, then each of ``chunks``, the bytes of ``specs``' tensors in order.

    Each chunk is written before the next is asked for, so its producer can free one tensor before it reads
    the next.
    """
    if sys.byteorder != "little":
        # safetensors stores little-endian bytes; this writes memory as it is.
        raise NotImplementedError("Writing safetensors files is supported on little-endian machines only.")
    handle.write(header(specs, metadata))
    produced = iter(chunks)
    for spec in specs:
        chunk = next(produced, None)
        if chunk is None or chunk.nbytes != spec.nbytes:
            found = "nothing" if chunk is None else f"{chunk.nbytes} bytes"
            raise ValueError(f"The tensor {spec.name!r} came as {found}; its header entry says {spec.nbytes} bytes.")
        handle.write(chunk)
        del chunk  # its memory may be freed by the producer's next step
