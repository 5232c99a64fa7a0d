"""gguf's GGUFReader with metadata arrays read in bulk. The stock reader builds numpy views for
every element of every array (a 262,144-token vocabulary: ~800k views, 10-20 s per open, paid
by each process that opens the file); this one reads a numeric array as one view and a string
array in one pass over its lengths, bounds-checked, keeping only each string's offset and length
(decoded when read: a Python object per vocabulary entry cost ~20 MiB in every process that
keeps the file open), and leaves the rest (scalars, tensor descriptors, memory-mapped tensor
data) to gguf. Owns: that parsing. Does not own: the checks
and errors callers see (gguf_file.py).
"""
from __future__ import annotations

import sys
from array import array
from typing import Any, Literal

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

ARRAY_HEADER_BYTES = 12  # uint32 element type, uint64 count
STRING_LENGTH_BYTES = 8


class StringArray:
    """A string array's elements, decoded from the mapped file when read."""

    def __init__(self, data: memoryview, starts: np.ndarray, lengths: np.ndarray) -> None:
        self.data, self.starts, self.lengths = data, starts, lengths

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> str:
        start = int(self.starts[index])
        return str(self.data[start:start + int(self.lengths[index])], "utf-8")

    def decode(self, index_or_slice: slice) -> list[str]:
        data = self.data
        return [str(data[start:start + length], "utf-8") for start, length in
                zip(self.starts[index_or_slice].tolist(), self.lengths[index_or_slice].tolist())]


class StringArrayField(ReaderField):
    """A string array's field: its last part is a StringArray."""
    __slots__ = ()

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        strings: StringArray = self.parts[-1]  # type: ignore[assignment]
        if isinstance(index_or_slice, int):
            return strings[index_or_slice]
        return strings.decode(index_or_slice)


class BulkArrayReader(GGUFReader):
    """A GGUFReader (same fields, tensors and contents()) that parses arrays in bulk.
    A numeric array's field holds one part with all values (contents() of the whole array
    or of a slice works; contents(i) of an index reads the first value, as for a scalar);
    a string array's field is a StringArrayField whose last part is a StringArray."""

    def __init__(self, path: Any, mode: Literal["r", "r+", "c"] = "r") -> None:
        super().__init__(path, mode)
        for key, field in self.fields.items():
            if field.parts and isinstance(field.parts[-1], StringArray):
                self.fields[key] = StringArrayField(*field)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int],
                                                                       list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_item_type = self._get(orig_offs, np.uint32)
        count_part = self._get(orig_offs + 4, np.uint64)
        item_type, count = GGUFValueType(int(raw_item_type[0])), int(count_part[0])
        start = orig_offs + ARRAY_HEADER_BYTES
        head: list[Any] = [raw_item_type, count_part]
        numpy_type = self.gguf_scalar_to_np.get(item_type)
        if numpy_type is not None:
            values = self._get_exactly(start, numpy_type, count)
            return ARRAY_HEADER_BYTES + int(values.nbytes), [*head, values], [2], \
                [GGUFValueType.ARRAY, item_type]
        if item_type == GGUFValueType.STRING:
            end, strings = self._read_strings(start, count)
            return end - orig_offs, [*head, strings], [2], [GGUFValueType.ARRAY, item_type]
        return super()._get_field_parts(orig_offs, raw_type)  # nested arrays: rare, small

    def _get_exactly(self, offset: int, dtype: Any, count: int) -> np.ndarray:
        if count * np.dtype(dtype).itemsize > len(self.data) - offset:
            raise ValueError(f"array of {count} items at offset {offset} runs past the file end")
        return self._get(offset, dtype, count)

    def _read_strings(self, offset: int, count: int) -> tuple[int, StringArray]:
        """(offset after the array, its strings): one pass over the inline lengths."""
        data = memoryview(self.data)  # type: ignore[arg-type]  # np.memmap is a buffer
        size = len(data)
        if count * STRING_LENGTH_BYTES > size - offset:
            raise ValueError(f"array of {count} strings at offset {offset} runs past the file end")
        is_big_endian = (sys.byteorder == "big") != (self.byte_order == "S")  # "S": swapped
        order: Literal["little", "big"] = "big" if is_big_endian else "little"
        starts, lengths = array("q"), array("q")
        for _ in range(count):
            end = offset + STRING_LENGTH_BYTES
            length = int.from_bytes(data[offset:end], order) if end <= size else size
            if end + length > size:
                raise ValueError(f"string at offset {offset} runs past the file end")
            starts.append(end)
            lengths.append(length)
            offset = end + length
        return offset, StringArray(data, np.frombuffer(starts, np.int64), np.frombuffer(lengths, np.int64))
