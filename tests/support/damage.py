"""Damage as disks and copies make it: one bit flipped in a checkpoint file, at positions of every kind of its bytes
(the ranges a sharded save hashed, a torch zip file's records and headers)."""
import io
import json
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Iterator, List, Tuple


def flipped(path: Path, position: int, bit: int = 0) -> None:
    """Flip one bit of ``path`` in place (flipping it again undoes it)."""
    data = bytearray(path.read_bytes())
    data[position] ^= 1 << bit
    path.write_bytes(bytes(data))


def index_end(directory: Path) -> int:
    """Where the pickle of a sharded checkpoint's ``.metadata`` (DCP's index) ends: torch's readers stop there."""
    stream = io.BytesIO((directory / ".metadata").read_bytes())
    pickle.load(stream)  # the test's own checkpoint
    return stream.tell()


def carries_checksums(directory: Path) -> bool:
    """Whether anything follows the index's pickle in ``.metadata`` (this package's manifest; native writes none)."""
    return index_end(directory) < (directory / ".metadata").stat().st_size


def manifest(directory: Path) -> dict:
    """The ranges a sharded save hashed, by file: [offset, length, digest, entry] (the JSON that follows the index's
    pickle in ``.metadata``)."""
    rest = (directory / ".metadata").read_bytes()[index_end(directory):].decode("latin-1")
    return json.JSONDecoder().raw_decode(rest)[0]["files"]


def without_checksums(directory: Path) -> None:
    """``.metadata`` cut back to the index's pickle, as native Lightning writes it: the checkpoint carries no
    checksums."""
    index = directory / ".metadata"
    index.write_bytes(index.read_bytes()[:index_end(directory)])


def largest_item(directory: Path, name: str) -> List:
    """The largest range of shard file ``name``: a tensor's [offset, length, digest, entry]."""
    return max(manifest(directory)[name], key=lambda r: r[1])


def sharded_positions(directory: Path) -> Iterator[Tuple[str, int]]:
    """Positions in every file of a sharded checkpoint: its first and last byte, and the first, middle and last byte of
    every fourth range its save hashed (pickled entries and tensors of the shards; the zip records of ``meta.pt``)."""
    for name, ranges in sorted(manifest(directory).items()):
        size = (directory / name).stat().st_size
        positions = {0, size - 1}
        for offset, length, *_ in ranges[:: max(1, len(ranges) // 4)]:
            positions |= {offset, offset + length // 2, offset + length - 1}
        for position in sorted(positions):
            yield name, position


def zip_positions(path: Path) -> List[int]:
    """Positions in a torch zip file: every record's first, middle and last byte, and the fields of its local header, data
    descriptor and central directory entry that say where and what it is (name, sizes, CRC-32)."""
    positions, data = [], path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        central = data.rfind(b"PK\x01\x02")  # the last central directory entry
        for info in archive.infolist():
            name_length, extra_length = struct.unpack("<2H", data[info.header_offset + 26:info.header_offset + 30])
            start = info.header_offset + 30 + name_length + extra_length
            if info.file_size:
                positions += [start, start + info.file_size // 2, start + info.file_size - 1]
            positions += [info.header_offset + 14, info.header_offset + 18, info.header_offset + 30]  # CRC, size, name
            if info.flag_bits & 0x08:  # its CRC-32 and sizes follow the data, in a descriptor
                after = start + info.compress_size
                positions.append(after + (4 if data[after:after + 4] == b"PK\x07\x08" else 0))
    return sorted(set(positions + [central + 16, central + 46]))


def records(path: Path) -> List[Tuple[str, int, int]]:
    """Each record of a torch zip file: its name, where its data starts, and its size."""
    data, found = path.read_bytes(), []
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name_length, extra_length = struct.unpack("<2H", data[info.header_offset + 26:info.header_offset + 30])
            found.append((info.filename, info.header_offset + 30 + name_length + extra_length, info.file_size))
    return found


def middle_of_largest_record(path: Path) -> int:
    """A byte in the middle of a torch zip file's largest record (a tensor)."""
    _, start, size = max(records(path), key=lambda record: record[2])
    return start + size // 2
