"""The Assignments page (book/assignments.md) says what the integrity check really does, and
how to install the CPU build of torch.

The rules are read from assignments/course_tools/integrity.py itself: every message a rejected
cell can get (the ``self.flag(...)`` calls and the IPython-line problems, read with ``ast``)
must have its entry in RULE_PHRASES, whose phrase the page's section "What answer cells may
not do" must contain; and every name of its lists (forbidden functions and modules, frame
attributes, allowed dunders, notebook-history names, default modules) must appear there. A
rule added to integrity.py without its line on the page fails here. Each assignment's own rules
(assignments/rules/*.json) reach the page through the generated include ``rules.md``
(assignments/release_for_book.py).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "assignments"
PAGE = ROOT / "book" / "assignments.md"
INTEGRITY = COURSE / "course_tools" / "integrity.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


integrity = _load("course_integrity_page", INTEGRITY)
release_for_book = _load("release_for_book_page", COURSE / "release_for_book.py")

# Every message of integrity.py ({} for what it names) -> what the page says of that rule.
RULE_PHRASES = {
    "imports efficient_attention, the course library, which answers may not use":
        "above all the course library `efficient_attention`",
    "imports {}, which answers may not use (allowed: {})":
        "**imports** a module outside the assignment's allowed ones",
    "uses a relative import, which answers may not use": "a relative import",
    "uses 'from {} import *'": "`from module import *`",
    "turns on the __future__ feature {}": "turns on a `__future__` feature other than",
    "uses {}, which answers may not use": "**uses one of these functions**",
    "uses the attribute {}, a module answers may not use": "even reached as an attribute",
    "changes {}, an attribute of {}":
        "**changes an attribute or an item of a module or a builtin**",
    "changes an item of the module {}": '`torch.ops["x"] = ...`',
    "rebinds {}{}, a name of the setup cell": "a name the setup cell imported",
    "rebinds {}, a name of the setup cell": "(`import numpy as torch`)",
    "rebinds the builtin {}{}": "or a builtin (`isinstance = ...`, `def print(...)`",
    "rebinds __builtins__": "`__builtins__` or a builtin",
    "declares {} global to rebind it": "`global` or `nonlocal` in a function",
    "uses an IPython magic, shell command or help line": "**uses IPython**",
    "uses top-level await (IPython's autoawait), which answers may not use":
        "top-level `await`",
    "uses the attribute {}, which answers may not use": "**uses a dunder attribute**",
    "uses the attribute {} (frames, tracebacks or IPython)":
        "**uses an attribute that reaches frames, tracebacks or IPython's internals**",
    "uses {}, which reads the notebook's own cells or outputs":
        "**reads the notebook's own cells or outputs**",
    "uses {}, the tests' private tools": "**uses the tests' private tools**",
    "rebinds {}{}, the tests' private tools": "a name starting with `_grader` bound anywhere",
    "rebinds {}, the tests' private tools": "a name starting with `_grader` bound anywhere",
    "reads {}, a name the tests define (their inputs and results are not an answer's to read)":
        "**reads a name the tests define**",
    "uses {}, which this assignment forbids": "**uses a name its assignment forbids**",
    "names {} in a string": "or the bare name as a string",
}


def _template(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):  # a module-level constant such as MAGIC_MESSAGE
        return constants.get(node.id)
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def rule_messages(source: str) -> set[str]:
    """The messages a rejected cell can get: ``self.flag(node, MESSAGE)`` and
    ``problems.append((line, MESSAGE))``, placeholders as ``{}``."""
    tree = ast.parse(source)
    constants = {node.targets[0].id: node.value.value for node in tree.body
                 if isinstance(node, ast.Assign) and len(node.targets) == 1
                 and isinstance(node.targets[0], ast.Name)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr == "flag" and len(node.args) == 2:
            found.add(_template(node.args[1], constants))
        elif (node.func.attr == "append" and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "problems" and node.args
              and isinstance(node.args[0], ast.Tuple)):
            found.add(_template(node.args[0].elts[1], constants))
    assert None not in found, "a message that is neither a string, a constant nor an f-string"
    return found


def _section() -> str:
    """The page's "What answer cells may not do", whitespace collapsed."""
    text = PAGE.read_text()
    start = text.index("## What answer cells may not do")
    end = text.index("\n## ", start + 3)
    return " ".join(text[start:end].split())


def test_every_rule_of_the_integrity_check_is_on_the_page():
    messages = rule_messages(INTEGRITY.read_text())
    assert len(messages) >= 15, messages
    unlisted = sorted(messages - set(RULE_PHRASES))
    assert not unlisted, (
        f"integrity.py rejects cells with {unlisted}: list the rule in {PAGE.name} ('What "
        "answer cells may not do') and its phrase in RULE_PHRASES")
    stale = sorted(set(RULE_PHRASES) - messages)
    assert not stale, f"RULE_PHRASES names messages integrity.py no longer has: {stale}"
    section = _section()
    missing = sorted(phrase for phrase in RULE_PHRASES.values() if phrase not in section)
    assert not missing, f"{PAGE.name} does not say: {missing}"


def test_rule_extraction_sees_a_new_rule():
    source = INTEGRITY.read_text().replace(
        'self.flag(node, f"declares {name} global to rebind it")',
        'self.flag(node, f"declares {name} global to rebind it")\n'
        '                self.flag(node, f"uses {name} as a new trick")', 1)
    assert rule_messages(source) - rule_messages(INTEGRITY.read_text()) == {
        "uses {} as a new trick"}


def test_every_name_the_check_lists_is_on_the_page():
    section = _section()
    named = set(re.findall(r"`([^`]+)`", section))
    for what, names in (("forbidden functions", integrity.FORBIDDEN_CALLS),
                        ("forbidden modules", integrity.FORBIDDEN_MODULE_NAMES),
                        ("frame and IPython attributes", integrity.FRAME_ATTRIBUTES),
                        ("allowed dunders", integrity.HARMLESS_DUNDERS),
                        ("default modules", integrity.DEFAULT_RULES["allowed_modules"]),
                        ("modules always allowed", integrity.ALWAYS_ALLOWED_MODULES),
                        ("allowed __future__ features", integrity.ALLOWED_FUTURES)):
        missing = sorted(set(names) - named)
        assert not missing, f"{PAGE.name} does not list these {what}: {missing}"
    # the notebook's own cells: each alternative of the pattern, shown by an example
    alternatives = integrity.NOTEBOOK_HISTORY.pattern.strip("^$()").split("|")
    unshown = [a for a in alternatives if not any(re.fullmatch(a, n) for n in named)]
    assert not unshown, f"{PAGE.name} shows no example of the notebook names {unshown}"
    assert "_grader" in section


def test_each_assignments_rules_reach_the_page(tmp_path):
    assert "```{include} _downloads/assignments/rules.md" in PAGE.read_text()
    names = release_for_book.assignment_names()
    release_for_book.write_rules(names, tmp_path / "rules.md")
    lines = {re.match(r"- `(\w+)`", line).group(1): line
             for line in (tmp_path / "rules.md").read_text().splitlines()
             if line.startswith("- `")}
    assert sorted(lines) == sorted(names)
    for name in names:
        path = COURSE / "rules" / f"{name}.json"
        rules = dict(integrity.DEFAULT_RULES, **(json.loads(path.read_text())
                                                 if path.is_file() else {}))
        for item in [*rules["allowed_modules"], *rules["forbidden_attributes"]]:
            assert f"`{item}`" in lines[name], (name, item, lines[name])


def test_page_installs_the_cpu_build_of_torch_first():
    text = PAGE.read_text()
    pin = re.search(r"^torch==(\S+)$", (COURSE / "student-requirements.txt").read_text(),
                    flags=re.M).group(1)
    cpu = re.search(r"pip install torch==(\S+) --index-url https://download\.pytorch\.org/whl/cpu",
                    text)
    assert cpu, "the page gives no CPU-only install line for torch"
    assert cpu.group(1) == pin, f"the page installs torch {cpu.group(1)}; the requirements: {pin}"
    requirements = text.find("pip install -r student-requirements.txt")
    assert 0 <= cpu.start() < requirements, "torch's CPU build must come before the requirements"
