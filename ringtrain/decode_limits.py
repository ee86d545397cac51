"""Limits checked on bytes from outside the job before anything decodes them: a pickle's opcodes, the pickle
inside a ``torch.save`` zip, a JSON text. A leaf module (the standard library only; torch imported where a
zip is opened), so that ``comm/``, ``checkpoint/`` and ``heal/`` share one bound.

Why before: the decoders fail badly on hostile input. A pickle whose structure nests 200,000 deep (a dict keyed
by a tuple inside a tuple..., a few hundred KB) makes CPython's C code recurse until the process dies with
SIGSEGV (the key's hash, in torch's weights-only unpickler as in the C one); a 10-byte pickle whose
``LONG_BINPUT`` names memo slot 2**28 makes the C unpickler allocate gigabytes for 20 s; ``json.loads`` of
100,000 ``[`` raises ``RecursionError``. None of these is an exception a caller can turn into one line
before the damage.

``check_pickle`` walks the opcodes with ``pickletools.genops`` (iterative: no recursion, nothing built) and
follows the stack the unpickler would build, as a graph of the containers and objects it would make. It
refuses, in one line:

- more than ``max_bytes`` of pickle, or a ``PUT``/``BINPUT``/``LONG_BINPUT`` slot beyond the pickle's size (a
  real pickler numbers its memo from 0, one slot per object: never more slots than bytes);
- a structure nesting more than ``max_depth`` levels (a container's depth is one more than its deepest item;
  an object's, one more than its arguments' or its state's);
- a container or object changed after a second reference to it was taken (``APPEND(S)``, ``SETITEM(S)``,
  ``ADDITEMS`` or ``BUILD`` on what ``GET`` or ``DUP`` pushed again). That is what keeps the depth exact:
  otherwise a list put inside another and grown later deepens its parent unseen (and cycles are built so).
  Picklers write each object's items and state right after creating it, before any second reference: only
  self-referencing structures are refused, and ringtrain stores none.

With an ``AllowList`` (``.metadata``: ``checkpoint/dcp_metadata.py``) it also refuses any opcode that reaches a
class or a function other than to construct a new instance of an allowed class from plain values: no global
outside the list; ``REDUCE``/``NEWOBJ`` only on an allowed class or function, with a tuple of plain values
(numbers, strings, tuples and lists of them); ``BUILD`` only on such a new instance, once, of a class whose
state the list names (a dict of its known fields, or ``__setstate__``'s tuple), never on a class or function
(``BUILD`` on a class sets class attributes: ``PosixPath.__fspath__``); ``SETITEM(S)`` on dicts and
``APPEND(S)`` on lists only; a class or function never used as a value; and no other object-making opcode
(``INST``, ``OBJ``, ``NEWOBJ_EX``, ``PERSID``, ``EXT*``, sets, buffers).

    check_pickle(raw)                                   # Refused(reason) or None; nothing is unpickled
    check_pickle(raw, allow=ALLOW)                      # and only what ALLOW admits
    check_torch_save(payload)                           # the data.pkl of a torch.save zip, by torch's own reader
    state = load_weights_only(payload)                  # that, then torch.load(weights_only=True)
    check_json(data)                                    # nesting depth, before json.loads
"""

from __future__ import annotations

import io
import pickletools
import re
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_PICKLE_BYTES", "MAX_JSON_DEPTH", "Refused", "AllowList", "check_pickle",
           "check_torch_save", "torch_save_pickle", "load_weights_only", "check_json"]

MAX_DEPTH = 200
"""Deepest structure admitted in a pickle. What ringtrain pickles nests about a dozen levels (a tensor counts
four: the call, its arguments, its storage's id); CPython's own recursion limit is 1000, and code that walks
what was loaded recurses once per level."""
MAX_PICKLE_BYTES = 1 << 30
"""Largest pickle admitted (a torch.save's data.pkl holds no tensor data: a few hundred bytes per tensor)."""
MAX_JSON_DEPTH = 200
"""Deepest JSON admitted: ``json.loads`` recurses once per level, under the interpreter's limit of 1000."""


class Refused(Exception):
    """Bytes refused before decoding; ``str(err)`` is one line saying why. ``corrupt``: malformed (damaged, or
    not this format at all), rather than well-formed and hostile."""

    def __init__(self, reason: str, corrupt: bool = False):
        super().__init__(reason)
        self.corrupt = corrupt


@dataclass(frozen=True)
class AllowList:
    """What a strict scan admits, by ``(module, name)`` as the pickle names it."""

    classes: Mapping[tuple[str, str], frozenset[str] | str | None] = field(default_factory=dict)
    """Classes that may be called (``REDUCE``/``NEWOBJ``) with plain values, each with what ``BUILD`` may do to a
    new instance: a frozenset of field names (a dict state with those keys only), ``"setstate"`` (its
    ``__setstate__`` takes a tuple), or None (no ``BUILD``)."""
    functions: frozenset[tuple[str, str]] = frozenset()
    """Functions that may be called with plain values (their result is a value, never built upon)."""
    values: Callable[[str, str], bool] = lambda module, name: False
    """Globals that are values, never called (``torch.float32``)."""


# --- the scan ------------------------------------------------------------------------------------------
_MARK = object()
_SCALAR = object()  # a number, bytes, None, a bool: never a container
# Node kinds (an entry on the stack that is not a scalar, a str or a mark is a node id).
_TUPLE, _LIST, _DICT, _SET, _GLOBAL, _OBJECT, _PERSID = range(7)
_KIND_NAMES = {_TUPLE: "a tuple", _LIST: "a list", _DICT: "a dict", _SET: "a set", _GLOBAL: "a global",
               _OBJECT: "an object", _PERSID: "a persistent id"}

_SCALARS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING",
                      "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "NONE", "NEWTRUE",
                      "NEWFALSE", "FLOAT", "BINFLOAT", "NEXT_BUFFER"})
_TEXT = frozenset({"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_STRICT_REFUSED = frozenset({"INST", "OBJ", "NEWOBJ_EX", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "EMPTY_SET",
                             "ADDITEMS", "FROZENSET", "NEXT_BUFFER", "READONLY_BUFFER", "BYTEARRAY8"})


class _Scan:
    def __init__(self, size: int, max_depth: int, allow: AllowList | None):
        self.size = size
        self.max_depth = max_depth
        self.allow = allow
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.kind = bytearray()
        self.depth = array("l")
        self.shared = bytearray()
        self.built = bytearray()
        self.tag: dict[int, Any] = {}  # global: (module, name); object: its class's (module, name); dict: its keys

    # --- entries -------------------------------------------------------------------------------------
    def new(self, kind: int, depth: int, tag: Any = None) -> int:
        node = len(self.kind)
        self.kind.append(kind)
        self.depth.append(0)
        self.shared.append(0)
        self.built.append(0)
        if tag is not None:
            self.tag[node] = tag
        self.deepen(node, depth)
        return node

    def deepen(self, node: int, depth: int) -> None:
        if depth > self.depth[node]:
            if depth > self.max_depth:
                raise Refused(f"nests more than {self.max_depth} levels deep")
            self.depth[node] = depth

    def depth_of(self, entry: Any) -> int:
        return self.depth[entry] if type(entry) is int else 0

    def pop(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise Refused("pops from an empty stack", corrupt=True)
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise Refused("works on an empty stack", corrupt=True)
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise Refused("closes a MARK it never opened", corrupt=True)
        start = self.marks.pop()
        items = self.stack[start + 1:]
        del self.stack[start:]
        return items

    def push_mark(self) -> None:
        self.marks.append(len(self.stack))
        self.stack.append(_MARK)

    # --- strict rules ----------------------------------------------------------------------------------
    def describe(self, entry: Any) -> str:
        if type(entry) is not int:
            return "a plain value"
        kind = self.kind[entry]
        if kind in (_GLOBAL, _OBJECT):
            module, name = self.tag.get(entry, ("?", "?"))
            return f"{'global' if kind == _GLOBAL else 'an instance of'} {module}.{name}"
        return _KIND_NAMES[kind]

    def callable_global(self, entry: Any) -> bool:
        """A class or function of the allow-list (a global that is not a value)."""
        return (type(entry) is int and self.kind[entry] == _GLOBAL
                and not self.allow.values(*self.tag.get(entry, ("", ""))))

    def as_value(self, entry: Any) -> None:
        """``entry`` becomes an item, a key, an argument or a state: never a class or a function."""
        if self.allow is not None and self.callable_global(entry):
            raise Refused(f"uses {self.describe(entry)} as a value (only its instances are data)")

    def plain(self, entry: Any) -> bool:
        if type(entry) is not int:
            return True
        kind = self.kind[entry]
        return kind in (_TUPLE, _LIST) and self.tag.get(entry) == "plain"

    def check_global(self, module: Any, name: Any) -> tuple[str, str]:
        if type(module) is not str or type(name) is not str:
            raise Refused("names a global with values that are not strings")
        key = (module, name)
        if self.allow is not None and key not in self.allow.classes and key not in self.allow.functions \
                and not self.allow.values(module, name):
            raise Refused(f"refers to {module}.{name}, which is not allowed here")
        return key

    def check_call(self, func: Any, args: Any, op: str) -> tuple[str, str]:
        if self.allow is None:
            return self.tag.get(func, ("?", "?")) if type(func) is int else ("?", "?")
        if not self.callable_global(func):
            raise Refused(f"calls {self.describe(func)} ({op}): only allowed classes and functions are called")
        key = self.tag[func]
        if op == "NEWOBJ" and key not in self.allow.classes:
            raise Refused(f"makes an instance of {key[0]}.{key[1]}, which is not a class allowed here ({op})")
        if not (type(args) is int and self.kind[args] == _TUPLE and self.plain(args)):
            raise Refused(f"calls {key[0]}.{key[1]} with {self.describe(args)} that is not plain values ({op})")
        return key

    def check_mutation(self, op: str, target: Any, want: int) -> None:
        if type(target) is not int:
            raise Refused(f"applies {op} to a plain value", corrupt=True)
        if self.shared[target]:
            raise Refused(f"applies {op} to {self.describe(target)} after a second reference to it was taken "
                          "(a self-referencing or re-opened structure)")
        if self.allow is not None and self.kind[target] != want:
            raise Refused(f"applies {op} to {self.describe(target)}, not {_KIND_NAMES[want]}")

    def check_build(self, target: Any, state: Any) -> None:
        self.check_mutation("BUILD", target, _OBJECT)
        if self.allow is None:
            return
        key = self.tag.get(target)
        rule = self.allow.classes.get(key) if key in self.allow.classes else None
        if rule is None or self.built[target]:
            raise Refused(f"applies BUILD to {self.describe(target)}, whose state is never set that way")
        if rule == "setstate":
            if not (type(state) is int and self.kind[state] == _TUPLE):
                raise Refused(f"sets the state of {self.describe(target)} from {self.describe(state)}, not a tuple")
            return
        keys = self.tag.get(state) if type(state) is int and self.kind[state] == _DICT else None
        if keys is None or not isinstance(keys, set) or not keys <= rule:
            extra = sorted(map(str, keys - rule)) if isinstance(keys, set) else None
            raise Refused(f"sets {', '.join(extra) if extra else self.describe(state)} on {self.describe(target)}, "
                          "which are not its fields")

    # --- the opcodes ----------------------------------------------------------------------------------
    def scalar(self, name: str, arg: Any) -> None:
        self.stack.append(_SCALAR)

    def text(self, name: str, arg: Any) -> None:
        self.stack.append(arg)

    def empty(self, name: str, arg: Any) -> None:
        kind, tag = {"EMPTY_LIST": (_LIST, "plain"), "EMPTY_TUPLE": (_TUPLE, "plain"), "EMPTY_DICT": (_DICT, set()),
                     "EMPTY_SET": (_SET, None)}[name]
        self.stack.append(self.new(kind, 1, tag))

    def collect(self, name: str, arg: Any) -> None:
        """TUPLE, TUPLE1-3, LIST, DICT, FROZENSET: a new container of items on the stack."""
        items = [self.pop() for _ in range(int(name[-1]))][::-1] if name[-1].isdigit() else self.pop_mark()
        for item in items:
            self.as_value(item)
        kind = {"LIST": _LIST, "FROZENSET": _SET, "DICT": _DICT}.get(name, _TUPLE)
        if kind == _DICT:
            if len(items) % 2:
                raise Refused("builds a dict from an odd number of items", corrupt=True)
            tag: Any = set(items[0::2]) if all(type(k) is str for k in items[0::2]) else "keys"
        else:
            tag = "plain" if all(self.plain(i) for i in items) else None
        self.stack.append(self.new(kind, 1 + max(map(self.depth_of, items), default=0), tag))

    def add(self, name: str, arg: Any) -> None:
        """APPEND(S), SETITEM(S), ADDITEMS: items into the container under them."""
        items = self.pop_mark() if name.endswith("S") else [self.pop() for _ in range(2 if name == "SETITEM" else 1)][::-1]
        target = self.top()
        want = _DICT if name.startswith("SETITEM") else _SET if name == "ADDITEMS" else _LIST
        self.check_mutation(name, target, want)
        for item in items:
            self.as_value(item)
        if want == _DICT:
            if len(items) % 2:
                raise Refused(f"{name} with an odd number of items", corrupt=True)
            keys = self.tag.get(target)
            if isinstance(keys, set):
                if all(type(k) is str for k in items[0::2]):
                    keys.update(items[0::2])
                else:
                    self.tag[target] = "keys"
        elif want == _LIST and self.tag.get(target) == "plain" and not all(self.plain(i) for i in items):
            del self.tag[target]
        self.deepen(target, 1 + max(map(self.depth_of, items), default=0))

    def mark(self, name: str, arg: Any) -> None:
        self.push_mark()

    def pop_op(self, name: str, arg: Any) -> None:
        if name == "POP" and not (self.stack and self.stack[-1] is _MARK):
            self.pop()
        else:
            self.pop_mark()

    def again(self, name: str, arg: Any) -> None:
        """DUP, GET, BINGET, LONG_BINGET: a second reference to an entry."""
        if name == "DUP":
            entry = self.top()
        elif arg in self.memo:
            entry = self.memo[arg]
        else:
            raise Refused(f"fetches memo slot {arg}, which was never stored", corrupt=True)
        if type(entry) is int:
            self.shared[entry] = 1
        self.stack.append(entry)

    def put(self, name: str, arg: Any) -> None:
        index = len(self.memo) if name == "MEMOIZE" else arg
        if not (type(index) is int and 0 <= index < self.size):
            raise Refused(f"stores memo slot {index}, beyond the {self.size} bytes of the pickle")
        self.memo[index] = self.top()

    def global_op(self, name: str, arg: Any) -> None:
        if name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
        elif name == "STACK_GLOBAL":
            attr, module = self.pop(), self.pop()
        else:  # EXT1/2/4: the copyreg extension registry
            self.stack.append(self.new(_GLOBAL, 0))
            return
        if self.allow is None and not (type(module) is str and type(attr) is str):
            self.stack.append(self.new(_GLOBAL, 0))
        else:
            self.stack.append(self.new(_GLOBAL, 0, self.check_global(module, attr)))

    def call(self, name: str, arg: Any) -> None:
        """REDUCE, NEWOBJ, NEWOBJ_EX, INST, OBJ: a callable's result."""
        if name in ("REDUCE", "NEWOBJ"):
            args = self.pop()
            func = self.pop()
            key = self.check_call(func, args, name)
            self.stack.append(self.new(_OBJECT, 1 + max(self.depth_of(args), self.depth_of(func)), key))
            return
        parts = [self.pop() for _ in range(3)] if name == "NEWOBJ_EX" else self.pop_mark()
        self.stack.append(self.new(_OBJECT, 1 + max(map(self.depth_of, parts), default=0)))

    def build(self, name: str, arg: Any) -> None:
        state = self.pop()
        target = self.top()
        self.as_value(state)
        self.check_build(target, state)
        self.built[target] = 1
        self.deepen(target, 1 + self.depth_of(state))

    def persid(self, name: str, arg: Any) -> None:
        self.stack.append(self.new(_PERSID, 1 + (self.depth_of(self.pop()) if name == "BINPERSID" else 0)))

    def nothing(self, name: str, arg: Any) -> None:
        pass  # PROTO, FRAME, READONLY_BUFFER (a buffer stays a value), STOP

    def handlers(self) -> dict[str, Callable[[str, Any], None]]:
        table = {**dict.fromkeys(_SCALARS, self.scalar), **dict.fromkeys(_TEXT, self.text),
                 **dict.fromkeys(("EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_DICT", "EMPTY_SET"), self.empty),
                 **dict.fromkeys(("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "DICT", "FROZENSET"), self.collect),
                 **dict.fromkeys(("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"), self.add),
                 "MARK": self.mark, "POP": self.pop_op, "POP_MARK": self.pop_op,
                 **dict.fromkeys(("DUP", *_GETS), self.again), **dict.fromkeys((*_PUTS, "MEMOIZE"), self.put),
                 **dict.fromkeys(("GLOBAL", "STACK_GLOBAL", "EXT1", "EXT2", "EXT4"), self.global_op),
                 **dict.fromkeys(("REDUCE", "NEWOBJ", "NEWOBJ_EX", "INST", "OBJ"), self.call),
                 "BUILD": self.build, "PERSID": self.persid, "BINPERSID": self.persid,
                 **dict.fromkeys(("PROTO", "FRAME", "READONLY_BUFFER", "STOP"), self.nothing)}
        if self.allow is not None:
            for name in _STRICT_REFUSED:
                table[name] = _refuse_opcode
        return table


def _refuse_opcode(name: str, arg: Any) -> None:
    raise Refused(f"uses the opcode {name}, which is not allowed here")


def check_pickle(data: bytes, *, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_PICKLE_BYTES,
                 allow: AllowList | None = None) -> None:
    """Raise ``Refused`` unless ``data`` is a pickle within the bounds (and, with ``allow``, only what it admits);
    see the module's docstring. Nothing is unpickled and nothing is imported."""
    if len(data) > max_bytes:
        raise Refused(f"is a pickle of {len(data)} bytes, more than the {max_bytes} admitted")
    scan = _Scan(len(data), max_depth, allow)
    handlers = scan.handlers()
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name not in handlers:  # an opcode of a later protocol
                raise Refused(f"uses the opcode {name}, unknown to this scan")
            handlers[name](name, arg)
    except Refused:
        raise
    except Exception as err:  # noqa: BLE001 - genops' ValueError for bytes that are no pickle, and kin
        raise Refused(f"is not a pickle ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
                      corrupt=True) from None
    if len(scan.stack) != 1 or scan.marks:
        raise Refused("does not end with one value on its stack", corrupt=True)


# --- torch.save zips ------------------------------------------------------------------------------------
def torch_save_pickle(source: bytes | Any, max_bytes: int = MAX_PICKLE_BYTES) -> bytes:
    """The ``data.pkl`` of a ``torch.save`` zip (bytes, or a seekable binary file, left where it was), found by
    torch's own zip reader, the one ``torch.load`` uses (so both read the same member). Anything else (a bare
    pickle, torch's legacy format, junk) is ``Refused(corrupt=True)``: ringtrain writes zips only."""
    import torch

    file = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    start = file.tell()
    try:
        if file.read(4) != b"PK\x03\x04":
            raise Refused("is not a torch.save zip", corrupt=True)
        file.seek(start)
        reader = torch._C.PyTorchFileReader(file)
        if not reader.has_record("data.pkl"):
            raise Refused("is a zip without torch.save's data.pkl", corrupt=True)
        size = reader.get_record_size("data.pkl")  # as the zip declares it, before anything is inflated
        if size > max_bytes:
            raise Refused(f"holds a pickle of {size} bytes, more than the {max_bytes} admitted")
        return bytes(reader.get_record("data.pkl"))
    except Refused:
        raise
    except Exception as err:  # noqa: BLE001 - torch's reader raises RuntimeError for a damaged zip
        raise Refused(f"is not a readable torch.save zip ({type(err).__name__})", corrupt=True) from None
    finally:
        file.seek(start)


def check_torch_save(source: bytes | Any, *, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_PICKLE_BYTES) -> None:
    """``check_pickle`` on the pickle of a ``torch.save`` zip (``torch_save_pickle``), before ``torch.load``."""
    check_pickle(torch_save_pickle(source, max_bytes), max_depth=max_depth, max_bytes=max_bytes)


def load_weights_only(source: bytes | Any, map_location: Any = "cpu", *, max_depth: int = MAX_DEPTH,
                      max_bytes: int = MAX_PICKLE_BYTES) -> Any:
    """``torch.load(weights_only=True)`` of a ``torch.save`` zip (bytes or a seekable binary file), after
    ``check_torch_save``: ``Refused`` for what the bounds refuse, torch's own exceptions for the rest (an
    UnpicklingError for a global outside torch's weights-only set). torch's warning about foreign pickles is
    silenced: the caller's refusal says it in one line."""
    import warnings

    import torch

    check_torch_save(source, max_depth=max_depth, max_bytes=max_bytes)
    file = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(file, map_location=map_location, weights_only=True)


# --- JSON -----------------------------------------------------------------------------------------------
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def check_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ``Refused`` if the JSON text ``data`` nests more than ``max_depth`` arrays and objects (before
    ``json.loads``, which would recurse once per level). Strings are skipped; a text that is no JSON is left to
    ``json.loads`` to refuse."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= max_depth:  # cannot nest deeper than it opens: the common case, in C
        return
    depth = 0
    for token in _JSON_TOKENS.finditer(raw):
        found = token.group()
        if found in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                raise Refused(f"nests more than {max_depth} levels deep")
        elif found in (b"]", b"}"):
            depth -= 1
