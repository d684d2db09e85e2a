"""Readable names and reference paths for objects found in cyclic garbage.

Everything here looks at objects the program has already dropped, so nothing in it may run
user code: no ``repr()``, no ``getattr`` through a class's ``__getattr__`` / properties, no
``isinstance`` (it can consult ``__class__``). Attribute values are read through the C-level
descriptors of builtin types (``types.FunctionType.__dict__[...]``), or through the
``__dict__`` / slot descriptors found on the type's MRO when they are builtin descriptors.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

__all__ = ["cycle_path", "edge_label", "object_name", "type_name"]

_GETSET = types.GetSetDescriptorType
_MEMBER = types.MemberDescriptorType
_ATOMS = (str, int, float, bytes, bool, type(None))
_DICT_ITEMS = dict.items

# Builtin containers that are plumbing rather than the thing a user thinks about: a path
# elides them when the edge into them already names them (``Foo.__dict__['x']``).
_FUNCTION_ATTRS = ("__globals__", "__defaults__", "__kwdefaults__", "__dict__", "__code__")


def type_name(tp: type) -> str:
    """``module.QualName`` of a type, without ``builtins.``."""
    qual = type.__dict__["__qualname__"].__get__(tp)
    mod = type.__dict__["__module__"].__get__(tp)
    if not isinstance(mod, str) or mod == "builtins":
        return str(qual)
    return f"{mod}.{qual}"


def _short_type(tp: type) -> str:
    return str(type.__dict__["__qualname__"].__get__(tp))


def _type_lookup(tp: type, name: str) -> Any:
    """``name`` from the MRO's class dicts (no metaclass ``__getattribute__``)."""
    for klass in type.__dict__["__mro__"].__get__(tp):
        d = type.__dict__["__dict__"].__get__(klass)
        if name in d:
            return d[name]
    return None


def instance_dict(obj: Any) -> Optional[dict[str, Any]]:
    """The instance ``__dict__`` through the builtin descriptor, or None."""
    desc = _type_lookup(type(obj), "__dict__")
    if type(desc) is not _GETSET:
        return None
    try:
        d = desc.__get__(obj)
    except Exception:  # a broken descriptor on an extension type
        return None
    return d if type(d) is dict else None


def _slots(obj: Any) -> list[tuple[str, Any]]:
    out = []
    for klass in type.__dict__["__mro__"].__get__(type(obj)):
        for name, desc in type.__dict__["__dict__"].__get__(klass).items():
            if type(desc) is _MEMBER:
                try:
                    out.append((name, desc.__get__(obj)))
                except AttributeError:  # unset slot
                    pass
    return out


def _key_text(key: Any) -> str:
    if type(key) in _ATOMS:
        text = repr(key)
        return text if len(text) <= 60 else text[:57] + "..."
    return f"<{_short_type(type(key))}>"


def object_name(obj: Any) -> str:
    """A short, safe description: the type, plus the qualname of functions/generators."""
    tp = type(obj)
    if tp is types.FunctionType:
        return f"function {types.FunctionType.__dict__['__qualname__'].__get__(obj)}"
    if tp in (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType):
        return f"{_short_type(tp)} {tp.__dict__['__qualname__'].__get__(obj)}"
    if tp is types.FrameType:
        return f"frame {obj.f_code.co_name}"
    if tp is types.ModuleType:
        return f"module {_attr_of(types.ModuleType, '__dict__')(obj).get('__name__')}"
    if issubclass(tp, type):
        return f"class {_short_type(obj)}"
    return _short_type(tp)


def _frame_locals(frame: types.FrameType) -> dict[str, Any]:
    try:
        return dict(frame.f_locals)
    except Exception:
        return {}


def _find_in_frame(frame: Optional[types.FrameType], child: Any, prefix: str) -> Optional[str]:
    if frame is None:
        return None
    for k, v in _frame_locals(frame).items():
        if v is child:
            return f"{prefix}f_locals[{k!r}]"
    for attr in ("f_back", "f_code", "f_globals", "f_builtins"):
        if getattr(frame, attr, None) is child:
            return f"{prefix}{attr}"
    return None


def _attr_of(desc_owner: type, name: str) -> Callable[[Any], Any]:
    desc = desc_owner.__dict__[name]
    return desc.__get__  # type: ignore[no-any-return]


def edge_label(parent: Any, child: Any) -> tuple[str, bool]:
    """How ``parent`` refers to ``child``: (label, elide_child).

    ``elide_child`` is True when ``child`` is plumbing whose identity the label already
    gives (an instance ``__dict__``, a closure tuple or cell), so the path does not name it.
    """
    tp = type(parent)
    if issubclass(tp, dict):
        for k, v in _DICT_ITEMS(parent):
            if v is child:
                return f"[{_key_text(k)}]", False
            if k is child:
                return " (a key)", False
        return "", False
    if issubclass(tp, (list, tuple)):
        items = list.__iter__(parent) if issubclass(tp, list) else tuple.__iter__(parent)
        for i, v in enumerate(items):
            if v is child:
                elide = tp is tuple and type(child) is types.CellType
                return f"[{i}]", elide
        return "", False
    if issubclass(tp, (set, frozenset)):
        return " (a member)", False
    if tp is types.MethodType:
        if _attr_of(types.MethodType, "__self__")(parent) is child:
            return "", False
        return ".__func__", False
    if tp is types.CellType:
        return "", False
    if tp is types.FunctionType:
        closure = _attr_of(types.FunctionType, "__closure__")(parent)
        if closure is child:
            return ".__closure__", True
        for attr in _FUNCTION_ATTRS:
            if _attr_of(types.FunctionType, attr)(parent) is child:
                return f".{attr}", attr == "__dict__"
        return "", False
    if tp is types.FrameType:
        return _find_in_frame(parent, child, ".") or "", False
    if tp is types.TracebackType:
        for attr in ("tb_frame", "tb_next"):
            if getattr(parent, attr) is child:
                return f".{attr}", False
        return "", False
    if tp in (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType):
        pre = {types.GeneratorType: "gi", types.CoroutineType: "cr"}.get(tp, "ag")
        frame = tp.__dict__[f"{pre}_frame"].__get__(parent)
        return _find_in_frame(frame, child, f".{pre}_frame.") or "", False
    if issubclass(tp, BaseException):
        for attr in ("__traceback__", "__context__", "__cause__", "args"):
            if BaseException.__dict__[attr].__get__(parent) is child:
                return f".{attr}", False
    d = instance_dict(parent)
    if d is not None:
        if d is child:
            return ".__dict__", True
        for k, v in _DICT_ITEMS(d):
            if v is child:
                return f".__dict__[{_key_text(k)}]", False
    for name, v in _slots(parent):
        if v is child:
            return f".{name}", False
    if issubclass(tp, type):
        d = type.__dict__["__dict__"].__get__(parent)
        for k, v in d.items():
            if v is child:
                return f".__dict__[{_key_text(k)}]", False
    return "", False


def cycle_path(members: list[Any]) -> str:
    """Render ``members`` (a closed walk: the first object again at the end) as one line."""
    if len(members) < 2:
        return object_name(members[0]) if members else ""
    out = [object_name(members[0])]
    for i in range(len(members) - 1):
        parent, child = members[i], members[i + 1]
        try:
            label, elide = edge_label(parent, child)
        except Exception:  # an exotic object: say less rather than fail the report
            label, elide = "", False
        out.append(label)
        last = i == len(members) - 2
        if not (elide and not last):
            out.append(" -> " + object_name(child))
    return "".join(out)
