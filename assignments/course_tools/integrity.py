"""The integrity check: what an answer cell of this course may not do.

Usage (students, before submitting: the copy shipped with the book's Assignments page;
instructors: ``python assignments/course_tools/integrity.py NOTEBOOK``)::

    python check_notebook.py argmax_attention.ipynb

It reads every code cell that a student can write (answer cells, cells they added, and
instructor cells they changed), parses it (``ast``, never regular expressions on the code)
and reports what no solution needs:

- importing anything outside the assignment's allowed modules (``torch``, ``math``,
  ``numpy`` and their submodules; ``typing`` and ``__future__`` are always allowed), the
  course library ``efficient_attention`` above all;
- rebinding attributes of modules or builtins (``torch.testing.assert_close = ...``,
  ``setattr``, ``delattr``), or rebinding at top level the names the setup cell imported
  (``torch``, ``math``, ...), ``__builtins__`` or a builtin (``isinstance = ...``), by any
  form of binding (assignment, ``for``/``with``/``except ... as``, ``match``/``case``
  captures, import aliases, definitions, ``:=``);
- IPython features: ``get_ipython``, magics and shell lines (``%...``, ``!...``, ``x?``),
  and top-level ``await``. The cell is checked as IPython runs it: after IPython's own input
  transformations (prompts ``>>>`` and ``In [1]:`` stripped, an indented cell dedented, magics
  turned into calls), so neither a prompt nor an indented cell hides code from the check;
- ``exec``, ``eval``, ``compile``, ``__import__``, ``globals()``, ``locals()``, ``vars``,
  ``getattr``, ``open``, ``breakpoint``, ``exit``, ``quit``;
- dunder attributes such as ``__globals__``, ``__builtins__``, ``__code__``, ``__class__``,
  ``__subclasses__``, ``__dict__``, frames and tracebacks (``tb_frame``, ``f_back``, ...);
- reading the notebook's own cells (``In``, ``Out``, ``_ih``, ``_oh``, ``_i1``, ...);
- any name starting with ``_grader`` (the tests' private tools), and the underscore names a
  test cell defines (``_expected``, ``_q``, ...: the hidden tests' inputs and results) unless
  the student's own cells define them too;
- what the assignment's rules file forbids (``forbidden_attributes``, e.g. a library
  function that would answer a part in one call).

A cell that does not parse (even after IPython's transformations) is not flagged here, unless
a line looks like a magic: its SyntaxError costs its own parts. Code that parses as Python is
never taken for a magic (``!=`` or ``%`` opening a continued line, a comment or docstring line
ending in ``?``). The run-time half of this check is ``runtime_guard.py``, installed in the
grading kernel: what a cell does when it runs (through any library) is checked there.
At grading time (``assignments/course_tools/preprocessors.py``) a flagged cell is replaced by
one that raises ``IntegrityError`` naming the rule, so only the parts that depend on it
score zero. This file uses the standard library only, so that it can be shipped alone.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import json
import os
import re
import sys
import textwrap
from pathlib import Path

DEFAULT_RULES = {"allowed_modules": ["torch", "math", "numpy"], "forbidden_attributes": []}
# Modules any answer may import whatever its rules say: type hints only, no side effects.
ALWAYS_ALLOWED_MODULES = {"__future__", "typing"}
# __future__ features an answer may turn on (barry_as_FLUFL would break every later cell).
ALLOWED_FUTURES = {"annotations", "division", "absolute_import", "print_function",
                   "unicode_literals", "generator_stop", "with_statement", "nested_scopes",
                   "generators"}
# Filled in by assignments/release_for_book.py in the copy shipped with the book:
# {assignment: {"allowed_modules": [...], "forbidden_attributes": [...], "trusted": [...]}}.
EMBEDDED_RULES: dict = {}

FORBIDDEN_CALLS = {
    "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "getattr",
    "setattr", "delattr", "get_ipython", "breakpoint", "open", "exit", "quit",
    "__build_class__", "runfile",
}
FORBIDDEN_MODULE_NAMES = {"sys", "os", "builtins", "importlib", "inspect", "gc", "ctypes",
                          "types", "IPython", "ipykernel", "traceback", "efficient_attention"}
NOTEBOOK_HISTORY = re.compile(r"^(In|Out|_ih|_oh|_dh|_i|_ii|_iii|_i\d+|_\d+|__|___|_exit_code)$")
# Dunder attributes a solution may use (definitions such as `def __init__` are always fine).
HARMLESS_DUNDERS = {
    "__init__", "__call__", "__len__", "__getitem__", "__iter__", "__next__", "__repr__",
    "__str__", "__name__", "__doc__", "__enter__", "__exit__", "__add__", "__sub__",
    "__mul__", "__matmul__", "__truediv__", "__neg__", "__eq__", "__lt__", "__le__",
    "__gt__", "__ge__", "__contains__", "__bool__", "__float__", "__int__",
}
FRAME_ATTRIBUTES = {
    "tb_frame", "tb_next", "tb_lineno", "f_back", "f_globals", "f_locals", "f_builtins",
    "f_code", "gi_frame", "cr_frame", "ag_frame", "gi_code", "co_code", "co_consts",
    "user_ns", "user_global_ns", "input_transformers_cleanup", "input_transformers_post",
    "ast_transformers", "events", "register_magic_function", "run_cell", "ex",
}
BUILTIN_NAMES = set(dir(builtins))
# Names whose rebinding at top level changes what every later cell sees.
REBIND_PROTECTED = BUILTIN_NAMES | {"__builtins__"}
MAGIC_LINE = re.compile(r"^\s*(?:[\w.,\s]+=\s*)?[%!]")


class IntegrityError(Exception):
    """An answer cell does something the integrity check forbids."""


def load_rules(assignment: str | None = None, rules_dir: str | Path | None = None) -> dict:
    """Rules of ``assignment``: ``rules_dir/<assignment>.json``, else embedded, else defaults."""
    rules = dict(DEFAULT_RULES)
    if assignment and rules_dir and (Path(rules_dir) / f"{assignment}.json").is_file():
        rules.update(json.loads((Path(rules_dir) / f"{assignment}.json").read_text()))
    elif assignment in EMBEDDED_RULES:
        rules.update(EMBEDDED_RULES[assignment])
    return rules


def fingerprint(source: str) -> str:
    """A short hash of a cell's source (whitespace at the ends ignored)."""
    return hashlib.sha256(source.strip().encode()).hexdigest()[:16]


def without_hidden_tests(source: str) -> str:
    kept, hidden = [], False
    for line in source.splitlines():
        if "BEGIN HIDDEN TESTS" in line:
            hidden = True
        elif "END HIDDEN TESTS" in line:
            hidden = False
        elif not hidden:
            kept.append(line)
    return "\n".join(kept)


def trusted_fingerprints(nb) -> set[str]:
    """Fingerprints of the instructor's code cells of a source notebook (not the answers),
    as in the source and as in the student release (hidden tests removed)."""
    sources = [_source(c) for c in nb["cells"]
               if c.get("cell_type") == "code" and not _meta(c).get("solution")]
    return {fingerprint(s) for s in sources} | {
        fingerprint(without_hidden_tests(s)) for s in sources}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _bare_references(node: ast.AST):
    """Roots of the name/attribute chains that ``node`` evaluates to (not call results)."""
    if isinstance(node, (ast.Name, ast.Attribute)):
        dotted = _dotted(node)
        if dotted:
            yield dotted.split(".")[0]
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for element in node.elts:
            yield from _bare_references(element)
    elif isinstance(node, ast.IfExp):
        yield from _bare_references(node.body)
        yield from _bare_references(node.orelse)
    elif isinstance(node, ast.NamedExpr):
        yield from _bare_references(node.value)


def _local_names(node) -> set[str]:
    """Names a function (or lambda, comprehension) binds in its own scope: its parameters and
    every name it stores, defines or imports outside nested functions, minus those it
    declares global or nonlocal."""
    names, declared = set(), set()
    args = node.args if hasattr(node, "args") else None
    if args is not None:
        names |= {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs,
                                  args.vararg, args.kwarg] if a is not None}
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        todo = list(node.generators)
    else:
        todo = list(node.body) if isinstance(node.body, list) else [node.body]
    while todo:
        child = todo.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)
            todo += child.decorator_list
            continue
        if isinstance(child, ast.Lambda):
            continue
        names |= set(_bound_by(child))
        if isinstance(child, (ast.Global, ast.Nonlocal)):
            declared |= set(child.names)
        todo += list(ast.iter_child_nodes(child))
    return names - declared


def _bound_by(node) -> list[str]:
    """Names one node binds (not those of its children)."""
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return [node.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"]
    if isinstance(node, ast.ExceptHandler) and node.name:
        return [node.name]
    if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
        return [node.name]
    if isinstance(node, ast.MatchMapping) and node.rest:
        return [node.rest]
    return []


def top_level_names(tree) -> set[str]:
    """Names a cell binds at top level (module scope), however it binds them."""
    names = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        names |= set(_bound_by(node))
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            # only := escapes a comprehension
            names |= {n.target.id for n in ast.walk(node) if isinstance(n, ast.NamedExpr)}
            continue
        todo += list(ast.iter_child_nodes(node))
    return names


class _Checker(ast.NodeVisitor):
    def __init__(self, rules: dict, protected: set[str], test_names: set[str] = frozenset()):
        self.allowed = set(rules.get("allowed_modules", DEFAULT_RULES["allowed_modules"]))
        self.allowed |= ALWAYS_ALLOWED_MODULES
        self.forbidden = {name.split(".")[-1]: name
                          for name in rules.get("forbidden_attributes", [])}
        self.protected = protected  # names bound by the setup cell
        self.test_names = set(test_names)  # underscore names the test cells define
        self.modules = set(protected) | BUILTIN_NAMES  # module-like roots
        self.depth = 0  # function nesting
        self.scopes: list[set[str]] = []  # local names of the enclosing functions
        self.globals_declared: set[str] = set()
        self.problems: list[tuple[int, str]] = []

    def flag(self, node, message):
        self.problems.append((getattr(node, "lineno", 0), message))

    def _bind(self, node, name: str | None, how: str = ""):
        """A name bound by any form of binding (assignment, for/with/except/match targets,
        import aliases, definitions); ``how``: " with a definition", ..."""
        if not name:
            return
        if name.startswith("_grader"):
            self.flag(node, f"rebinds {name}{how}, the tests' private tools")
        elif self.depth == 0 or name in self.globals_declared:
            if name in self.protected:
                self.flag(node, f"rebinds {name}{how}, a name of the setup cell")
            elif name in REBIND_PROTECTED:
                self.flag(node, f"rebinds the builtin {name}{how}")

    def _reads_test_name(self, node, name: str):
        if name in self.test_names and not any(name in scope for scope in self.scopes):
            self.flag(node, f"reads {name}, a name the tests define (their inputs and "
                            "results are not an answer's to read)")

    # imports
    def _import(self, node, module: str, bound: list[str]):
        top = module.split(".")[0]
        if top == "efficient_attention":
            self.flag(node, "imports efficient_attention, the course library, which answers "
                            "may not use")
        elif top not in self.allowed:
            shown = sorted(self.allowed - ALWAYS_ALLOWED_MODULES) or sorted(self.allowed)
            self.flag(node, f"imports {module}, which answers may not use (allowed: "
                            f"{', '.join(shown)})")
        for name in bound:
            self.modules.add(name)
            if name.startswith("_grader"):
                self.flag(node, f"rebinds {name}, the tests' private tools")
            elif name in self.protected and self.depth == 0 and name != top:
                self.flag(node, f"rebinds {name}, a name of the setup cell")
            elif name == "__builtins__" and (self.depth == 0 or name in self.globals_declared):
                self.flag(node, "rebinds __builtins__")

    def visit_Import(self, node):
        for alias in node.names:
            self._import(node, alias.name, [alias.asname or alias.name.split(".")[0]])

    def visit_ImportFrom(self, node):
        if node.level:
            self.flag(node, "uses a relative import, which answers may not use")
            return
        self._import(node, node.module or "", [a.asname or a.name for a in node.names])
        for alias in node.names:
            if alias.name == "*":
                self.flag(node, f"uses 'from {node.module} import *'")
            elif node.module == "__future__" and alias.name not in ALLOWED_FUTURES:
                self.flag(node, f"turns on the __future__ feature {alias.name}")
            self._forbidden_name(node, alias.name)

    # names
    def _forbidden_name(self, node, name):
        if name in self.forbidden:
            self.flag(node, f"uses {self.forbidden[name]}, which this assignment forbids")

    def visit_Name(self, node):
        name = node.id
        if name.startswith("_grader"):
            self.flag(node, f"uses {name}, the tests' private tools")
        elif NOTEBOOK_HISTORY.match(name):
            self.flag(node, f"uses {name}, which reads the notebook's own cells or outputs")
        elif name in FORBIDDEN_CALLS:
            self.flag(node, f"uses {name}, which answers may not use")
        elif name in FORBIDDEN_MODULE_NAMES:
            self.flag(node, f"uses {name}, which answers may not use")
        elif isinstance(node.ctx, (ast.Store, ast.Del)):
            self._bind(node, name)
        if isinstance(node.ctx, ast.Load):
            self._forbidden_name(node, name)
            self._reads_test_name(node, name)

    def visit_Global(self, node):
        self.globals_declared.update(node.names)
        for name in node.names:
            if name in self.protected or name in BUILTIN_NAMES or name.startswith("_grader"):
                self.flag(node, f"declares {name} global to rebind it")

    visit_Nonlocal = visit_Global

    def visit_Attribute(self, node):
        attr = node.attr
        if attr.startswith("__") and attr.endswith("__") and attr not in HARMLESS_DUNDERS:
            self.flag(node, f"uses the attribute {attr}, which answers may not use")
        elif attr in FRAME_ATTRIBUTES:
            self.flag(node, f"uses the attribute {attr} (frames, tracebacks or IPython)")
        elif attr.startswith("_grader"):
            self.flag(node, f"uses {attr}, the tests' private tools")
        elif attr in FORBIDDEN_MODULE_NAMES:  # torch.sys, torch.os: modules a library imported
            self.flag(node, f"uses the attribute {attr}, a module answers may not use")
        self._forbidden_name(node, attr)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root(node)
            if isinstance(root, ast.Name) and root.id in self.modules:
                what = "a builtin" if root.id in BUILTIN_NAMES else "a module"
                self.flag(node, f"changes {_dotted(node) or attr}, an attribute of {what}")
        self.generic_visit(node)

    def visit_Subscript(self, node):
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root(node)
            if isinstance(root, ast.Name) and root.id in self.modules - BUILTIN_NAMES:
                self.flag(node, f"changes an item of the module {root.id}")
        self.generic_visit(node)

    def visit_Assign(self, node):
        # `t = torch.testing` makes `t` a module for the attribute checks above
        if any(r in self.modules for r in _bare_references(node.value)):
            for target in node.targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        self.modules.add(sub.id)
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and (
                node.value in self.forbidden or node.value.startswith("_grader")):
            self.flag(node, f"names {node.value!r} in a string")

    def _function(self, node):
        self._bind(node, node.name, " with a definition")
        for decorator in node.decorator_list:
            self.visit(decorator)
        for default in [*node.args.defaults, *node.args.kw_defaults]:  # evaluated outside
            if default is not None:
                self.visit(default)
        self.depth += 1
        self.scopes.append(_local_names(node))
        saved = set(self.globals_declared)
        for child in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                      node.args.vararg, node.args.kwarg, node.returns, *node.body]:
            if child is not None:
                self.visit(child)
        self.globals_declared = saved
        self.scopes.pop()
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node):
        self._bind(node, node.name, " with a class")
        self.generic_visit(node)

    def visit_Lambda(self, node):
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        self.depth += 1
        self.scopes.append(_local_names(node))
        self.visit(node.body)
        self.scopes.pop()
        self.depth -= 1

    def _comprehension(self, node):
        self.scopes.append(_local_names(node))
        self.generic_visit(node)
        self.scopes.pop()

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    # the other forms of binding: except ... as, match/case captures
    def visit_ExceptHandler(self, node):
        self._bind(node, node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node):
        self._bind(node, node.name)
        self.generic_visit(node)

    visit_MatchStar = visit_MatchAs

    def visit_MatchMapping(self, node):
        self._bind(node, node.rest)
        self.generic_visit(node)

    # top-level await: IPython runs it (autoawait), plain Python does not parse it
    def _await(self, node):
        if self.depth == 0:
            self.flag(node, "uses top-level await (IPython's autoawait), which answers may "
                            "not use")
        self.generic_visit(node)

    visit_Await = visit_AsyncFor = visit_AsyncWith = _await


MAGIC_MESSAGE = "uses an IPython magic, shell command or help line"
# IPython's prompt stripping: classic (>>> and ...) and IPython's own (In [1]: and ...:)
PROMPTS = re.compile(r"^(?:>>>|\.\.\.)(?: |$)|^(?:In \[\d+\]: |\s*\.\.\.: )")


def _magic_lines(source: str) -> list[tuple[int, str]]:
    """Lines that look like magics, shell or help lines (for a cell that does not parse)."""
    problems = []
    for number, line in enumerate(source.splitlines(), 1):
        if MAGIC_LINE.match(line) or line.rstrip().endswith("?") and not line.lstrip(
                ).startswith("#"):
            problems.append((number, MAGIC_MESSAGE))
    return problems


def _parse(source: str):
    """The AST of a cell as IPython compiles it (top-level await allowed), or None."""
    try:
        return compile(source, "<cell>", "exec",
                       ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except (SyntaxError, ValueError):
        return None


def as_ipython_runs(source: str) -> str:
    """The code IPython runs for a cell: after its input transformations (prompts stripped,
    an indented cell dedented, magics, shell and help lines turned into ``get_ipython()``
    calls). Without IPython, prompts and indentation only."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except Exception:  # the shipped checker on a machine without IPython
        lines = source.splitlines(keepends=True)
        first = [line for line in lines if line.strip()][:2]
        if any(PROMPTS.match(line) for line in first):
            lines = [PROMPTS.sub("", line, count=1) for line in lines]
        return textwrap.dedent("".join(lines))
    try:
        return TransformerManager().transform_cell(source)
    except Exception:  # IPython cannot transform it: the kernel does not run it either
        return source


def setup_names(source: str) -> set[str]:
    """Names the setup cell binds by import (``torch``, ``math``, ``np``, ``plt``, ...)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def check_source(source: str, rules: dict | None = None,
                 protected: set[str] = frozenset(),
                 test_names: set[str] = frozenset()) -> list[tuple[int, str]] | None:
    """Problems ``(line, message)`` of one cell, or None if it does not parse.

    The cell is checked as plain Python and as IPython runs it (after IPython's input
    transformations), so that a prompt, an indented cell or a magic hides nothing; a magic
    line is only recognised as such when the cell is not plain Python. ``test_names``: names
    of the tests the cell may not read.
    """
    rules = rules or DEFAULT_RULES
    ran = as_ipython_runs(source)
    plain = _parse(source)
    transformed = _parse(ran) if ran.strip() != source.strip() else None
    if plain is None and transformed is None:
        return _magic_lines(source) or None
    problems = []
    magic_lines = set()
    if plain is None:  # IPython syntax: magics, shell or help lines, prompts, indentation
        original = source.splitlines()
        for number, line in enumerate(ran.splitlines(), 1):
            before = original[number - 1] if number <= len(original) else ""
            if "get_ipython()" in line and "get_ipython" not in before:
                magic_lines.add(number)
                problems.append((number, MAGIC_MESSAGE))
    for tree in (plain, transformed):
        if tree is None:
            continue
        checker = _Checker(rules, set(protected), set(test_names))
        checker.visit(tree)
        problems += [(line, message) for line, message in checker.problems
                     if not (line in magic_lines and "get_ipython" in message)]
    return sorted(set(problems))


def tests_names(nb, checked: list[int]) -> set[str]:
    """Underscore names the test cells of ``nb`` define (the hidden tests' inputs, results and
    helpers), less those the ``checked`` (student) cells define themselves."""
    defined_by_tests, defined_by_student = set(), set()
    for index, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code":
            continue
        is_test = _meta(cell).get("grade") and not _meta(cell).get("solution")
        if index not in checked and not is_test:
            continue
        source = _source(cell)
        tree = _parse(source) or _parse(as_ipython_runs(source))
        if tree is None:
            continue
        if index in checked:
            defined_by_student |= top_level_names(tree)
        else:
            defined_by_tests |= top_level_names(tree)
    return {name for name in defined_by_tests - defined_by_student
            if name.startswith("_") and not name.startswith(("__", "_grader")) and name != "_"}


def _meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def _source(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def cells_to_check(nb, trusted: set[str] | None = None) -> list[int]:
    """Indices of the code cells a student wrote or could have changed.

    ``trusted`` holds fingerprints of the instructor's code cells (setup, grader tools,
    tests, demonstrations); a cell equal to one of them is not checked. Without it, cells
    marked read-only in their metadata are trusted (the autograde pipeline restores them).
    """
    indices = []
    for index, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code":
            continue
        if trusted is not None:
            if fingerprint(_source(cell)) in trusted and not _meta(cell).get("solution"):
                continue
        elif _meta(cell).get("locked") and not _meta(cell).get("solution"):
            continue
        indices.append(index)
    return indices


def check_notebook(nb, rules: dict | None = None,
                   trusted: set[str] | None = None) -> dict[int, list[tuple[int, str]]]:
    """``{cell index: problems}`` for every cell with at least one problem."""
    code = [c for c in nb["cells"] if c.get("cell_type") == "code"]
    protected = setup_names(_source(code[0])) if code else set()
    found = {}
    checked = cells_to_check(nb, trusted)
    reserved = tests_names(nb, checked)
    for index in checked:
        problems = check_source(_source(nb["cells"][index]), rules, protected, reserved)
        if problems:
            found[index] = problems
    return found


def cell_name(nb, index: int) -> str:
    grade_id = _meta(nb["cells"][index]).get("grade_id")
    return f"answer cell {grade_id}" if grade_id else f"cell {index + 1}"


def describe(nb, index: int, problems: list[tuple[int, str]]) -> str:
    return "; ".join(f"{cell_name(nb, index)}: line {line} {message}"
                     for line, message in problems)


def rejected_source(description: str) -> str:
    """The source that replaces a rejected cell at grading time."""
    return (
        "# The course's integrity check rejected this cell, so it was not run (see the\n"
        "# instructions at the top of the notebook). The parts that use it score zero.\n"
        "class IntegrityError(Exception):\n"
        "    pass\n\n\n"
        f"raise IntegrityError({description!r})"
    )


def course_catalogue(course: str | Path) -> dict:
    """Rules of every assignment of a course folder, with its grade ids and trusted cells."""
    course = Path(course)
    catalogue = {}
    for path in sorted((course / "source").glob("*/*.ipynb")):
        if path.stem != path.parent.name:
            continue
        nb = json.loads(path.read_text(encoding="utf-8"))
        rules = load_rules(path.stem, course / "rules")
        rules["grade_ids"] = sorted(_meta(c)["grade_id"] for c in nb["cells"]
                                    if _meta(c).get("grade_id"))
        rules["trusted"] = sorted(trusted_fingerprints(nb))
        catalogue[path.stem] = rules
    return catalogue


def default_catalogue() -> dict:
    """The embedded rules (shipped copy), else those of the course this file sits in."""
    if EMBEDDED_RULES:
        return EMBEDDED_RULES
    course = Path(__file__).resolve().parents[1]
    return course_catalogue(course) if (course / "source").is_dir() else {}


def identify(nb, catalogue: dict, name: str | None = None) -> str | None:
    """The assignment a notebook belongs to: ``name`` if known, else by its grade ids."""
    if name in catalogue:
        return name
    ids = {_meta(c).get("grade_id") for c in nb["cells"]} - {None}
    scores = {key: len(ids & set(rules.get("grade_ids", []))) for key, rules in catalogue.items()}
    best = max(scores, key=scores.get, default=None)
    return best if best and scores[best] > 2 else None


def problems_in(nb, catalogue: dict, name: str | None = None) -> dict:
    """``check_notebook`` with the rules and trusted cells of the notebook's assignment."""
    key = identify(nb, catalogue, name)
    rules = dict(DEFAULT_RULES, **catalogue[key]) if key else dict(DEFAULT_RULES)
    trusted = set(rules["trusted"]) if rules.get("trusted") else None
    return check_notebook(nb, rules, trusted)


def make_validate_hook(catalogue: dict | None = None):
    """An ``Execute.on_notebook_start`` hook: ``nbgrader validate`` fails on a rejected cell.

    It acts only under ``nbgrader validate`` (autograde replaces rejected cells instead).
    """
    def hook(notebook=None, **_):
        if os.environ.get("NBGRADER_EXECUTION") != "validate" or notebook is None:
            return
        found = problems_in(notebook, catalogue if catalogue is not None else default_catalogue())
        if found:
            lines = [describe(notebook, index, problems) for index, problems in found.items()]
            raise IntegrityError(
                "the integrity check rejects these cells; at grading they are not run and "
                "the parts that use them score zero:\n  " + "\n  ".join(lines))
    return hook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check the answer cells of assignment notebooks against the course's "
                    "integrity rules (what the grader rejects).")
    parser.add_argument("notebooks", nargs="+", metavar="NOTEBOOK")
    parser.add_argument("--assignment", help="assignment name (default: found from the cells)")
    args = parser.parse_args(argv)
    catalogue = default_catalogue()
    status = 0
    for path in args.notebooks:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
        key = identify(nb, catalogue, args.assignment or Path(path).stem)
        found = problems_in(nb, catalogue, key)
        for index, problems in found.items():
            for line, message in problems:
                print(f"{path}: {cell_name(nb, index)}, line {line}: {message}")
        if found:
            status = 1
            print(f"{path}: {len(found)} cell(s) would be rejected at grading; the parts "
                  "that use them would score zero.")
        else:
            print(f"{path}: passes the integrity check"
                  + (f" ({key})." if key else " (default rules: unknown assignment)."))
    return status


if __name__ == "__main__":
    sys.exit(main())
