"""The integrity check: what an answer cell of this course may not do.

Usage (students, before submitting: the copy shipped with the book's Assignments page;
instructors: ``python assignments/course_tools/integrity.py NOTEBOOK``)::

    python check_notebook.py argmax_attention.ipynb

It reads every code cell that a student can write (answer cells, cells they added, and
instructor cells they changed), parses it (``ast``, never regular expressions on the code)
and reports what no solution needs:

- importing anything outside the assignment's allowed modules (``torch``, ``math``,
  ``numpy`` and their submodules), the course library ``efficient_attention`` above all;
- rebinding attributes of modules or builtins (``torch.testing.assert_close = ...``,
  ``setattr``, ``delattr``), or rebinding at top level the names the setup cell imported
  (``torch``, ``math``, ...) or a builtin (``isinstance = ...``);
- IPython features: ``get_ipython``, magics and shell lines (``%...``, ``!...``);
- ``exec``, ``eval``, ``compile``, ``__import__``, ``globals()``, ``locals()``, ``vars``,
  ``getattr``, ``open``, ``breakpoint``, ``exit``, ``quit``;
- dunder attributes such as ``__globals__``, ``__builtins__``, ``__code__``, ``__class__``,
  ``__subclasses__``, ``__dict__``, frames and tracebacks (``tb_frame``, ``f_back``, ...);
- reading the notebook's own cells (``In``, ``Out``, ``_ih``, ``_oh``, ``_i1``, ...);
- any name starting with ``_grader`` (the tests' private tools);
- what the assignment's rules file forbids (``forbidden_attributes``, e.g. a library
  function that would answer a part in one call).

A cell that does not parse is not flagged here: its SyntaxError costs its own parts.
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
from pathlib import Path

DEFAULT_RULES = {"allowed_modules": ["torch", "math", "numpy"], "forbidden_attributes": []}
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


class _Checker(ast.NodeVisitor):
    def __init__(self, rules: dict, protected: set[str]):
        self.allowed = set(rules.get("allowed_modules", DEFAULT_RULES["allowed_modules"]))
        self.forbidden = {name.split(".")[-1]: name
                          for name in rules.get("forbidden_attributes", [])}
        self.protected = protected  # names bound by the setup cell
        self.modules = set(protected) | BUILTIN_NAMES  # module-like roots
        self.depth = 0  # function nesting
        self.globals_declared: set[str] = set()
        self.problems: list[tuple[int, str]] = []

    def flag(self, node, message):
        self.problems.append((getattr(node, "lineno", 0), message))

    # imports
    def _import(self, node, module: str, bound: list[str]):
        top = module.split(".")[0]
        if top == "efficient_attention":
            self.flag(node, "imports efficient_attention, the course library, which answers "
                            "may not use")
        elif top not in self.allowed:
            self.flag(node, f"imports {module}, which answers may not use (allowed: "
                            f"{', '.join(sorted(self.allowed))})")
        for name in bound:
            self.modules.add(name)
            if name in self.protected and self.depth == 0 and name != top:
                self.flag(node, f"rebinds {name}, a name of the setup cell")

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
        elif isinstance(node.ctx, (ast.Store, ast.Del)) and (
                self.depth == 0 or name in self.globals_declared):
            if name in self.protected:
                self.flag(node, f"rebinds {name}, a name of the setup cell")
            elif name in BUILTIN_NAMES:
                self.flag(node, f"rebinds the builtin {name}")
        if isinstance(node.ctx, ast.Load):
            self._forbidden_name(node, name)

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
        if self.depth == 0 and (node.name in self.protected or node.name in BUILTIN_NAMES):
            self.flag(node, f"rebinds {node.name} with a definition")
        for decorator in node.decorator_list:
            self.visit(decorator)
        self.depth += 1
        saved = set(self.globals_declared)
        for child in [node.args, *node.body]:
            self.visit(child)
        self.globals_declared = saved
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node):
        if self.depth == 0 and (node.name in self.protected or node.name in BUILTIN_NAMES):
            self.flag(node, f"rebinds {node.name} with a class")
        self.generic_visit(node)

    def visit_Lambda(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1


def _magic_lines(source: str) -> list[tuple[int, str]]:
    problems = []
    for number, line in enumerate(source.splitlines(), 1):
        if MAGIC_LINE.match(line) or line.rstrip().endswith("?") and not line.lstrip(
                ).startswith("#"):
            problems.append((number, "uses an IPython magic, shell command or help line"))
    return problems


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
                 protected: set[str] = frozenset()) -> list[tuple[int, str]] | None:
    """Problems ``(line, message)`` of one cell, or None if it does not parse."""
    rules = rules or DEFAULT_RULES
    problems = _magic_lines(source)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return problems or None
    checker = _Checker(rules, set(protected))
    checker.visit(tree)
    return sorted(set(problems + checker.problems))


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
    for index in cells_to_check(nb, trusted):
        problems = check_source(_source(nb["cells"][index]), rules, protected)
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
