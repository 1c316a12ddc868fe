"""The sandbox a chat template renders in, and what one rendering may spend and build.

A chat template comes with the model file, so it is untrusted code. It runs in Jinja2's
immutable sandbox with constant folding off (nothing of it runs at compile time), and every
place where it can spend time or build a value goes through a check:

- a deadline (``RENDER_TIMEOUT_S``), checked at every loop iteration, call, filter, operator,
  slice, written value and item of an iterator a filter returns;
- loop iterations (``MAX_LOOP_ITERATIONS``);
- one value: a string, or the text a container prints as, of at most ``MAX_CHARS``
  characters; a list, dict or iterator of at most ``MAX_ITEMS`` items;
- the whole rendering: ``MAX_CHARS`` characters written, ``MAX_BUILT`` built (an item of a
  container counts ``ITEM_CHARS``).

Whatever builds a large value from small arguments (``center``, ``format``, ``%``, ``*``,
``replace``, ``join``, ``indent``, ``wordwrap``, ``batch``, ``slice``, ``str.ljust``,
``int.to_bytes``, ``lipsum``...) is refused from its arguments, before the value exists;
the rest is checked after. So a hostile template costs about ``RENDER_TIMEOUT_S`` and a
bounded amount of memory at most.
"""
from __future__ import annotations

import contextvars
import itertools
import re
import string
import time
from collections.abc import Iterable, Iterator, Mapping, MappingView
from typing import Any, Callable

import jinja2
from jinja2 import nodes
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

RENDER_TIMEOUT_S = 1.0
MAX_LOOP_ITERATIONS = 200_000  # chat templates loop over messages and tools: thousands at most
MAX_CHARS = 8_000_000  # far above any prompt a context window holds
MAX_ITEMS = 100_000  # as many as jinja's range() gives
MAX_BUILT = 8 * MAX_CHARS  # the SmolLM2 template builds about 5 characters for each one it writes
ITEM_CHARS = 8  # an item of a container costs a pointer: counted as 8 characters
MAX_SLOW_TEXT = 100_000  # text for the filters that work through it in Python (wordwrap, urlize, title)
MAX_POWER_BITS = 1 << 16  # `**` and `*` results wider than this many bits are refused
MAX_TEMPLATE_CHARS = 100_000  # models ship templates of a few thousand characters; compiling takes ~10 us each

_TEXT = (str, bytes)
_SEQUENCES = (list, tuple, set, frozenset, MappingView)


class RenderLimitError(jinja2.TemplateError):
    """A template ran past one of the rendering limits."""


def _over(what: str, n: int, limit: int, unit: str = "characters") -> RenderLimitError:
    return RenderLimitError(f"{what} would make {n} {unit}, over the limit of {limit}")


# ---- sizes -----------------------------------------------------------------------------------
class _Shape:
    """What walking a value found: characters its text may take, values, nesting depth."""

    __slots__ = ("chars", "nodes", "depth")

    def __init__(self) -> None:
        self.chars = self.nodes = self.depth = 0


def _nested_text(s: str | bytes) -> int:
    # repr inside a container: quotes, and up to 10 characters for an unprintable one
    printable = s.isprintable() if isinstance(s, str) else s.isascii() and s.decode("ascii").isprintable()
    return len(s) + 3 if printable else 10 * len(s) + 3


def shape(value: Any, limit: int = MAX_CHARS) -> _Shape:
    """An upper estimate of the text ``value`` prints as (``str``, ``repr``, JSON), counting a
    value shared in several places each time; RenderLimitError past ``limit`` characters or
    ``MAX_ITEMS`` values, so the walk itself stays short."""
    found = _Shape()
    if isinstance(value, str):
        found.chars, found.nodes = len(value), 1
    else:
        _walk(value, limit, found)
    if found.chars > limit:
        raise _over("the text of a value", found.chars, limit)
    return found


def _walk(value: Any, limit: int, found: _Shape) -> None:
    stack = [(value, 1)]
    texts: dict[int, int] = {}  # id -> size of each string seen, so a string shared many times is read once
    while stack and found.chars <= limit:
        item, depth = stack.pop()
        found.nodes += 1
        found.depth = max(found.depth, depth)
        if found.nodes > MAX_ITEMS:
            raise RenderLimitError(f"a value of more than {MAX_ITEMS} items is over the limit")
        if isinstance(item, _TEXT):
            size = texts.get(id(item))
            found.chars += size if size is not None else texts.setdefault(id(item), _nested_text(item))
        elif isinstance(item, bool) or item is None:
            found.chars += 5
        elif isinstance(item, int):
            found.chars += item.bit_length() // 3 + 2
        elif isinstance(item, (Mapping, *_SEQUENCES)):
            mapping = isinstance(item, Mapping)
            found.chars += 2 + (4 if mapping else 2) * len(item)
            if found.nodes + len(stack) + (2 if mapping else 1) * len(item) > MAX_ITEMS:  # all to be visited
                raise RenderLimitError(f"a value of more than {MAX_ITEMS} items is over the limit")
            children = itertools.chain.from_iterable(item.items()) if mapping else item
            stack.extend((x, depth + 1) for x in children)
        elif isinstance(item, Namespace):
            stack.append((item._Namespace__attrs, depth + 1))  # noqa: SLF001 (what its repr prints)
        elif not isinstance(item, jinja2.Undefined):
            found.chars += 100  # numbers, macros, loops, generators: a short repr


def _units(value: Any) -> int:
    """What a value the template made costs of ``MAX_BUILT``; RenderLimitError when the value
    alone is over ``MAX_CHARS`` characters or ``MAX_ITEMS`` items."""
    if isinstance(value, _TEXT):
        if len(value) > MAX_CHARS:
            raise RenderLimitError(f"a value of {len(value)} characters is over the limit of {MAX_CHARS}")
        return len(value)
    if isinstance(value, (Mapping, *_SEQUENCES)):
        if len(value) > MAX_ITEMS:
            raise RenderLimitError(f"a value of {len(value)} items is over the limit of {MAX_ITEMS}")
        return len(value) * ITEM_CHARS
    return 0


# ---- the budget of one rendering ---------------------------------------------------------------
class Budget:
    """What one rendering may still spend: time, loop iterations, characters written and built."""

    __slots__ = ("deadline", "iterations", "written", "built")

    def __init__(self) -> None:
        self.deadline = time.monotonic() + RENDER_TIMEOUT_S
        self.iterations = self.written = self.built = 0

    def tick(self) -> None:
        """RenderLimitError once the deadline has passed."""
        if time.monotonic() > self.deadline:
            raise RenderLimitError(f"rendering took longer than {RENDER_TIMEOUT_S:g} s")

    def loop_step(self) -> None:
        """Count one loop iteration."""
        self.iterations += 1
        if self.iterations > MAX_LOOP_ITERATIONS:
            raise RenderLimitError(f"more than {MAX_LOOP_ITERATIONS} loop iterations")
        self.tick()

    def write(self, value: Any) -> Any:
        """Count ``value``, about to be written, toward the output's limit."""
        self.written += shape(value).chars
        if self.written > MAX_CHARS:
            raise RenderLimitError(f"the output is over the limit of {MAX_CHARS} characters")
        return value

    def admit(self, value: Any, inputs: tuple = ()) -> Any:
        """``value``, built by a call, filter or operator, checked and counted; one of its
        ``inputs`` passed through costs nothing."""
        if not any(value is x for x in inputs):
            self.built += _units(value)
            if self.built > MAX_BUILT:
                raise RenderLimitError(f"the values built are over the limit of {MAX_BUILT} characters")
        return value


_budget: contextvars.ContextVar[Budget] = contextvars.ContextVar("chat_template_budget")


def current_budget() -> Budget:
    """The budget of the rendering under way; outside one a fresh budget for each check
    (sizes still checked, time and loop iterations not counted)."""
    budget = _budget.get(None)
    return budget if budget is not None else Budget()


def start_budget() -> contextvars.Token:
    """Open a rendering's budget; pass the token to ``end_budget``."""
    return _budget.set(Budget())


def end_budget(token: contextvars.Token) -> None:
    """Close the rendering's budget opened by ``start_budget``."""
    _budget.reset(token)


# ---- guards the compiled template calls -----------------------------------------------------------
def _guard_loop(iterable: Iterable[Any]) -> Iterator[Any]:
    """Every ``{% for %}`` iterates through this: counts iterations, checks the deadline."""
    budget = current_budget()
    for item in iterable:
        budget.loop_step()
        yield item


def _guard_output(value: Any) -> Any:
    """Every value a template writes passes through this (captured ``{% set %}`` blocks too)."""
    return current_budget().write(value)


def _guard_concat(*parts: Any) -> str:
    """``a ~ b ~ c``: the parts' text, joined once its size is known to be within the limit."""
    total = sum(shape(p).chars for p in parts)
    if total > MAX_CHARS:
        raise _over("joining with ~", total, MAX_CHARS)
    return current_budget().admit("".join(map(str, parts)))


def _guard_items(items: Iterator[Any]) -> Iterator[Any]:
    """An iterator a filter returned (map, select, batch...): items counted, checked and timed."""
    budget = current_budget()
    for n, item in enumerate(items, 1):
        if n > MAX_ITEMS:
            raise RenderLimitError(f"an iterator of more than {MAX_ITEMS} items is over the limit")
        budget.tick()
        yield budget.admit(item)


def _guard_slice(value: Any, start: Any, stop: Any, step: Any) -> Any:
    """``value[start:stop:step]``, a copy: checked and counted."""
    return current_budget().admit(value[start:stop:step], (value,))


def _ticking(items: Iterable[Any]) -> Iterator[Any]:
    """``items`` read one by one, the deadline checked at each (a filter's loop over its input)."""
    budget = current_budget()
    for item in items:
        budget.tick()
        yield item


_GUARDS = frozenset(map(id, (_guard_loop, _guard_output, _guard_concat, _guard_slice)))  # by id: any callable


class InsertGuards(NodeTransformer):
    """Wraps each loop's iterable, each written value, each ``~`` concatenation and each slice
    (which Jinja compiles to plain Python) in a call to a guard; the guards are imported names,
    which a template cannot rebind."""

    @staticmethod
    def _wrap(guard: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
        callee = nodes.ImportedName(f"{__name__}.{guard}")
        return nodes.Call(callee, args, [], None, None).set_lineno(lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = self._wrap("_guard_loop", [node.iter], node.lineno)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        node.nodes = [self._wrap("_guard_output", [n], n.lineno) for n in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return self._wrap("_guard_concat", node.nodes, node.lineno)

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Expr:
        self.generic_visit(node)
        if not isinstance(node.arg, nodes.Slice):
            return node
        bounds = [nodes.Const(None) if n is None else n for n in (node.arg.start, node.arg.stop, node.arg.step)]
        return self._wrap("_guard_slice", [node.node, *bounds], node.lineno)


# ---- what an operation would build, from its arguments --------------------------------------------
def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _need(what: str, n: int, limit: int = MAX_CHARS, unit: str = "characters") -> None:
    if n > limit:
        raise _over(what, n, limit, unit)


def _takes(what: str, n: int, limit: int, unit: str = "characters") -> None:
    if n > limit:
        raise RenderLimitError(f"{what} takes at most {limit} {unit}, got {n}")


_PERCENT = re.compile(rb"%(?:\(([^)]*)\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def _percent_size(fmt: str | bytes, values: Any) -> int:
    """An upper estimate of the length of ``fmt % values``: the format's text, each field's
    width and precision, the text of each value it takes."""
    named = values if isinstance(values, Mapping) else None
    positional = iter(values if isinstance(values, tuple) else (values,))
    raw = fmt.encode("utf-8", "surrogatepass") if isinstance(fmt, str) else fmt
    total = len(fmt)
    for key, width, precision, kind in _PERCENT.findall(raw):
        if kind == b"%":
            continue
        for n in (width, precision):
            total += _int(next(positional, 0)) if n == b"*" else int(n or 0)
        value = named.get(key.decode("utf-8", "replace")) if named is not None and key else next(positional, None)
        total += shape(value).chars + 32  # a number's digits: ints are held within MAX_POWER_BITS
    return total


def _format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
    """An upper estimate of the length of ``fmt.format(*args, **kwargs)``: the format's text,
    each field's value (its root object's whole text) and each width or precision."""
    total, auto = len(fmt), 0
    numbers = sum(abs(_int(v)) for v in itertools.chain(args, kwargs.values()))
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None:
            continue
        root = re.split(r"[.\[]", field, maxsplit=1)[0]
        if root == "":
            root, auto = str(auto), auto + 1
        value = args[int(root)] if root.isdigit() and int(root) < len(args) else kwargs.get(root)
        total += shape(value).chars + 32
        total += numbers if "{" in (spec or "") else sum(int(n) for n in re.findall(r"\d+", spec or ""))
    return total


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse a repetition, concatenation, product, power or ``%`` format whose result would
    be over the limits, before it is computed."""
    sized = (*_TEXT, list, tuple)
    if operator == "*":
        seq, n = (left, right) if isinstance(left, sized) else (right, left)
        if isinstance(seq, sized) and isinstance(n, int):
            limit = MAX_CHARS if isinstance(seq, _TEXT) else MAX_ITEMS
            if len(seq) * n > limit:
                raise RenderLimitError(f"repeating {len(seq)} items {n} times is over the limit of {limit}")
        elif _int(left) and _int(right):
            _need("a product", left.bit_length() + right.bit_length(), MAX_POWER_BITS, "bits")
    elif operator == "+":
        if isinstance(left, sized) and isinstance(right, sized):
            limit = MAX_CHARS if isinstance(left, _TEXT) else MAX_ITEMS
            if len(left) + len(right) > limit:
                raise RenderLimitError(f"joining {len(left)} and {len(right)} items is over the limit of {limit}")
    elif operator == "**" and _int(left) and _int(right) and abs(left) > 1 and right > 0:
        if left.bit_length() * right > MAX_POWER_BITS:
            raise RenderLimitError(f"a power of about {left.bit_length() * right} bits is over the limit of "
                                   f"{MAX_POWER_BITS} bits")
    elif operator == "%" and isinstance(left, _TEXT):
        _need("formatting with %", _percent_size(left, right))


# ---- str and bytes methods -------------------------------------------------------------------------
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # where str.splitlines breaks


def _lines(text: str | bytes) -> int:
    """How many lines ``splitlines`` can give (bytes break at \\n and \\r only)."""
    breaks = _LINE_BREAKS if isinstance(text, str) else (b"\n", b"\r")
    return sum(text.count(c) for c in breaks) + 1


def _replace_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(text, _TEXT) and isinstance(old, type(text)) and isinstance(new, type(text))):
        return 0
    n = text.count(old) if old else len(text) + 1
    if _int(count, -1) >= 0:
        n = min(n, count)
    return len(text) + n * max(len(new) - len(old), 0)


def _join_size(sep: Any, items: list) -> int:
    return sum(shape(x).chars for x in items) + max(len(items) - 1, 0) * shape(sep).chars


def _listed(iterable: Any) -> list:
    """``iterable`` as a list of at most ``MAX_ITEMS`` items, read no further than that."""
    items = list(itertools.islice(iterable, MAX_ITEMS + 1))
    if len(items) > MAX_ITEMS:
        raise RenderLimitError(f"a value of more than {MAX_ITEMS} items is over the limit")
    return items


def _pieces(text: str | bytes, sep: Any, most: int) -> int:
    """How many pieces ``text.split(sep, most)`` gives, up to MAX_ITEMS + 1 (no more are built)."""
    cap = MAX_ITEMS if most < 0 else min(most, MAX_ITEMS)
    if sep is None:
        return len(text.split(None, cap))
    return min(text.count(sep), cap) + 1 if isinstance(sep, type(text)) and sep else 1


def _text_method(method: Callable, text: str | bytes, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Refuse a str or bytes method call that would build too much; the arguments to call
    it with (an iterable to join read into a list first)."""
    name = f"the method {type(text).__name__}.{method.__name__}"
    first = args[0] if args else None
    if method.__name__ in ("center", "ljust", "rjust", "zfill"):
        _need(name, max(len(text), _int(first)))
    elif method.__name__ == "expandtabs":
        tab = _int(args[0] if args else kwargs.get("tabsize", 8))
        _need(name, len(text) + text.count("\t" if isinstance(text, str) else b"\t") * max(tab, 0))
    elif method.__name__ == "replace" and len(args) >= 2:
        _need(name, _replace_size(text, *args[:3]))
    elif method.__name__ == "join" and isinstance(first, Iterable):
        items = _listed(first)
        _need(name, _join_size(text, items))
        args = (items,)
    elif method.__name__ == "translate" and isinstance(first, (Mapping, list, tuple)):
        values = first.values() if isinstance(first, Mapping) else first
        widest = max((len(v) for v in itertools.islice(values, MAX_ITEMS) if isinstance(v, _TEXT)), default=1)
        _need(name, len(text) * widest)
    elif method.__name__ in ("split", "rsplit"):
        sep = args[0] if args else kwargs.get("sep")
        most = _int(args[1] if len(args) > 1 else kwargs.get("maxsplit", -1), -1)
        if _pieces(text, sep, most) > MAX_ITEMS:
            raise RenderLimitError(f"{name} would make more than {MAX_ITEMS} items, over the limit")
    elif method.__name__ == "splitlines":
        _need(name, _lines(text), MAX_ITEMS, "items")
    for value in itertools.chain(args, kwargs.values()):
        shape(value)
    return args, kwargs


def _check_call(obj: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Refuse a call that would build too much from its arguments; the arguments to call it with."""
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, _TEXT) and callable(obj):
        return _text_method(obj, owner, args, kwargs)
    if isinstance(owner, type) and issubclass(owner, str):  # Markup.escape(x) prints x
        for value in itertools.chain(args, kwargs.values()):
            shape(value)
    elif isinstance(owner, int) and getattr(obj, "__name__", "") == "to_bytes":
        _need("the method int.to_bytes", _int(args[0] if args else kwargs.get("length", 1)))
    elif obj is generate_lorem_ipsum:
        paragraphs = _int(args[0] if args else kwargs.get("n", 5))
        _need("lipsum", paragraphs * _int(args[3] if len(args) > 3 else kwargs.get("max", 100)), MAX_ITEMS, "words")
    return args, kwargs


# ---- filters ------------------------------------------------------------------------------------
# Each estimate takes the environment, then the filter's own arguments; it returns how many
# characters the filter may build, or raises when its arguments alone are over a limit.
def _center(env: Any, value: Any, width: Any = 80) -> int:
    return max(shape(value).chars, _int(width))


def _format(env: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    shape(value)
    return _percent_size(str(value), kwargs or args)


def _indent(env: Any, s: Any, width: Any = 4, first: Any = False, blank: Any = False) -> int:
    text = shape(s).chars
    indention = len(width) if isinstance(width, str) else _int(width)
    lines = _lines(s) if isinstance(s, str) else 1
    _takes("the filter indent", lines, MAX_ITEMS, "lines")
    return text + (lines + 1) * (indention + 1)


def _replace(env: Any, s: Any, old: Any, new: Any, count: Any = None) -> int:
    shape(s), shape(old), shape(new)
    return _replace_size(str(s), str(old), str(new), -1 if count is None else count)


def _join(env: Any, value: Any, d: Any = "", attribute: Any = None) -> int:
    items = value if attribute is None else list(map(make_attrgetter(env, attribute), value))
    return _join_size(d, items)


def _wordwrap(env: Any, s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
              break_on_hyphens: Any = True) -> int:
    text = shape(s).chars
    _takes("the filter wordwrap", text, MAX_SLOW_TEXT)
    return text + (text + 1) * shape(wrapstring or "\n").chars


def _slow_text(name: str) -> Callable[..., int]:
    def estimate(env: Any, s: Any, *args: Any, **kwargs: Any) -> int:
        _takes(f"the filter {name}", shape(s).chars, MAX_SLOW_TEXT)
        return 0

    return estimate


def _truncate(env: Any, s: Any, length: Any = 255, killwords: Any = False, end: Any = "...",
              leeway: Any = None) -> int:
    return shape(s).chars + shape(end).chars


def _batch(env: Any, value: Any, linecount: Any, fill_with: Any = None) -> int:
    _need("the filter batch", _int(linecount) if fill_with is not None else 0, MAX_ITEMS, "items")
    return 0


def _slice(env: Any, value: Any, slices: Any, fill_with: Any = None) -> int:
    _need("the filter slice", _int(slices), MAX_ITEMS, "items")
    return 0


def _sum(env: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> int:
    # adding up lists or strings copies the running total at each step
    if not isinstance(start, (int, float)) and hasattr(iterable, "__len__"):
        _need("the filter sum", len(iterable) * shape(iterable).nodes, MAX_BUILT, "steps")
    return 0


def _tojson(env: Any, value: Any, ensure_ascii: Any = False, indent: Any = None, separators: Any = None,
            sort_keys: Any = False) -> int:
    found = shape(value)
    step = len(indent) if isinstance(indent, str) else _int(indent)
    seps = sum(shape(s).chars for s in separators) if isinstance(separators, (list, tuple)) else 2
    return found.chars * (6 if ensure_ascii else 1) + found.nodes * (seps + 1 + found.depth * step)


def _pprint(env: Any, value: Any) -> int:
    found = shape(value)
    return found.chars + found.nodes * (found.depth + 1)


def _whole_text(env: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    # a case-insensitive sort lower-cases every string of every item: each occurrence counts
    return shape(value).chars


# filter -> its estimate
FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": _center, "format": _format, "indent": _indent, "replace": _replace, "join": _join,
    "wordwrap": _wordwrap, "urlize": _slow_text("urlize"), "title": _slow_text("title"), "truncate": _truncate,
    "batch": _batch, "slice": _slice, "sum": _sum, "tojson": _tojson, "pprint": _pprint,
    **dict.fromkeys(("sort", "unique", "min", "max", "groupby", "dictsort"), _whole_text),
    # filters that read their input as text, str(value)
    **dict.fromkeys(("capitalize", "e", "escape", "forceescape", "lower", "safe", "string", "striptags",
                     "trim", "upper", "urlencode", "wordcount", "xmlattr"), _whole_text),
}
# filters that go through their input item by item (the first three: a mapping's items)
ITEM_FILTERS = frozenset((
    "dictsort", "items", "xmlattr", "batch", "groupby", "join", "list", "map", "max", "min", "reject",
    "rejectattr", "select", "selectattr", "slice", "sum", "sort", "unique",
))
_MAPPING_FILTERS = frozenset(("dictsort", "items", "xmlattr"))


def _items_input(name: str, value: Any) -> tuple[Any, Any]:
    """(the input to size, the input to pass) of item filter ``name``: an iterator read into a
    list of at most MAX_ITEMS items; a sequence read one item at a time, each a deadline check
    (a test or key run on each item is not checked otherwise)."""
    if isinstance(value, Iterator):
        value = _listed(value)
    elif isinstance(value, (*_TEXT, Mapping, *_SEQUENCES, range)):
        _takes(f"the filter {name}", len(value), MAX_ITEMS, "items")
    else:
        return value, value
    # an empty input stays as it is: some filters check their arguments only when there are items
    return value, (_ticking(value) if name not in _MAPPING_FILTERS and len(value) else value)


def guard_filter(env: jinja2.Environment, name: str, func: Callable) -> Callable:
    """``func``, the filter ``name`` of ``env``, with the limits checked before and after each call."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # jinja passes a context first
    size = FILTER_SIZES.get(name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.tick()
        call_args = args
        if name in ITEM_FILTERS and len(args) > skip:
            value, passed = _items_input(name, args[skip])
            args, call_args = ((*args[:skip], v, *args[skip + 1:]) for v in (value, passed))
        if size is not None:
            _need(f"the filter {name}", size(env, *args[skip:], **kwargs))
        result = func(*call_args, **kwargs)
        if isinstance(result, Iterator):
            return _guard_items(result)
        return budget.admit(result, args)

    guarded.__dict__.update(getattr(func, "__dict__", {}))  # jinja_pass_arg
    guarded.__name__ = guarded.__qualname__ = name
    guarded.__doc__ = func.__doc__
    return guarded


# ---- the environment ------------------------------------------------------------------------
class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every filter guarded and the limits checked in its call,
    operator and ``str.format`` hooks (``InsertGuards`` adds the rest to a template). Build it
    with ``optimized=False``: Jinja's optimizer would run filters and operators on constants at
    compile time, unchecked."""

    intercepted_binops = frozenset(("*", "**", "+", "%"))

    def guard_filters(self) -> None:
        """Wrap every filter (call this once the filters are all set)."""
        self.filters = {name: guard_filter(self, name, f) for name, f in self.filters.items()}

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = current_budget()
        budget.tick()
        if id(__obj) in _GUARDS:
            return __context.call(__obj, *args, **kwargs)
        args, kwargs = _check_call(__obj, args, kwargs)
        return budget.admit(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current_budget()
        budget.tick()
        _check_binop(operator, left, right)
        return budget.admit(super().call_binop(context, operator, left, right), (left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            current_budget().tick()
            named = args[0] if is_map and len(args) == 1 and isinstance(args[0], Mapping) else kwargs
            try:
                size = _format_size(fmt, () if is_map else args, named)
            except ValueError:  # a malformed format: the call itself says so
                size = 0
            _need(f"the method str.{value.__name__}", size)
            return wrapped(*args, **kwargs)

        return bounded
