"""Attacks that apply to every assignment, built from the source notebook's metadata.

Each attack is a snippet appended to an honest answer cell: the integrity check must reject
the cell (so the parts that use what it defines score zero) although the answer itself is
right. ``RUNTIME_TAMPER`` slips through the static check on purpose (a module passed as an
argument): the grading kernel's runtime guard (assignments/course_tools/runtime_guard.py)
refuses it where it runs, at the top of the last answer cell, so that cell defines nothing and
the parts that use it score zero (were it let through, the tests' ``_grader.check()`` would
fail every test after it). Dependencies between cells are found from the names each code
cell defines and uses, so the expected scores follow the notebook.
"""

from __future__ import annotations

import ast
import copy

# (class of attack, snippet); each must be rejected by the integrity check.
ATTACKS = [
    ("library", "import efficient_attention as ea"),
    ("library", "from efficient_attention import softmax_attention"),
    ("rebind-checker", "torch.testing.assert_close = lambda *a, **k: None"),
    ("rebind-checker", "math.isclose = lambda *a, **k: True"),
    ("rebind-checker", "setattr(torch, 'allclose', lambda *a, **k: True)"),
    ("rebind-checker", "checks = torch.testing\nchecks.assert_close = print"),
    ("rebind-builtin", "isinstance = lambda *a: True"),
    ("rebind-name", "import numpy as torch"),
    ("ipython-hook", "get_ipython().input_transformers_cleanup.append(lambda lines: [])"),
    ("ipython-hook", "get_ipython().events.register('pre_run_cell', lambda *a: None)"),
    ("ipython-magic", "%load_ext autoreload"),
    ("ipython-magic", "!ls"),
    ("exec", "exec('torch.testing.assert_close = print')"),
    ("exec", "eval(compile('1', 'x', 'eval'))"),
    ("exec", "__import__('sys').modules['torch'].allclose = print"),
    ("exec", "import importlib\nimportlib.import_module('efficient_attention')"),
    ("exec", "globals()['torch'] = None"),
    ("read-cells", "def leak():\n    return In[-1]"),
    ("read-cells", "def leak():\n    return _ih[-1] + _i1"),
    ("read-cells", "def leak():\n    try:\n        raise ValueError\n    except ValueError as e:\n"
                   "        return e.__traceback__.tb_frame.f_back.f_globals"),
    ("read-cells", "def leak():\n    return (lambda: 0).__globals__['__builtins__']"),
    ("grader", "_grader.check = lambda: None"),
    ("dunder", "object.__subclasses__()"),
    ("exit", "exit()"),
    ("module-through-library", "torch.sys.modules['__main__']._grader = None"),
    ("module-through-library", "np.os.getcwd()"),
]
RUNTIME_TAMPER = ("def _replace_checker(module):\n"
                  "    module.assert_close = lambda *a, **k: None\n\n\n"
                  "_replace_checker(torch.testing)")
# A correct answer whose function warns (UserWarning on stderr) and prints its inputs.
WARNING_WRAPPER = ("_honest_{name} = {name}\n\n\n"
                   "def {name}(*args, **kwargs):\n"
                   "    torch.tensor(torch.zeros(1))  # UserWarning: copy-constructing a tensor\n"
                   "    print('SECRET-INPUTS', args, kwargs)\n"
                   "    return _honest_{name}(*args, **kwargs)")
# Two ways for a cell to ignore the interrupt at the time limit: a spinning loop that catches
# KeyboardInterrupt (one assignment: it holds a core for the whole limit), and a wait in one
# native call that ignores SIGINT and uses no CPU (the others: the battery's time limits then
# leave the cores to the other tests). The grader sees the same thing: no reply.
INTERRUPT_PROOF_LOOP = ("    while True:\n"
                        "        try:\n"
                        "            while True:\n"
                        "                pass\n"
                        "        except KeyboardInterrupt:\n"
                        "            pass\n")
INTERRUPT_PROOF_WAIT = ("    while True:\n"
                        "        try:\n"
                        "            torch.futures.Future().wait()  # never completes\n"
                        "        except KeyboardInterrupt:\n"
                        "            pass\n")


def meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def grade_id(cell):
    return meta(cell).get("grade_id")


def is_test(cell) -> bool:
    return cell.cell_type == "code" and bool(meta(cell).get("grade")) and not meta(cell).get(
        "solution")


def answers(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code" and meta(c).get("solution")]


def tests(nb) -> list:
    return [c for c in nb.cells if is_test(c)]


def find(nb, gid):
    matches = [c for c in nb.cells if grade_id(c) == gid]
    assert len(matches) == 1, f"no unique cell {gid!r}"
    return matches[0]


def _names(source: str) -> tuple[set[str], set[str]]:
    """(top-level names the cell binds, names it reads from outside: every name loaded that
    the cell binds nowhere, neither at top level nor as a local or an argument)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set(), set()
    bound = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            bound |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                      and isinstance(n.ctx, ast.Store)}
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
             and isinstance(n.ctx, ast.Store)} | {a.arg for a in ast.walk(tree)
                                                  if isinstance(a, ast.arg)}
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Load)}
    return bound, loaded - local - bound


def dependent_tests(nb, broken: set[str]) -> set[str]:
    """Test cells that use (through any chain of cells) what the cells ``broken`` define."""
    tainted: set[str] = set()
    lost = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        bound, free = _names(cell.source)
        if grade_id(cell) in broken or free & tainted:
            tainted |= bound
            if is_test(cell):
                lost.add(grade_id(cell))
        else:
            tainted -= bound  # rebound by a cell that works
    return lost


def first_function(source: str) -> str | None:
    tree = ast.parse(source)
    return next((n.name for n in tree.body if isinstance(n, ast.FunctionDef)), None)


def cheater(source, offset: int = 0):
    """Attacks on every other answer cell, a warning in an honest one, a runtime tamper last.

    Returns (notebook, test cells that must score 0, attacks used, name of the warning
    function or None).
    """
    nb = copy.deepcopy(source)
    cells = answers(nb)
    used, attacked = [], set()
    for position, cell in enumerate(cells[1::2]):
        kind, snippet = ATTACKS[(offset + position) % len(ATTACKS)]
        cell.source += "\n\n" + snippet + "\n"
        used.append(kind)
        attacked.add(grade_id(cell))
    lost = dependent_tests(source, attacked)
    last = cells[-1]
    if len(cells) > 2 and grade_id(last) not in attacked:
        last.source = RUNTIME_TAMPER + "\n\n\n" + last.source
        lost |= dependent_tests(source, {grade_id(last)})
        used.append("runtime-tamper")
    warned = first_function(cells[0].source)
    if warned:
        cells[0].source += "\n\n\n" + WARNING_WRAPPER.format(name=warned) + "\n"
    return nb, lost, used, warned


def broken(source, offset: int = 0):
    """An interrupt-proof loop (``offset`` 0; otherwise an interrupt-proof blocking wait), a
    syntax error, and test cells duplicated, renamed, re-typed and deleted (with the
    grader-tools cell deleted too).

    Returns (notebook, test cells that must score 0, what was done).
    """
    nb = copy.deepcopy(source)
    cells, test_cells = answers(nb), tests(nb)
    done = []
    # the loop goes into the function the fewest other cells call (each call site that
    # ignores the interrupt costs one time limit and one more run of the notebook)
    candidates = [c for c in cells[2:] or cells if first_function(c.source)]
    loop_cell = min(candidates, key=lambda c: sum(
        first_function(c.source) in _names(other.source)[1] for other in nb.cells
        if other.cell_type == "code"))
    name = first_function(loop_cell.source)
    body = loop_cell.source.split(f"def {name}(", 1)
    head, rest = body[0], body[1]
    signature_end = rest.index(":\n") + 2
    # the loop runs first thing in the function (after its signature and docstring)
    hang = INTERRUPT_PROOF_LOOP if offset == 0 else INTERRUPT_PROOF_WAIT
    loop_cell.source = head + f"def {name}(" + rest[:signature_end] + hang + \
        rest[signature_end:]
    done.append(f"{'loop' if offset == 0 else 'blocking wait'} in {name}")
    broken_cells = {grade_id(loop_cell)}
    # the syntax error goes where it does not keep the loop from being reached
    looping_tests = dependent_tests(source, {grade_id(loop_cell)})
    for cell in cells:
        if cell is not loop_cell and not dependent_tests(source, {grade_id(cell)}) & (
                looping_tests):
            cell.source += "\n\ndef broken(:\n    pass\n"
            broken_cells.add(grade_id(cell))
            done.append(f"syntax error in {grade_id(cell)}")
            break
    lost = dependent_tests(source, broken_cells)
    intact = [c for c in test_cells if grade_id(c) not in lost]
    edits = ["delete", "rename", "duplicate", "retype"]
    edits = edits[offset % 4:] + edits[:offset % 4]  # assignments with few tests vary them
    for edit, cell in zip(edits, intact, strict=False):
        done.append(f"{edit} {grade_id(cell)}")
        if edit == "duplicate":
            duplicate = copy.deepcopy(cell)  # Jupyter gives a copied cell an id of its own
            duplicate["id"] = f"{cell.get('id', 'cell')}-copy"[-64:]
            nb.cells.insert(nb.cells.index(cell) + 1, duplicate)
        elif edit == "rename":
            cell.metadata["nbgrader"]["grade_id"] += "-copy"
        elif edit == "retype":
            cell.cell_type = "markdown"
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
        else:
            nb.cells.remove(cell)
    nb.cells.remove(find(nb, "grader-tools"))
    done.append("delete grader-tools")
    return nb, lost, done


def combine_cases(source, cases: list[dict]) -> list[tuple[str, object, set[str]]]:
    """Students built from an assignment's CASES, several cases (on different cells) each."""
    students: list[tuple[list[str], object, set[str], set[str]]] = []
    for case in cases:
        free = [s for s in students if case["cell"] not in s[3]]
        if free:
            names, nb, lost, cells = free[0]
        else:
            names, nb, lost, cells = [], copy.deepcopy(source), set(), set()
            students.append((names, nb, lost, cells))
        find(nb, case["cell"]).source = case["source"]
        names.append(case["name"])
        lost |= set(case["must_fail"])
        cells.add(case["cell"])
    return [("+".join(names), nb, lost) for names, nb, lost, _ in students]

