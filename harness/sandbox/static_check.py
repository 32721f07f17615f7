"""Static check of untrusted harness source, run before any of it executes.

This is the first line of defence; the worker's restricted builtins, module facades, audit hook and
OS limits (harness.sandbox.python_layer) are the second. The rules are deliberately coarse: a harness needs
prompts, parsing and control flow, none of which needs introspection.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import string
import threading

# Names a harness may not mention at all (as a call, a value or an assignment target).
BANNED_NAMES = frozenset(
    {
        "eval", "exec", "compile", "open", "globals", "locals", "vars", "getattr", "setattr",
        "delattr", "dir", "breakpoint", "input", "memoryview", "help", "exit", "quit",
    }
)  # fmt: skip

# Attribute names that lead from ordinary objects to frames, code or builtins without a dunder.
BANNED_ATTRIBUTES = frozenset(
    {
        "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "ag_frame",
        "ag_code", "ag_await", "f_globals", "f_locals", "f_builtins", "f_back", "f_code",
        "f_trace", "tb_frame", "tb_next", "co_code", "co_consts", "mro", "format_map",
    }
)  # fmt: skip

_DUNDER_IN_STRING = re.compile(r"__[A-Za-z]")


@dataclasses.dataclass(frozen=True)
class Violation:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


class StaticCheckError(ValueError):
    def __init__(self, violations: list[Violation]):
        self.violations = violations
        super().__init__("; ".join(str(v) for v in violations[:10]))


def _bad_identifier(name: str | None) -> bool:
    return bool(name) and name != "_" and name.startswith("_")


def _format_fields(text: str) -> list[str]:
    """Field names of a str.format template, nested specs included; [] if it is not a template."""
    fields: list[str] = []
    try:
        for _, field, spec, _ in string.Formatter().parse(text):
            if field is not None:
                fields.append(field)
            if spec:
                fields.extend(_format_fields(spec))
    except (ValueError, IndexError):
        return []
    return fields


class _Checker(ast.NodeVisitor):
    def __init__(self, allowed_imports: frozenset[str], str_constants: set[str]):
        self.allowed = allowed_imports
        self.str_constants = str_constants
        self.violations: list[Violation] = []

    def bad(self, node: ast.AST, message: str) -> None:
        self.violations.append(Violation(getattr(node, "lineno", 0), message))

    def ident(self, node: ast.AST, name: str | None, what: str) -> None:
        if _bad_identifier(name):
            self.bad(node, f"{what} {name!r} starts with an underscore")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name not in self.allowed and alias.name.split(".")[0] not in self.allowed:
                self.bad(node, f"import of {alias.name!r} is not allowed")
            self.ident(node, alias.asname, "alias")
            for part in alias.name.split("."):
                self.ident(node, part, "module")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module not in self.allowed:
            self.bad(node, f"import from {'.' * node.level}{module!r} is not allowed")
        for alias in node.names:
            if alias.name == "*":
                self.bad(node, "star import is not allowed")
            self.ident(node, alias.name, "imported name")
            self.ident(node, alias.asname, "alias")

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in BANNED_NAMES:
            self.bad(node, f"use of {node.id!r} is not allowed")
        self.ident(node, node.id, "name")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in BANNED_ATTRIBUTES:
            self.bad(node, f"attribute {node.attr!r} is not allowed")
        self.ident(node, node.attr, "attribute")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "format":
            receiver = func.value
            literal = isinstance(receiver, ast.Constant) and isinstance(receiver.value, str)
            named = isinstance(receiver, ast.Name) and receiver.id in self.str_constants
            if not (literal or named):
                self.bad(node, ".format() only on a string literal or a module-level string")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            if _DUNDER_IN_STRING.search(node.value):
                self.bad(node, "string constant mentions a dunder name")
            for field in _format_fields(node.value):
                if "." in field or "[" in field:
                    self.bad(node, f"format field {{{field}}} reaches into an object")

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        if not isinstance(node, ast.Lambda):
            self.ident(node, node.name, "function")
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                self.ident(node, arg.arg, "argument")
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.ident(node, node.name, "class")
        self.generic_visit(node)

    def visit_keyword(self, node: ast.keyword) -> None:
        self.ident(node, node.arg, "keyword")
        self.generic_visit(node)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        self.ident(node, node.name, "name")
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global | ast.Nonlocal) -> None:
        for name in node.names:
            self.ident(node, name, "name")

    visit_Nonlocal = visit_Global

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        self.ident(node, node.name, "name")
        self.generic_visit(node)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        self.ident(node, node.name, "name")

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        self.ident(node, node.rest, "name")
        self.generic_visit(node)

    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        # A positional sub-pattern reads the attribute its class's __match_args__ names, a name
        # computed at run time (a class built by type() can carry any), so the check could not
        # see which attribute is read. Keyword sub-patterns name theirs in the source.
        if node.patterns:
            self.bad(node, "positional sub-patterns in a class pattern are not allowed; "
                           "name the attributes (case Point(x=a))")  # fmt: skip
        for attr in node.kwd_attrs:
            self.ident(node, attr, "attribute")
            if attr in BANNED_ATTRIBUTES:
                self.bad(node, f"attribute {attr!r} is not allowed")
        self.generic_visit(node)


def _module_str_constants(tree: ast.Module) -> set[str]:
    """Module-level names bound exactly once, to a string literal: safe receivers of .format()."""
    counts: dict[str, int] = {}
    literal: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.NamedExpr)):
            targets = [node.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    counts[n.id] = counts.get(n.id, 0) + 1
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            literal.add(node.targets[0].id)
    return {name for name in literal if counts.get(name) == 1}


_PARSE_LOCK = threading.Lock()


def check_source(
    source: str, *, allowed_imports: frozenset[str], required: tuple[str, ...] = ("run",)
) -> list[Violation]:
    """All violations in ``source``; empty means it may be loaded in the sandbox."""
    try:
        with _PARSE_LOCK:  # CPython 3.11's AST validation is not thread-safe (gh-106905)
            tree = ast.parse(source, mode="exec")
    except SyntaxError as e:
        return [Violation(e.lineno or 0, f"SyntaxError: {e.msg}")]
    except (ValueError, RecursionError, MemoryError) as e:
        return [Violation(0, f"unparsable source: {type(e).__name__}")]
    checker = _Checker(allowed_imports, _module_str_constants(tree))
    try:
        checker.visit(tree)
    except RecursionError:
        return [Violation(0, "source nests too deeply")]
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name in required:
        if name not in defined:
            checker.violations.append(Violation(0, f"required function {name!r} is not defined"))
    return checker.violations


def validate(
    source: str, *, allowed_imports: frozenset[str], required: tuple[str, ...] = ("run",)
) -> None:
    violations = check_source(source, allowed_imports=allowed_imports, required=required)
    if violations:
        raise StaticCheckError(violations)
