"""A model file in another weight type: every quantized matrix of a GGUF expanded and quantized
again as TYPE (workers/weights/kquant_pack.py), metadata and other tensors copied, so the
benchmark can compare the weight paths per type on real weights.

As llama.cpp's quantizer does, a matrix whose rows are not whole 256-value blocks falls back
from a 256-value type (Q2_K, Q3_K -> Q4_0; Q4_K -> Q5_0; Q5_K -> Q5_1; Q6_K -> Q8_0;
IQ4_XS -> IQ4_NL): SmolLM2's rows of 576 keep Q/K/V and gate/up in the fallback, its down projection (1536) takes TYPE. The
quantizers are simpler than llama.cpp's, so such a file is a little less accurate than a
published one of the same type; what the benchmark compares (each path against fp32 on the
same file) does not depend on that.

    python -m tools.bench.requant SRC.gguf Q4_K [OUT.gguf]   # prints the path written
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from workers.weights.kquant_pack import quantize

Q = GGMLQuantizationType
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}
KEEP = (Q.F32, Q.F16, Q.BF16)


def type_for(qtype: GGMLQuantizationType, cols: int) -> GGMLQuantizationType:
    return qtype if cols % GGML_QUANT_SIZES[qtype][0] == 0 else FALLBACK.get(qtype, qtype)


def requantize(src: str, qtype: GGMLQuantizationType, out: str) -> None:
    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # [out, in]
        if tensor.tensor_type in KEEP or len(shape) != 2:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=tuple(tensor.data.shape),
                              raw_dtype=tensor.tensor_type)
            continue
        values = np.asarray(gguf_quants.dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)
        kind = type_for(qtype, shape[1])
        writer.add_tensor(tensor.name, quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def requantized(src: str, type_name: str, cache_dir: str | None = None) -> str:
    """Path of SRC in TYPE, written once into a cache directory (atomically)."""
    qtype = GGMLQuantizationType[type_name.upper()]
    directory = Path(cache_dir or os.environ.get("JUSTAPI_CACHE_DIR") or Path(tempfile.gettempdir()) / "justapi-requant")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{Path(src).stem}.{qtype.name}.gguf"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".partial")
        os.close(fd)
        try:
            requantize(src, qtype, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return str(path)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    if len(argv) == 3:
        requantize(argv[0], GGMLQuantizationType[argv[1].upper()], argv[2])
        print(argv[2])
    else:
        print(requantized(argv[0], argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
