"""Refuse a torch.export program (a model.pt2's models/<name>.json) whose strings torch would run or resolve.

``torch.export.load`` reads the program JSON and turns some of its strings into code or objects:

* every ``expr_str`` (tensor sizes, strides, symbolic ints/floats/bools) goes to ``sympy.sympify``, which
  *evaluates the string as Python*;
* every node ``target`` (and an ``as_operator`` argument, and the ``source_fn_stack`` metadata) is resolved by
  ``getattr`` from ``torch``, ``operator`` or ``math``, or looked up in the extension registry (``#ns:op``);
* ``guards_code`` is compiled into a Python function when ``ExportedProgram.module()`` is called with guards;
* node, input and output names become identifiers in the Python source FX generates for the graph, and
  parameter / buffer names attribute paths in it.

So before the backend calls ``torch.export.load``, every string of the program is checked here against what
the torch programs this project builds contain: expressions against a strict grammar (sympy's ``srepr`` form
of symbols, integers, ``Add``/``Mul``/``Pow`` with small integer exponents, ``FloorDiv``/``Mod``, ``Max``/``Min``
and the relations of a symbolic bool), targets against an allow-list of ``torch.ops`` overloads (the aten ops
the capture emits and the project's own ``optimize::`` ops) plus the symbolic-int operators, guards against a
grammar of size comparisons, names against identifier patterns, and every other string field against a list
of the fields that only carry text. Anything else is refused, naming the file, the node and the string. The
grammars are checked on the parse tree (``ast``), after a character filter that keeps quotes, dots,
backslashes, comments and line breaks out of expressions, so a string that passes is exactly the tree that
was checked. Standard library only: nothing here imports torch or sympy.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from typing import Any

from runtime.artifact import ArtifactError

__all__ = ["ALLOWED_TARGETS", "check_program"]

# ---- node targets --------------------------------------------------------------------------------------------

# Exactly the aten overloads in the programs `capture` and `lower_quant_torch` emit for every supported family
# (Llama, Mistral with and without a sliding window, Qwen2 (+ YaRN), Qwen3, Granite, OLMo 2, Gemma 2/3, Phi-3
# LongRoPE, Mixtral, Qwen2-MoE, Qwen3-MoE; FP8 and INT4 lowering; the Triton and FlashInfer attention variants;
# torch 2.13). A new one fails the load naming it: add it here once it is known to be a tensor op (no file,
# process or Python access; aten.from_file, for one, reads a file).
_ATEN = frozenset({
    "__and__.Tensor", "_assert_scalar.default", "_assert_tensor_metadata.default", "add.Tensor",
    "arange.default", "cat.default", "clamp.default", "cos.default", "div.Tensor", "embedding.default",
    "eq.Scalar", "eq.Tensor", "expand.default", "floor_divide.default", "full.default", "ge.Tensor",
    "gelu.default", "gt.Tensor", "index.Tensor", "index_copy.default", "index_select.default", "le.Tensor",
    "linear.default", "lt.Tensor", "matmul.default", "mean.dim", "mul.Tensor", "neg.default",
    "nonzero.default", "permute.default", "pow.Tensor_Scalar", "remainder.Scalar", "reshape.default",
    "rsqrt.default", "sigmoid.default", "silu.default", "sin.default", "slice.Tensor", "softmax.int",
    "squeeze.dim", "sub.Tensor", "sum.dim_IntList", "sym_size.int", "tanh.default", "to.dtype",
    "topk.default", "transpose.int", "unsqueeze.default", "view.default", "where.self", "zeros.default",
})
# the project's own ops: runtime/backends/torch_ops.py registers them before a program loads
_OPTIMIZE = frozenset({"fp8_linear.default", "int4_linear.default", "paged_attention_triton.default",
                       "paged_attention_flashinfer.default"})
# the symbolic-int operators torch.export writes for size arithmetic (torch's own verifier allows these too)
_SYMBOLIC = frozenset({f"_operator.{n}" for n in ("getitem", "add", "sub", "mul", "floordiv", "mod", "neg", "eq",
                                                  "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_")}
                      | {"torch.sym_max", "torch.sym_min", "torch.sym_not", "torch.sym_int", "torch.sym_ite",
                         "torch.sym_sum", "math.trunc", "math.floor", "math.ceil"})
ALLOWED_TARGETS = frozenset({f"torch.ops.aten.{o}" for o in _ATEN} | {f"torch.ops.optimize.{o}" for o in _OPTIMIZE}
                            | _SYMBOLIC)

# ---- names ---------------------------------------------------------------------------------------------------

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_DOTTED = re.compile(r"[A-Za-z0-9_]{1,200}(\.[A-Za-z0-9_]{1,200}){0,63}")
_SYMBOL = re.compile(r"[a-z]{1,8}[0-9]{1,9}")  # s0, u3, ...: the names torch gives size symbols
_VERSION = re.compile(r"[0-9A-Za-z.+_-]{1,64}")

# ---- expressions (sympy's srepr, what torch writes and sympify evaluates) -----------------------------------------

_EXPR_CHARS = re.compile(r"[A-Za-z0-9_(), '=+-]{1,4000}")
_EXPR_FUNCS = frozenset({
    "Add", "Mul", "Pow", "Max", "Min", "Mod", "FloorDiv", "PythonMod", "CleanDiv", "CeilDiv", "FloorToInt",
    "CeilToInt", "TruncToInt", "IntTrueDiv", "ModularIndexing", "Equality", "Unequality", "StrictLessThan",
    "LessThan", "StrictGreaterThan", "GreaterThan", "And", "Or", "Not",
})
_EXPR_ATOMS = frozenset({"true", "false", "oo", "int_oo"})
_ASSUMPTIONS = frozenset({"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
                          "zero", "nonzero", "even", "odd"})
_MAX_INT = 1 << 64
_MAX_DEPTH = 32
_MAX_EXPONENT = 64

# ---- guards (Python source that ExportedProgram.module() compiles) ---------------------------------------------

_GUARD_CHARS = re.compile(r"[A-Za-z0-9_()\[\]'. +*/%<>=!,-]{1,4000}")
_GUARD_CMP = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_GUARD_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)

# ---- string fields that only carry text (the deserializer keeps them as strings) ------------------------------

_TEXT_METADATA = frozenset({"stack_trace", "nn_module_stack", "torch_fn"})
_TREESPEC_TYPES = frozenset({None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"})
_DEVICES = frozenset({"cpu", "cuda", "meta"})
_VERIFIERS = frozenset({"TRAINING", "ATEN"})
_SPECIAL_FLOATS = frozenset({"Infinity", "-Infinity", "NaN"})
_IDENT_FIELDS = frozenset({"name", "as_name", "arg_name"})
_DOTTED_FIELDS = frozenset({"parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name",
                            "user_input_name"})
_IDENT_KEYED = frozenset({"tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values",
                          "custom_obj_values"})


class _Refused(Exception):
    """What is wrong with one string (the caller adds where it is)."""


def _int_literal(node: ast.AST) -> int:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int_literal(node.operand)
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value < _MAX_INT:
        return node.value
    raise _Refused("expected an integer literal below 2**64")


def _expr(node: ast.AST, depth: int = 0) -> None:
    if depth > _MAX_DEPTH:
        raise _Refused(f"nested deeper than {_MAX_DEPTH}")
    if isinstance(node, ast.Name) and node.id in _EXPR_ATOMS:
        return
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise _Refused(f"{type(node).__name__} is not a sympy constructor call")
    fn, args, kw = node.func.id, node.args, node.keywords
    if fn == "Integer":
        if len(args) != 1 or kw:
            raise _Refused("Integer takes one integer literal")
        _int_literal(args[0])
    elif fn == "Rational":
        if len(args) != 2 or kw:
            raise _Refused("Rational takes two integer literals")
        _int_literal(args[0])
        _int_literal(args[1])
    elif fn == "Symbol":
        if len(args) != 1 or not isinstance(args[0], ast.Constant) or not isinstance(args[0].value, str) \
                or not _SYMBOL.fullmatch(args[0].value):
            raise _Refused("Symbol takes one size-symbol name (s0, u1, ...)")
        for k in kw:
            if k.arg not in _ASSUMPTIONS or not (isinstance(k.value, ast.Constant) and type(k.value.value) is bool):
                raise _Refused(f"Symbol assumption {k.arg}= is not one of {sorted(_ASSUMPTIONS)} with True/False")
    elif fn in _EXPR_FUNCS:
        if kw or not args:
            raise _Refused(f"{fn} takes positional sympy arguments only")
        if fn == "Pow":
            if len(args) != 2:
                raise _Refused("Pow takes two arguments")
            exp = args[1]
            if not (isinstance(exp, ast.Call) and isinstance(exp.func, ast.Name) and exp.func.id == "Integer"
                    and len(exp.args) == 1 and abs(_int_literal(exp.args[0])) <= _MAX_EXPONENT):
                raise _Refused(f"Pow takes an integer exponent of at most {_MAX_EXPONENT} in magnitude")
            base = args[0]
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id in ("Integer",
                                                                                                 "Rational"):
                raise _Refused("Pow of a number literal (torch folds those)")
        for a in args:
            _expr(a, depth + 1)
    else:
        raise _Refused(f"{fn} is not one of the functions torch writes in shape expressions")


def check_expression(text: Any) -> None:
    """Raise _Refused unless `text` is a shape expression in the grammar above."""
    if not isinstance(text, str) or not _EXPR_CHARS.fullmatch(text):
        raise _Refused("characters outside the expression grammar (letters, digits, _ ( ) , ' = + - space)")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise _Refused(f"not an expression ({exc.msg})") from None
    _expr(tree.body)


def _guard_ref(node: ast.AST) -> None:
    """L['name'] or a subscript of one (L['kv_cache'][3])."""
    if not isinstance(node, ast.Subscript) or not isinstance(node.slice, ast.Constant):
        raise _Refused("expected an input reference L['name'][...]")
    key = node.slice.value
    if isinstance(node.value, ast.Name) and node.value.id == "L":
        if not (isinstance(key, str) and _IDENT.fullmatch(key)):
            raise _Refused("L[...] takes an input name")
        return
    if not ((isinstance(key, str) and _IDENT.fullmatch(key)) or (type(key) is int and 0 <= key < _MAX_INT)):
        raise _Refused("a reference's index is an integer or a name")
    _guard_ref(node.value)


def _guard_value(node: ast.AST, depth: int = 0) -> None:
    if depth > _MAX_DEPTH:
        raise _Refused(f"nested deeper than {_MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < _MAX_INT:
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _guard_value(node.operand, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _GUARD_ARITH):
        _guard_value(node.left, depth + 1)
        return _guard_value(node.right, depth + 1)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min") \
            and len(node.args) >= 2 and not node.keywords:
        for a in node.args:
            _guard_value(a, depth + 1)
        return
    # L['x'].size()[0], L['x'].stride()[1], L['x'].storage_offset()
    call = node.value if isinstance(node, ast.Subscript) else node
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and not call.args and not call.keywords:
        method = call.func.attr
        if isinstance(node, ast.Subscript) and method in ("size", "stride") and isinstance(node.slice, ast.Constant) \
                and type(node.slice.value) is int and 0 <= node.slice.value < 64:
            return _guard_ref(call.func.value)
        if node is call and method == "storage_offset":
            return _guard_ref(call.func.value)
    raise _Refused(f"{type(node).__name__} is not a size, an integer or arithmetic on them")


def _guard(node: ast.AST, depth: int = 0) -> None:
    if depth > _MAX_DEPTH:
        raise _Refused(f"nested deeper than {_MAX_DEPTH}")
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _guard(v, depth + 1)
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _guard(node.operand, depth + 1)
    if isinstance(node, ast.Compare) and all(isinstance(op, _GUARD_CMP) for op in node.ops):
        for v in (node.left, *node.comparators):
            _guard_value(v, depth + 1)
        return
    raise _Refused(f"{type(node).__name__} is not a comparison of sizes")


def check_guard(text: Any) -> None:
    """Raise _Refused unless `text` is a guard in the grammar above (comparisons of input sizes)."""
    if not isinstance(text, str) or not _GUARD_CHARS.fullmatch(text):
        raise _Refused("characters outside the guard grammar")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise _Refused(f"not an expression ({exc.msg})") from None
    _guard(tree.body)


def _treespec(text: Any) -> None:
    """A pytree spec (JSON): only the builtin container types (resolved by torch from its registry)."""
    try:
        spec = json.loads(text)
    except (TypeError, ValueError):
        raise _Refused("not a JSON pytree spec") from None
    stack = [spec]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            if "type" in obj and obj["type"] not in _TREESPEC_TYPES:
                raise _Refused(f"pytree type {obj['type']!r} is not one of {sorted(map(str, _TREESPEC_TYPES))}")
            if isinstance(obj.get("context"), str):
                try:
                    stack.append(json.loads(obj["context"]))
                except ValueError:
                    raise _Refused("a pytree context is not JSON") from None
            stack.extend(v for k, v in obj.items() if k != "context")
        elif isinstance(obj, list):
            stack.extend(obj)


def _text(value: Any) -> None:
    """Free text torch keeps as a string: printable, lines separated by \\n only."""
    if not isinstance(value, str) or len(value) > 100_000 or not value.replace("\n", "").isprintable():
        raise _Refused("text with control characters (or longer than 100,000 characters)")


def _match(pattern: re.Pattern[str], what: str) -> Any:
    def check(value: Any) -> None:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise _Refused(f"not {what}")
    return check


def _one_of(allowed: frozenset[Any], what: str) -> Any:
    def check(value: Any) -> None:
        if value not in allowed:
            raise _Refused(f"not {what} ({', '.join(sorted(map(str, allowed)))})")
    return check


def _target(value: Any) -> None:
    if value not in ALLOWED_TARGETS:
        raise _Refused("not an allowed operator: the torch.ops.aten overloads the capture emits, the project's "
                       "optimize:: ops and the symbolic-int operators (runtime/pt2_program.py ALLOWED_TARGETS)")


def _printable(value: Any) -> None:
    if not isinstance(value, str) or len(value) > 1000 or not value.isprintable():
        raise _Refused("a string argument with control characters (or longer than 1,000 characters)")


def _range_key(value: Any) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"[a-z0-9_ +*()-]{1,400}", value):
        raise _Refused("not a size-symbol expression")


_FIELDS: dict[str, Any] = {
    "expr_str": check_expression,
    "target": _target,
    "as_operator": _target,
    "guards_code": check_guard,
    "in_spec": _treespec,
    "out_spec": _treespec,
    "fqn": lambda v: None if v == "" else _match(_DOTTED, "a module path")(v),
    "forward_arg_names": _match(_IDENT, "an identifier"),
    "as_string": _printable,
    "as_strings": _printable,
    "as_float": _one_of(_SPECIAL_FLOATS, "a special float"),
    "as_floats": _one_of(_SPECIAL_FLOATS, "a special float"),
    "torch_version": _match(_VERSION, "a version"),
    "verifiers": _one_of(_VERIFIERS, "a verifier dialect"),
    "field_names": _match(_IDENT, "an identifier"),
    **{k: _match(_IDENT, "an identifier") for k in _IDENT_FIELDS},
    **{k: _match(_DOTTED, "a dotted name") for k in _DOTTED_FIELDS},
    **{k: _text for k in _TEXT_METADATA},
}


def _strings(program: Any) -> Iterator[tuple[tuple[Any, ...], Any, bool]]:
    """(path, value, is_key) for every string in `program`, and for the keys of the dicts keyed by data."""
    keyed = _IDENT_KEYED | {"range_constraints", "opset_version", "treespec_namedtuple_fields"}
    stack: list[tuple[Any, tuple[Any, ...]]] = [(program, ())]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, str):
            yield path, obj, False
        elif isinstance(obj, dict):
            by_data = bool(path) and path[-1] in keyed
            for k, v in obj.items():
                if by_data:
                    yield path, k, True
                if isinstance(v, (str, dict, list)):
                    stack.append((v, (*path, k)))
        elif isinstance(obj, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(obj) if isinstance(v, (str, dict, list)))


def _field(path: tuple[Any, ...]) -> str:
    """The name of the field a value sits in (list indices skipped)."""
    for p in reversed(path):
        if isinstance(p, str):
            return p
    return ""


def _where(program: dict[str, Any], path: tuple[Any, ...]) -> str:
    """'node NAME' when the path is inside a graph node (or a tensor's entry), and the JSON path."""
    node = ""
    obj: Any = program
    for i, p in enumerate(path):
        try:
            obj = obj[p]
        except (KeyError, IndexError, TypeError):
            break
        if i >= 1 and path[i - 1] == "nodes" and isinstance(obj, dict):
            node = obj.get("name") or next((o.get("as_tensor", {}).get("name") for o in obj.get("outputs", [])
                                            if isinstance(o, dict) and "as_tensor" in o), "") or f"#{p}"
        elif i >= 1 and path[i - 1] in _IDENT_KEYED:
            node = str(p)
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return (f"node {node!r}, " if node else "") + text


def check_program(program: Any, where: str) -> None:
    """Raise ArtifactError naming `where`, the node and the string when the program JSON holds a string torch
    would evaluate or resolve to something outside the grammars and allow-lists above."""
    if not isinstance(program, dict):
        raise ArtifactError(f"{where}: the program is not a JSON object")
    passed: set[tuple[Any, str, str]] = set()  # a program repeats its expressions: each is parsed once
    for path, value, is_key in _strings(program):
        parent = path[-1] if path else ""
        if is_key:
            if parent == "range_constraints":
                rule = _range_key
            elif parent == "treespec_namedtuple_fields":
                rule = _match(_DOTTED, "a type name")
            else:
                rule = _match(_IDENT, "an identifier")
            field = f"key of {parent}"
        else:
            field = _field(path)
            if "metadata" in path[-2:-1]:  # a node's (or the module's) metadata: text fields only
                rule = _text if field in _TEXT_METADATA else None
            elif field == "type" and ("as_device" in path or "device" in path):
                rule = _one_of(_DEVICES, "a device type")
            else:
                rule = _FIELDS.get(field)
        if rule is None:
            raise ArtifactError(f"{where}: {_where(program, path)}: unexpected string {_short(value)} (a field this "
                                "check does not know torch keeps as text)")
        if (rule, field, value) in passed:
            continue
        try:
            rule(value)
            passed.add((rule, field, value))
        except _Refused as exc:
            raise ArtifactError(f"{where}: {_where(program, path)}: {field} {_short(value)} refused: {exc}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + "...'"
