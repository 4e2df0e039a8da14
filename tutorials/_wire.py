"""What the autograder and a submission's process send each other: a call's inputs one way, its results the other.

The autograder (``course_grader.py``) runs the checks in its own process and
calls the student's answer in the submission's process
(``course_sandbox.py``), over a Unix socket.  The two directions are not
alike, because only one side may be trusted to send code:

* **inputs, grader to submission**: :func:`dumps_inputs` pickles the
  arguments of a call (arrays, the reference's named tuples), with every
  function among them (a loss the answer must evaluate, as in exercise 10.6)
  replaced by a numbered stand-in; the submission's process unpickles them
  (:func:`loads_inputs`) and calls the answer, and a call of a stand-in is
  sent back to the grader, which runs its own function;
* **results, submission to grader**: :func:`encode` writes only data, in a
  form whose reading runs no code: a JSON tree of ``None``, booleans,
  integers, floats, complex numbers, strings, bytes, ``...``, tuples, lists,
  dicts, NumPy scalars and arrays of numbers (their bytes beside the tree,
  read by ``numpy.frombuffer``; an object array is refused).  A named tuple
  arrives as a tuple, an object with ``__array__`` (a device array) as an
  array; anything else is refused with a message the student can act on.

Messages are framed by :func:`send` and :func:`recv`: 8 bytes of length,
then 4 bytes giving the JSON header's length, the header, and the buffers
its ``"sizes"`` list, in order.  :func:`recv` refuses a message longer than
its ``limit`` without reading it.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
import types
from functools import partial

import numpy as np

LIMIT = 1 << 30  # the largest message read by default: 1 GiB
MAX_DEPTH = 64  # nesting of tuples, lists and dicts in a result
ARRAY_KINDS = "biufcSU"  # NumPy kinds a result may hold: booleans, integers, floats, complexes, bytes, text


class WireError(ValueError):
    """A message that breaks the format, or a result that cannot be sent."""


# ---------------------------------------------------------------------------
# framing
# ---------------------------------------------------------------------------


def send(sock, header: dict, buffers=()) -> None:
    """Send one message: ``header`` (JSON-able) and the byte strings ``buffers``."""
    buffers = [memoryview(b).cast("B") for b in buffers]
    head = json.dumps({**header, "sizes": [b.nbytes for b in buffers]}, allow_nan=True).encode()
    total = 4 + len(head) + sum(b.nbytes for b in buffers)
    sock.sendall(struct.pack(">QI", total, len(head)) + head)
    for b in buffers:
        sock.sendall(b)


def _exactly(sock, n: int) -> bytearray:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the other side closed the connection")
        got += k
    return data


def recv(sock, limit: int = LIMIT) -> tuple[dict, list[bytes]]:
    """Receive one message: ``(header, buffers)``; :class:`EOFError` when the other side has closed."""
    total, n_head = struct.unpack(">QI", bytes(_exactly(sock, 12)))
    if total > limit or n_head > total - 4:
        raise WireError(f"a message of {total} bytes, more than the {limit} allowed")
    header = json.loads(bytes(_exactly(sock, n_head)))
    if not isinstance(header, dict) or not isinstance(header.get("sizes"), list):
        raise WireError("a message without its header")
    sizes = header.pop("sizes")
    if any(not isinstance(s, int) or s < 0 for s in sizes) or 4 + n_head + sum(sizes) != total:
        raise WireError("a message whose sizes do not add up")
    return header, [bytes(_exactly(sock, s)) for s in sizes]


# ---------------------------------------------------------------------------
# results: data only, read without running code
# ---------------------------------------------------------------------------


def encode(value, buffers: list) -> list:
    """The JSON tree of ``value``, its arrays' bytes appended to ``buffers``; :class:`WireError` for what cannot go."""
    return _encode(value, buffers, 0)


def _encode(v, buffers, depth):
    if depth > MAX_DEPTH:
        raise WireError(f"your answer returned values nested more than {MAX_DEPTH} deep")
    if v is None:
        return ["n"]
    if v is Ellipsis:
        return ["e"]
    if isinstance(v, (bool, np.bool_)):
        return ["b", bool(v)]
    if isinstance(v, np.generic) and v.dtype.kind in ARRAY_KINDS:
        buffers.append(np.ascontiguousarray(v).tobytes())
        return ["g", v.dtype.str, len(buffers) - 1]
    if isinstance(v, int):
        return ["i", str(int(v))]
    if isinstance(v, float):
        return ["f", repr(float(v))]
    if isinstance(v, complex):
        return ["c", repr(v.real), repr(v.imag)]
    if isinstance(v, str):
        return ["s", str(v)]
    if isinstance(v, (bytes, bytearray)):
        buffers.append(bytes(v))
        return ["y", len(buffers) - 1]
    if isinstance(v, tuple):
        return ["t", [_encode(x, buffers, depth + 1) for x in v]]
    if isinstance(v, list):
        return ["l", [_encode(x, buffers, depth + 1) for x in v]]
    if isinstance(v, dict):
        return ["d", [[_encode(k, buffers, depth + 1), _encode(x, buffers, depth + 1)] for k, x in v.items()]]
    if not isinstance(v, np.ndarray) and hasattr(v, "copy_to_host"):  # a numba device array
        v = v.copy_to_host()
    if not isinstance(v, np.ndarray) and hasattr(v, "__array__"):
        v = np.asarray(v)
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in ARRAY_KINDS or v.dtype.fields is not None:
            raise WireError(f"your answer returned an array of dtype {v.dtype}: the grader takes arrays of numbers")
        buffers.append(np.ascontiguousarray(v).tobytes())
        return ["a", v.dtype.str, list(v.shape), len(buffers) - 1]
    raise WireError(f"your answer returned a {type(v).__name__}, which the grader cannot take: return numbers, "
                    "arrays, strings, tuples, lists or dicts of them")


def _number(text: str) -> float:
    if not isinstance(text, str) or len(text) > 40:
        raise WireError("a malformed number")
    return float(text)


def _dtype(text) -> np.dtype:
    if not isinstance(text, str) or len(text) > 16:
        raise WireError("a malformed dtype")
    dt = np.dtype(text)
    if dt.kind not in ARRAY_KINDS or dt.fields is not None or dt.hasobject:
        raise WireError(f"an array of dtype {dt}, which the grader does not take")
    return dt


def decode(tree, buffers: list[bytes]):
    """The value that :func:`encode` wrote, read without running any code the sender chose."""
    return _decode(tree, buffers, 0)


def _decode(t, buffers, depth):
    if depth > MAX_DEPTH or not isinstance(t, list) or not t or not isinstance(t[0], str):
        raise WireError("a malformed value")
    tag = t[0]
    if tag == "n":
        return None
    if tag == "e":
        return Ellipsis
    if tag == "b" and isinstance(t[1], bool):
        return t[1]
    if tag == "i" and isinstance(t[1], str):
        return int(t[1])
    if tag == "f":
        return _number(t[1])
    if tag == "c":
        return complex(_number(t[1]), _number(t[2]))
    if tag == "s" and isinstance(t[1], str):
        return t[1]
    if tag == "y":
        return bytes(_buffer(buffers, t[1]))
    if tag == "g":
        dt = _dtype(t[1])
        return np.frombuffer(_buffer(buffers, t[2]), dtype=dt, count=1)[0]
    if tag == "a":
        dt, shape = _dtype(t[1]), t[2]
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise WireError("an array of a malformed shape")
        data = _buffer(buffers, t[3])
        if len(data) != dt.itemsize * math.prod(shape):
            raise WireError("an array whose bytes do not fill its shape")
        return np.frombuffer(data, dtype=dt).reshape(shape).copy()
    if tag in ("t", "l") and isinstance(t[1], list):
        items = [_decode(x, buffers, depth + 1) for x in t[1]]
        return tuple(items) if tag == "t" else items
    if tag == "d" and isinstance(t[1], list):
        out = {}
        for pair in t[1]:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise WireError("a malformed dict")
            key = _decode(pair[0], buffers, depth + 1)
            try:
                out[key] = _decode(pair[1], buffers, depth + 1)
            except TypeError as err:  # an unhashable key
                raise WireError("a dict with a key that is not hashable") from err
        return out
    raise WireError(f"a value of unknown kind {tag!r}")


def _buffer(buffers, index):
    if not isinstance(index, int) or not 0 <= index < len(buffers):
        raise WireError("a value that points to no buffer")
    return buffers[index]


# ---------------------------------------------------------------------------
# inputs: pickled by the grader, functions replaced by stand-ins
# ---------------------------------------------------------------------------

CALLABLES = (types.FunctionType, types.MethodType, partial)


def _stands_in(obj) -> bool:
    """Whether ``obj`` goes to the answer as a :class:`Callback`: a function pickle cannot name (a closure, a lambda),
    a bound method or a partial.  What pickle names (NumPy's reconstructors among them) goes as itself."""
    if isinstance(obj, (types.MethodType, partial)):
        return True
    return isinstance(obj, types.FunctionType) and ("<locals>" in obj.__qualname__ or "<lambda>" in obj.__qualname__)


class Callback:
    """The stand-in, in the submission's process, for a function of the grader passed to the answer.

    Calling it asks the grader to call its function (``ask(number, args,
    kwargs)``) and returns what the grader sends back.
    """

    def __init__(self, number: int, ask):
        self._number, self._ask = number, ask

    def __call__(self, *args, **kwargs):
        return self._ask(self._number, args, kwargs)


def dumps_inputs(args: tuple, kwargs: dict) -> tuple[bytes, list]:
    """``(pickle of (args, kwargs), the functions replaced by stand-ins, by number)``."""
    functions: list = []

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if _stands_in(obj):
                functions.append(obj)
                return ("function", len(functions) - 1)
            return None

    out = io.BytesIO()
    Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump((tuple(args), dict(kwargs)))
    return out.getvalue(), functions


def loads_inputs(data: bytes, ask) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from :func:`dumps_inputs`, each function a :class:`Callback` through ``ask``."""

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            return Callback(pid[1], ask)

    return Unpickler(io.BytesIO(data)).load()


def array_leaves(value) -> list[np.ndarray]:
    """The arrays inside ``value`` (tuples, lists, dicts and objects' attributes), in one fixed order.

    The grader and the submission's process walk the same structure (pickle
    keeps its order), so an array the answer changed in place can be written
    back into the grader's own by its position in this list.
    """
    out, seen = [], set()

    def walk(v, depth):
        if id(v) in seen or depth > MAX_DEPTH:
            return
        seen.add(id(v))
        if isinstance(v, np.ndarray):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk(x, depth + 1)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x, depth + 1)
        elif hasattr(v, "__dict__") and not isinstance(v, (type, types.ModuleType, Callback) + CALLABLES):
            for x in vars(v).values():
                walk(x, depth + 1)

    walk(value, 0)
    return out
