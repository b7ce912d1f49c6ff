"""The runtime guard (assignments/course_tools/runtime_guard.py), in a real kernel.

A kernel is started as the grader starts it (the guard installed through
``IPKernelApp.exec_lines``, ``runtime_guard.kernel_exec_line``), without the sandbox and
without the integrity check, and runs a setup cell, the grader-tools cell, answer cells that
attack the grader through a library (``torch._utils._import_dotted_name`` reaches any module or
attribute whose name is a string: the integrity check cannot see it), and test cells. Each
attack must end in ``GuardError`` (or, for those the guard undoes at the next test, in that
test's failure), honest code must run as usual, and the same attacks in a kernel without the
guard must succeed: the checks here can fail. Plus the grader side: when the grader installs
the guard, and the attack classes tests/cheats/<assignment>.py cover.

Cost: three kernel starts (torch imported in each), about a minute.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "assignments"
sys.path.insert(0, str(COURSE))
from course_tools import integrity, runtime_guard  # noqa: E402

GRADER_TOOLS = (COURSE / "grader_tools.py").read_text(encoding="utf-8")
SETUP = ("import math\n\nimport matplotlib.pyplot as plt\nimport numpy as np\nimport torch\n\n"
         "torch.manual_seed(0)\nnp.random.seed(0)\n")
D = "_dotted = torch._utils._import_dotted_name\n"
LENIENT = ("class _Lenient:\n    def __getattr__(self, name):\n"
           "        return lambda *args, **kwargs: None\n")
# the instructor's test of the answer `double`: a check, a comparison, a reference after
TEST = ("_grader.check()\n_x = torch.arange(3.0)\n_got = double(_x)\n"
        "_grader.assert_close(_got, 2 * _x)\nprint('TEST PASSED')\n")
HONEST = "def double(x):\n    return x * 2\n"
WRONG = "def double(x):\n    return x * 3\n"

# (name, answer cell, what must show: GuardError's message or the next test's error)
ATTACKS = [
    ("import", "import os\n", "imports os"),
    ("frame", D + "_dotted('sys._getframe')(0)\n", "reads a frame"),
    ("frame-through-library", D + "_dotted('inspect.currentframe')()\n", "reads a frame"),
    ("traceback-frame", D + "try:\n    1 / 0\nexcept ZeroDivisionError as error:\n"
     "    _dotted('operator.attrgetter')('__traceback__.tb_frame')(error)\n", "tb_frame"),
    ("gc", D + "_dotted('gc.get_referrers')(torch)\n", "(gc)"),
    ("trace", D + "_dotted('sys.settrace')(None)\n", "trace function"),
    ("exec", D + "_dotted('builtins.exec')('x = 1')\n", "compiles code"),
    ("pickle", D + "class _P:\n    def __reduce__(self):\n"
     "        return (_dotted('builtins.print'), ('unpickled',))\n"
     "torch.save(_P(), 'p.pt')\ntorch.load('p.pt', weights_only=False)\n", "unpickles"),
    ("program", D + "_dotted('subprocess.run')(['true'])\n", "starts a program"),
    ("thread", D + "_dotted('threading.Thread')(target=print).start()\n", "starts a thread"),
    ("signal", D + "_dotted('signal.signal')(_dotted('signal.SIGALRM'), print)\n", "signals"),
    ("atexit", D + "_dotted('atexit.register')(print)\n", "exit function"),
    ("read-outside", "np.fromfile('/proc/self/maps', dtype=np.uint8)\n", "reads /proc"),
    ("write-outside", "np.zeros(2).tofile('/usr/written.bin')\n", "writes /usr"),
    ("write-code", "np.zeros(2).tofile('module.py')\n", "opens Python code"),
    ("module-attribute", "def _replace(module):\n    module.TorchDispatchMode = None\n"
     "_replace(torch.utils._python_dispatch)\n", "an attribute of a module"),
    ("module-attribute-copy", D + "class _R:\n    def __reduce_ex__(self, protocol):\n"
     "        return (_dotted('builtins.setattr'), (torch.testing, 'assert_close', print))\n"
     "_dotted('copy.copy')(_R())\n", "an attribute of a module"),
    ("builtins-attribute", D + "_dotted('builtins.setattr')(_dotted('builtins'), 'abs', None)\n",
     "builtins.abs"),
    ("grader-tools", D + "_dotted('builtins.setattr')(type(_dotted('__main__._grader')), "
     "'check', print)\n", "cannot be changed"),
    ("memory", D + "_dotted('ctypes.memmove')(0, 0, 0)\n", "writes memory"),
    # undone by the guard at the next test: the wrong answer is then caught
    ("rebind-grader", LENIENT + WRONG + D + "_dotted('builtins.setattr')(_dotted('__main__'), "
     "'_gra' + 'der', _Lenient())\n", "TEST:AssertionError"),
    ("rebind-builtins", WRONG + "__builtins__ = {'print': print}\n", "TEST:AssertionError"),
    ("ipython-callback", LENIENT + WRONG + D + "def _rebind(*args):\n"
     "    _dotted('builtins.setattr')(_dotted('__main__'), '_gra' + 'der', _Lenient())\n"
     "_dotted('IPython.get_ipython')().events.register('pre_run_cell', _rebind)\n",
     "TEST:AssertionError"),
    # what the answers give back, and do to what the tests give them
    ("lying-tensor", "class _Liar(torch.Tensor):\n    pass\ndef double(x):\n"
     "    return (x * 3).as_subclass(_Liar)\n", "TEST:GuardError"),
    ("modifies-input", "def double(x):\n    x.zero_()\n    return x * 2\n", "TEST:GuardError"),
    ("modifies-input-numpy", "def double(x):\n    x.numpy()[:] = 0\n    return x * 2\n",
     "TEST:GuardError"),
    ("leaves-mode", "from torch.utils._python_dispatch import TorchDispatchMode\n"
     "class _Mode(TorchDispatchMode):\n"
     "    def __torch_dispatch__(self, func, kinds, args=(), kwargs=None):\n"
     "        return func(*args, **(kwargs or {}))\n"
     "def double(x):\n    _Mode().__enter__()\n    return x * 2\n", "TEST:GuardError"),
]


def _settings(trusted: list[str]) -> dict:
    return {"trusted": sorted(integrity.fingerprint(c) for c in [SETUP, GRADER_TOOLS, *trusted]),
            "allowed": ["__future__", "math", "numpy", "torch", "typing"],
            "protected": ["math", "np", "plt", "torch"], "answers": ["double"],
            "answer_classes": []}


def _run(cells: list[str], tmp_path: Path, guarded: bool = True):
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c)
                                         for c in [SETUP, GRADER_TOOLS, *cells]])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    arguments = ([f"--IPKernelApp.exec_lines={runtime_guard.kernel_exec_line(_settings([TEST]))}"]
                 if guarded else [])
    workdir = tmp_path / ("guarded" if guarded else "plain")
    workdir.mkdir()
    NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3",
                   extra_arguments=arguments,
                   resources={"metadata": {"path": str(workdir)}}).execute()
    return nb.cells[2:]


def _text(cell) -> str:
    return "".join(o.get("text", "") + (f"{o.ename}: {o.evalue}" if o.output_type == "error"
                                        else "") for o in cell.outputs)


def _cells() -> list[str]:
    """Every attack followed by the test (and an honest answer to start each over), then
    honest code the guard must let through."""
    cells = [HONEST, TEST]
    for _, attack, _ in ATTACKS:
        cells += [attack, TEST, HONEST]
    cells += [
        "from __future__ import annotations\nfrom typing import Optional\n"
        "def double(x: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:\n"
        "    out = x.clone()\n    out.mul_(2)  # in place on its own copy: fine\n"
        "    return out\n",
        TEST,
        "np.save('mine.npy', np.arange(3))\nprint(np.load('mine.npy').sum())\n"
        "torch.save({'w': torch.ones(2)}, 'mine.pt')\nprint(torch.load('mine.pt')['w'].sum())\n"
        "with open('notes.txt', 'w') as handle:\n    handle.write('mine')\n",
        "import torch.nn.functional as F\nprint(F.softmax(torch.zeros(2), dim=0))\n",
        "plt.figure()\n_ = plt.plot([1, 2])\nplt.close('all')\n",  # matplotlib sets its backend
        # numpy's C code imports os for itself, with the caller's globals
        "def _round_trip():\n    np.arange(3.0).tofile('a.bin')\n    return np.fromfile('a.bin')\n"
        "print(_round_trip().sum())\n",
    ]
    return cells


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    return _run(_cells(), tmp_path_factory.mktemp("runtime-guard"))


def test_honest_answers_pass(guarded):
    assert "TEST PASSED" in _text(guarded[1]), _text(guarded[1])
    tail = guarded[-6:]
    assert all(o.output_type != "error" for cell in tail for o in cell.outputs), [
        _text(c) for c in tail]
    assert "TEST PASSED" in _text(tail[1])
    assert "3" in _text(tail[2]) and "2." in _text(tail[2])
    assert "3.0" in _text(tail[5])


@pytest.mark.parametrize("index", range(len(ATTACKS)), ids=[a[0] for a in ATTACKS])
def test_attack_is_refused(guarded, index):
    name, _, expected = ATTACKS[index]
    attack, test, honest = guarded[2 + 3 * index: 5 + 3 * index]
    assert "GuardError" not in _text(honest), (name, _text(honest))
    if expected.startswith("TEST:"):
        assert expected[5:] in _text(test) and "TEST PASSED" not in _text(test), (
            name, _text(attack), _text(test))
    else:
        assert "GuardError" in _text(attack) and expected in _text(attack), (name, _text(attack))


def test_attacks_succeed_without_the_guard(tmp_path):
    """The same kernel without the guard: the attacks the tests above see refused go through
    (a lenient _grader passes a wrong answer, a lying tensor or a zeroed input pass the
    comparison, the module attribute is replaced, the frame and the thread are had)."""
    attacks = {name: attack for name, attack, _ in ATTACKS}
    chosen = {name: attacks[name] for name in (  # the lenient _grader last: it stays
        "frame", "gc", "thread", "module-attribute", "lying-tensor", "modifies-input",
        "rebind-grader")}
    cells = []
    for attack in chosen.values():
        cells += [attack + "\nprint('ATTACK RAN')\n", TEST, HONEST]
    plain = _run(cells, tmp_path, guarded=False)
    for position, name in enumerate(chosen):
        attack, test = plain[3 * position], plain[3 * position + 1]
        assert "ATTACK RAN" in _text(attack), (name, _text(attack))
        if name in ("rebind-grader", "modifies-input"):
            assert "TEST PASSED" in _text(test), (name, _text(test))


def test_the_grader_installs_the_guard_with_the_integrity_check_only(tmp_path):
    from traitlets.config import Config

    class Step:  # what kernel_arguments reads of GuardedExecute
        def __init__(self, config):
            self.config = config

        def _paths(self, resources):
            name = resources["nbgrader"]["assignment"]
            return COURSE, COURSE / "source" / name / f"{name}.ipynb", None

    resources = {"nbgrader": {"assignment": "argmax_attention", "notebook": "argmax_attention"}}
    config = Config()
    arguments = runtime_guard.kernel_arguments(Step(config), None, resources)
    assert len(arguments) == 1 and arguments[0].startswith("--IPKernelApp.exec_lines=")
    assert arguments[0].rstrip().endswith(";")  # IPython shows nothing
    source = nbformat.read(COURSE / "source" / "argmax_attention" / "argmax_attention.ipynb", 4)
    settings = runtime_guard.settings_for(source, integrity.load_rules(
        "argmax_attention", COURSE / "rules"))
    assert settings["answers"] == ["argmax_attention", "argmax_attention_grads",
                                   "attention_scores", "softmax_attention_beta"]
    assert set(settings["protected"]) == {"math", "np", "plt", "torch"}
    assert {"torch", "typing", "__future__"} <= set(settings["allowed"])
    assert integrity.fingerprint(GRADER_TOOLS) in settings["trusted"]
    # a course whose steps leave the integrity check out gets no guard; nor does a notebook
    # nbgrader does not autograde
    config.Autograde.sanitize_preprocessors = [type("ClearOutput", (), {})]
    assert runtime_guard.kernel_arguments(Step(config), None, resources) == []
    assert runtime_guard.kernel_arguments(Step(Config()), None, {}) == []


ATTACK_CLASSES = {
    "binding": "every form of name binding used to rebind grader names, checkers, modules "
               "or builtins, and syntax that hid a cell from the check",
    "lying-objects": "objects whose truth value, comparison or conversion lies, modes",
    "deserialisation": "code run by unpickling data the notebook wrote",
    "test-objects": "tampering with what the tests pass in or call, re-running the grader "
                    "tools",
    "read-hidden": "reading the hidden tests' values from frames, tracing, gc",
    "leak-output": "output carrying hidden values",
    "background": "threads, signal handlers, exit functions acting after the answer cell",
}


def _cases(name):
    path = ROOT / "tests" / "cheats" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"cheats_{name}_guard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


def test_cheat_files_cover_every_attack_class():
    cases = [case for name in ("argmax_attention", "purification", "scaled_dot_product")
             for case in _cases(name)]
    covered = {case["attacks"] for case in cases if "attacks" in case}
    assert covered == set(ATTACK_CLASSES), covered ^ set(ATTACK_CLASSES)
    for case in cases:
        if "attacks" in case:  # an attack loses what it aims at
            assert case["must_fail"], case["name"]
    honest = [case for case in cases if case["name"].startswith("honest-")]
    assert len(honest) >= 3 and all(not case["must_fail"] for case in honest)


def test_guard_error_keeps_its_name_in_hidden_test_feedback():
    """The feedback of a hidden test shows only the error's type, and only a known one (else
    "Exception"): the guard's refusal must show as GuardError, as the student's message says."""
    from course_tools import preprocessors

    hidden = nbformat.v4.new_code_cell(
        "_grader.check()\n### BEGIN HIDDEN TESTS\nassert double(1) == 2\n### END HIDDEN TESTS\n",
        metadata={"nbgrader": {"grade": True, "solution": False, "grade_id": "t", "points": 1}})
    for error in (runtime_guard.GuardError, integrity.IntegrityError, KeyError):
        hidden.outputs = [nbformat.v4.new_output(
            "error", ename=error.__name__, evalue="secret", traceback=["secret"])]
        nb = nbformat.v4.new_notebook(cells=[copy.deepcopy(hidden)])
        nb, _ = preprocessors.HideHiddenTestOutputs().preprocess(nb, {})
        (output,) = nb.cells[0].outputs
        assert output.ename == error.__name__ and "secret" not in str(output), output
    hidden.outputs = [nbformat.v4.new_output(
        "error", ename="SecretValue42", evalue="", traceback=[])]  # a student's own class
    nb, _ = preprocessors.HideHiddenTestOutputs().preprocess(
        nbformat.v4.new_notebook(cells=[hidden]), {})
    assert nb.cells[0].outputs[0].ename == "Exception"
