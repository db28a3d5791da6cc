"""NumPy arrays to and from attnserve's Tensor messages.

NumPy has no bfloat16. A BFLOAT16 tensor is sent from float32 values rounded to nearest, ties
to even (``to_tensor(array, "bfloat16")``), or from a uint16 array of bit patterns (the upper
half of each float32) as they are; BFLOAT16 tensors the server returns come back widened to
float32, which holds every bfloat16 exactly.
"""
import numpy as np

from attnserve.v1 import attention_pb2 as pb2

# Wire dtype name -> the little-endian NumPy dtype of its packed bytes.
_PACKED = {"FLOAT32": "<f4", "FLOAT16": "<f2", "BFLOAT16": "<u2", "BOOL": "u1"}
# A NumPy array's dtype -> the wire dtype it travels as by default.
_DEFAULT_WIRE = {np.dtype(np.float32): "FLOAT32", np.dtype(np.float16): "FLOAT16",
                 np.dtype(np.uint16): "BFLOAT16", np.dtype(np.bool_): "BOOL",
                 np.dtype(np.float64): "FLOAT32"}
_NAMES = {"float32": "FLOAT32", "float16": "FLOAT16", "bfloat16": "BFLOAT16", "bool": "BOOL"}


def float32_to_bfloat16_bits(values):
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest, ties to even;
    NaN stays NaN."""
    values = np.asarray(values, dtype=np.float32)
    bits = values.view(np.uint32).astype(np.uint64)
    # uint64 constants: NumPy casts a uint64 scalar (a 0-d array's) with a Python int to
    # float64, which has no shifts (a scalar raised TypeError until 2026-12-07).
    one, half, shift = np.uint64(1), np.uint64(0x7FFF), np.uint64(16)
    rounded = (bits + half + ((bits >> shift) & one)) >> shift
    return np.asarray(np.where(np.isnan(values), 0x7FC0, rounded).astype(np.uint16))


def bfloat16_bits_to_float32(bits):
    """float32 values of bfloat16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def wire_dtype(name):
    """"float32", "bfloat16", "float16", "bool" (any case) -> the proto's DType name."""
    upper = _NAMES.get(str(name).lower())
    if upper is None:
        raise ValueError(f"dtype is {name!r}, expected float32, bfloat16, float16 or bool")
    return upper


class DtypeError(ValueError, TypeError):
    """An array attnserve cannot send: a ValueError naming the argument, and a TypeError, as
    to_tensor raised before it named one."""


def check_array(array, dtype=None, what="array"):
    """`array` as a native-order NumPy array that to_tensor(array, dtype) sends, or
    DtypeError naming it as `what`: without `dtype` it must be float32, float16, float64,
    bool or uint16 (bfloat16 bits); with one, any number or bool converts."""
    array = np.asarray(array)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if array.dtype in _DEFAULT_WIRE or (dtype is not None and array.dtype.kind in "biuf"):
        return array
    raise DtypeError(f"{what} is a NumPy {array.dtype} array, expected float32, float16, "
                     f"float64, bool, or uint16 bfloat16 bits (or any number with "
                     f"input_dtype)")


def to_tensor(array, dtype=None, what="array"):
    """A Tensor holding `array`, in either byte order.

    Without `dtype`: float32 (and float64, narrowed) -> FLOAT32, float16 -> FLOAT16, uint16 ->
    BFLOAT16 bit patterns, bool -> BOOL. With `dtype` ("float32", "bfloat16", "float16",
    "bool"), the values are converted to it (float to bfloat16 rounds to nearest even; a
    uint16 array is bfloat16 bit patterns whatever `dtype` says, so it is read as those
    values; other integers as their values). Another array is a DtypeError naming it as
    `what`.
    """
    array = check_array(array, dtype, what)
    if dtype is None:
        name = _DEFAULT_WIRE[array.dtype]
    else:
        name = wire_dtype(dtype)
        if array.dtype == np.uint16 and name != "BFLOAT16":
            array = bfloat16_bits_to_float32(array)
        elif name == "BFLOAT16" and array.dtype != np.uint16:
            array = float32_to_bfloat16_bits(array)
        if name == "BOOL":
            # Nonzero is True (a cast to uint8 sent 0.5 as 0 and 256 as 0), bfloat16 bits
            # read as their values first.
            array = array.astype(np.bool_)
    data = np.ascontiguousarray(array, dtype=_PACKED[name]).tobytes()
    return pb2.Tensor(dtype=name, shape=array.shape, data=data)


def from_tensor(tensor):
    """The array a Tensor holds: float32, float16 or bool; BFLOAT16 widened to float32.
    ValueError for a dtype that is none of those, a negative dimension, or a byte count
    that is not the shape's."""
    name = (pb2.DType.Name(tensor.dtype) if tensor.dtype in pb2.DType.values()
            else str(tensor.dtype))
    if name not in _PACKED:
        raise ValueError(f"a tensor of dtype {name} cannot be read")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"a {name} tensor of shape {list(shape)}: a dimension is negative")
    elements = 1
    for d in shape:  # Python's integers: no wrap at 2**63.
        elements *= d
    if elements * np.dtype(_PACKED[name]).itemsize != len(tensor.data):
        raise ValueError(f"a {name} tensor of shape {list(shape)} holds {len(tensor.data)} "
                         f"bytes")
    array = np.frombuffer(tensor.data, dtype=_PACKED[name]).reshape(shape)
    if name == "BFLOAT16":
        return bfloat16_bits_to_float32(array)
    if name == "BOOL":
        return array.astype(np.bool_)
    return array.astype(array.dtype.newbyteorder("="))  # a writable native copy
