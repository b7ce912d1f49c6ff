"""The runtime guard: the integrity check's rules, enforced inside the grading kernel.

The integrity check (``integrity.py``) reads the text of a cell; once a cell runs, a library
can do for it what its text may not (``torch._utils._import_dotted_name("sys")``, a pickle
that calls ``exec``, a thread that outlives the cell, an object whose ``__eq__`` lies). This
guard is installed by the grader in every autograded kernel, at its start
(``IPKernelApp.exec_lines``, ``execution.GuardedExecute``), before the setup cell. It is a
``sys.addaudithook`` hook, which Python gives no way to remove, plus a few wrappers and
checks at cell boundaries. A violation raises ``GuardError`` (a ``PermissionError``) in the
student's code, so the test that used it fails normally and costs only its parts.

Whose code is it? Every frame is *trusted* (the instructor's cells: setup, grader tools,
tests, demonstrations, recognised by the fingerprint of their source as IPython compiles
them; Python's and the environment's own files; code the libraries generate) or not (the
student's cells, files written next to the notebook). A rule applies when an untrusted frame
is on the stack: anywhere, or near (the direct caller, or the caller of a library function
the student's code called directly), as each rule says; so a library doing its own work
lazily for a student (importing, compiling its modules, opening its data files) is not
refused.

Refused from student code (audit events):

- imports of modules outside the assignment's allowed ones (``builtins.__import__`` wrapped:
  the importing frame must be trusted, or the module allowed) and of code outside the
  libraries (a ``.py``, ``.pyc`` or extension module written next to the notebook);
- ``exec``/``eval``/``compile`` near the student's code (code generated deeper down while it
  runs counts as the student's from then on), ``marshal.loads`` of anything but library
  bytecode, building code or functions (``code.__new__``, ``function.__new__``);
- frames and tracing: ``sys._getframe`` (by the student's code or by a library function it
  calls directly, e.g. ``inspect.currentframe``), ``sys._current_frames``, ``tb_frame``,
  ``gi_frame``, ``f_code``, ``__code__``, ``sys.settrace``, ``sys.setprofile``,
  ``sys.addaudithook``, ``gc.get_objects``, ``gc.get_referrers``, ``gc.get_referents``;
- unpickling globals (``pickle.find_class``: ``torch.load(weights_only=False)``,
  ``np.load(allow_pickle=True)``), ``ctypes``;
- files: reading outside the working folder, ``/tmp`` and the installation (``/proc``: no),
  writing outside the working folder and ``/tmp``, opening Python code outside the libraries;
- running programs (``subprocess``, ``os.system``, ``os.exec*``, ``os.posix_spawn``,
  ``os.spawn*``); ``os.fork`` stays with the sandbox (its process limit, the stray-process
  stop at each cell's end), the child keeps this guard;
- setting ``__class__``.

Refused from student code (wrappers, installed here; Python 3.11 audits none of these):
threads (``_thread.start_new_thread``), signal handlers and timers (``signal.signal``,
``setitimer``, ``alarm``, ...), ``atexit.register``, ``ctypes.memmove``/``memset``, attribute
writes on modules (every plain module's class becomes ``GuardedModule``, whose
``__setattr__`` and ``__delattr__`` refuse them near the student's code, and below it to a
library writing another package's module outside an import:
``torch.utils._python_dispatch.TorchDispatchMode = Fake`` through a function parameter).
The grader tools (``_grader``) become a frozen object: a class with no instance dictionary
whose metaclass refuses attribute writes.

At cell boundaries (IPython's ``pre_run_cell`` and ``post_run_cell``): before every trusted
cell the setup cell's names, ``_grader`` and ``__builtins__`` are put back, names shadowing
builtins removed, signal handlers and timers reset, ``sys.path`` restored, and a thread of
the student's still running is reported; during a trusted cell each answer function (a
top-level function of the source's answer cells) is wrapped: it may not modify the tensors,
lists and dicts the test passes in, not leave a dispatch or function mode active, and not
return an object of a class defined in the notebook (a Tensor subclass, an object with its
own ``__eq__``, ``__bool__``, ``__float__``, ``__array__``, ...; torch modules, plain named
tuples and the assignment's own classes are fine) or of a library class whose functions the
notebook replaced; ``_grader``'s comparisons refuse such objects and an active mode too.
After every trusted cell the names, the frozen tools and ``_grader.check()`` are verified (an
error in that cell otherwise: the test fails);
after every cell the student's input and AST transformers and event callbacks are removed
from IPython, and the kernel's message handlers are put back.

What it does not close: code that gets hold of arbitrary attributes through a library (a
string-driven ``getattr`` such as ``operator.attrgetter``, reached through a library's module
attributes) can still read and rewrite plain Python objects no audit event covers: the
namespace of the notebook (``function.__globals__``: the hidden tests' variables while a test
runs, or the objects a test creates, such as its operator counter), module and class
dictionaries (``__dict__``), closures, the IPython shell and kernel objects between two of
the guard's checks; memory through numpy's ``as_strided`` (no bounds check) or ctypes
functions called through raw addresses; a dispatch mode the student pops and pushes back
during their call (the tests' operator counts); ``os.fork`` children (contained by the
sandbox, not by this guard).

This file uses the standard library only: the grader passes its source to the kernel, which
cannot see the course folder (``kernel_arguments``).
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import json
import opcode
import os
import sys
import types
import zlib

KERNEL_FILENAME = "<course runtime guard>"
GUARD_GLOBALS = globals()
_MISSING = object()


class GuardError(PermissionError):
    """The student's code did something the grader's runtime guard refuses."""


def fingerprint(source) -> str:
    """As ``integrity.fingerprint``: a short hash of a cell's source, ends stripped."""
    if isinstance(source, bytes):
        source = source.decode("utf-8", "replace")
    return hashlib.sha256(source.strip().encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Grader side: what the kernel is told, and how.
# --------------------------------------------------------------------------------------------
def settings_for(source_nb, rules: dict) -> dict:
    """The guard's settings for one assignment, from its source notebook and rules."""
    import ast

    from . import integrity

    code = [c for c in source_nb["cells"] if c.get("cell_type") == "code"]
    answers, classes = set(), set()
    for cell in code:
        if not integrity._meta(cell).get("solution"):
            continue
        try:
            tree = ast.parse(integrity._source(cell))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                answers.add(node.name)
            elif isinstance(node, ast.ClassDef):
                classes.add(node.name)
    return {
        "trusted": sorted(integrity.trusted_fingerprints(source_nb)),
        "allowed": sorted(set(rules.get("allowed_modules", []))
                          | integrity.ALWAYS_ALLOWED_MODULES),
        "protected": sorted(integrity.setup_names(integrity._source(code[0])) if code else []),
        "answers": sorted(answers),
        "answer_classes": sorted(classes),
    }


def kernel_exec_line(settings: dict) -> str:
    """One line of Python that installs this guard (its source carried inside: the kernel's
    sandbox has no course folder) with ``settings``; ends with ``;`` so IPython shows
    nothing."""
    with open(__file__, encoding="utf-8") as handle:
        source = handle.read()
    payload = base64.b64encode(zlib.compress(json.dumps(
        {"source": source, "settings": settings}).encode())).decode()
    return ("(lambda d, ns: (exec(compile(d['source'], " + repr(KERNEL_FILENAME)
            + ", 'exec', dont_inherit=True), ns), ns['install'](d['settings'])))("
            "__import__('json').loads(__import__('zlib').decompress(__import__('base64')"
            ".b64decode(" + repr(payload) + "))), {'__name__': 'course_runtime_guard'});")


def kernel_arguments(step, nb, resources) -> list[str]:
    """The kernel arguments that install the guard for the notebook ``step`` (a
    ``GuardedExecute``) is about to run, or none: the guard is the run-time half of the
    integrity check, and a course whose steps leave ``IntegrityCheck`` out has neither; no
    source notebook (not nbgrader's autograde), no guard either."""
    from pathlib import Path

    from . import integrity

    steps = step.config.get("Autograde", {}).get("sanitize_preprocessors")
    if steps is not None and not any(getattr(s, "__name__", str(s)).endswith("IntegrityCheck")
                                     for s in steps):
        return []
    if not isinstance(resources, dict) or "nbgrader" not in resources:
        return []
    root, source_path, _ = step._paths(resources)
    if not Path(source_path).is_file():
        return []
    import nbformat

    source_nb = nbformat.read(source_path, as_version=4)
    rules_dir = step.config.get("IntegrityCheck", {}).get("rules_dir", "rules")
    rules = integrity.load_rules(resources["nbgrader"]["assignment"], Path(root) / rules_dir)
    return [f"--IPKernelApp.exec_lines={kernel_exec_line(settings_for(source_nb, rules))}"]


# --------------------------------------------------------------------------------------------
# Kernel side.
# --------------------------------------------------------------------------------------------
IMPORT_NAME = opcode.opmap["IMPORT_NAME"]
HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by Python code (static C types are not)
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".so", ".pth")
# what collections.namedtuple puts in a class (a typing.NamedTuple may be an answer's result)
NAMEDTUPLE_METHODS = {"__new__", "_make", "_replace", "__repr__", "_asdict", "__getnewargs__",
                      "__getstate__"}
# IPython puts these in builtins; they are not Python's
IPYTHON_BUILTINS = {"display", "get_ipython", "__IPYTHON__", "__IPYTHON__active"}
# Attribute reads that hand out frames or code (audited as object.__getattr__)
FRAME_READS = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "gi_code", "cr_code", "ag_code",
               "f_code", "__code__"}
# Audit events refused whenever the student's code is anywhere on the stack
REFUSED_ANYWHERE = {
    "sys._current_frames": "reads the frames of every thread",
    "sys.settrace": "sets a trace function", "sys.setprofile": "sets a profile function",
    "sys.addaudithook": "adds an audit hook",
    "gc.get_objects": "lists the interpreter's objects (gc)",
    "gc.get_referrers": "looks up an object's referrers (gc)",
    "gc.get_referents": "looks up an object's referents (gc)",
    "pickle.find_class": "unpickles a global (pickle, torch.load, np.load)",
    "subprocess.Popen": "starts a program", "os.system": "runs a shell command",
    "os.exec": "runs a program", "os.posix_spawn": "runs a program",
    "os.spawn": "runs a program", "os.forkpty": "starts a process with a terminal",
    "pty.spawn": "runs a program", "_posixsubprocess.fork_exec": "runs a program",
    "_thread.start_new_thread": "starts a thread",
    "sqlite3.enable_load_extension": "loads an sqlite extension",
    "sqlite3.load_extension": "loads an sqlite extension",
}
# Audit events refused when the direct caller is the student's code
REFUSED_FROM_CALLER = {
    "code.__new__": "builds a code object", "function.__new__": "builds a function",
}
# Audit events that write files: (positions of the path arguments)
WRITE_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
    "os.replace": (0, 1), "os.symlink": (0, 1), "os.link": (0, 1), "os.chmod": (0,),
    "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,), "os.chflags": (0,),
    "os.lchflags": (0,), "os.lchmod": (0,), "os.lchown": (0,), "os.mkfifo": (0,),
    "os.mknod": (0,), "os.setxattr": (0,), "os.removexattr": (0,), "shutil.copyfile": (1,),
    "shutil.copymode": (1,), "shutil.copystat": (1,), "shutil.copytree": (1,),
    "shutil.move": (0, 1), "shutil.rmtree": (0,), "shutil.chown": (0,),
    "sqlite3.connect": (0,),
}


class GuardedModule(types.ModuleType):
    """A module whose attributes the student's code may not set or delete."""

    def __setattr__(self, name, value):
        _GUARD.check_module_write(self, name)
        types.ModuleType.__setattr__(self, name, value)

    def __delattr__(self, name):
        _GUARD.check_module_write(self, name)
        types.ModuleType.__delattr__(self, name)


_GUARD = None  # the installed guard (one per kernel)


def install(settings: dict):
    """Install the guard in this kernel (once); returns it."""
    global _GUARD
    if _GUARD is None:
        _GUARD = _Guard(settings)
        _GUARD.start()
    return _GUARD


class _Guard:
    def __init__(self, settings: dict):
        import tempfile
        import threading

        self.trusted = set(settings.get("trusted", []))
        self.allowed = set(settings.get("allowed", []))
        self.protected = set(settings.get("protected", []))
        self.answers = list(settings.get("answers", []))
        self.answer_classes = set(settings.get("answer_classes", []))
        self.workdir = os.path.realpath(os.getcwd())
        self.tmp = os.path.realpath(tempfile.gettempdir())
        prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                    os.path.dirname(os.__file__)}
        prefixes |= {os.path.realpath(p) for p in prefixes}
        self.roots = tuple(sorted(p.rstrip(os.sep) + os.sep for p in prefixes if p))
        readable = ["/usr/", "/etc/fonts/", "/etc/localtime", "/etc/ld.so.cache", "/dev/null",
                    "/dev/urandom", "/dev/random", "/dev/zero", self.workdir + os.sep,
                    self.tmp + os.sep]
        self.readable = self.roots + tuple(readable)
        self.writable = (self.workdir + os.sep, self.tmp + os.sep, "/dev/null")
        self.cells: dict[str, bool] = {}  # file name IPython compiled a cell under -> trusted
        self.code_trust: dict = {}  # code object -> trusted
        self.file_trust: dict[str, bool] = {}
        self.busy: set[int] = set()  # threads inside the hook
        self.get_ident = threading.get_ident
        self.getframe = sys._getframe
        self.original_import = builtins.__import__
        self.modules_seen = 0
        self.import_depth = 0  # nesting of imports in progress (all threads)
        # cell-boundary state
        self.cell_trusted = False
        self.cell_rewritten = False
        self.genuine: dict[str, object] = {}  # protected name -> its value after the setup
        self.frozen = None  # the frozen _grader, its class and class dictionary
        self.frozen_items: dict = {}
        self.genuine_check = None
        self.wrapped: dict[str, tuple] = {}
        self.trusted_shadows: dict[str, object] = {}
        self.type_verdicts: dict = {}  # class -> library_type
        self.handlers = {"compile": self.on_compile, "exec": self.on_exec,
                         "open": self.on_open, "import": self.on_import,
                         "marshal.loads": self.on_marshal, "marshal.load": self.on_marshal,
                         "sys._getframe": self.on_getframe,
                         "sys._getframemodulename": self.on_getframe,
                         "object.__getattr__": self.on_getattr,
                         "object.__setattr__": self.on_setattr,
                         "object.__delattr__": self.on_setattr}
        for event in REFUSED_ANYWHERE:
            self.handlers[event] = self.on_refused_anywhere
        for event in REFUSED_FROM_CALLER:
            self.handlers[event] = self.on_refused_from_caller
        for event in WRITE_EVENTS:
            self.handlers[event] = self.on_write

    # --- whose code ---------------------------------------------------------------------
    def library_path(self, path) -> bool:
        return isinstance(path, str) and path.startswith(self.roots)

    def file_trusted(self, filename: str) -> bool:
        known = self.cells.get(filename)
        if known is not None:
            return known
        trusted = self.file_trust.get(filename)
        if trusted is None:
            if filename.startswith("<"):  # frozen modules, code the libraries generate
                trusted = not filename.startswith("<ipython-input")
            else:
                trusted = self.library_path(filename)
            self.file_trust[filename] = trusted
        return trusted

    def quiet(self) -> bool:
        """Mark this thread as inside the guard (its own frame reads raise audit events);
        False if it already was."""
        ident = self.get_ident()
        if ident in self.busy:
            return False
        self.busy.add(ident)
        return True

    def frame_trusted(self, frame) -> bool:
        entered = self.quiet()
        try:
            return self._frame_trusted(frame)
        finally:
            if entered:
                self.busy.discard(self.get_ident())

    def _frame_trusted(self, frame) -> bool:
        namespace = frame.f_globals
        if namespace is GUARD_GLOBALS:
            return True
        if namespace is not self.user_ns and "__file__" in namespace:
            filename = namespace["__file__"]
            if isinstance(filename, str):  # a module: its file says whose it is
                return self.file_trusted(filename)
        code = frame.f_code
        trusted = self.code_trust.get(code)
        if trusted is None:
            trusted = self.code_trust[code] = self.file_trusted(code.co_filename)
        return trusted

    def untrusted_frame(self, frame):
        """The first frame of the student's code from ``frame`` outwards, or None."""
        entered = self.quiet()
        try:
            while frame is not None:
                if not self._frame_trusted(frame):
                    return frame
                frame = frame.f_back
            return None
        finally:
            if entered:
                self.busy.discard(self.get_ident())

    def caller(self, depth: int):
        """The frame ``depth`` levels above the function that calls this one (1: its
        caller; in the audit hook, the frame that raised the event)."""
        entered = self.quiet()
        try:
            return self.getframe(depth + 1)
        except ValueError:  # no Python frame (an event from C with nothing above)
            return None
        finally:
            if entered:
                self.busy.discard(self.get_ident())

    def where(self, frame) -> str:
        entered = self.quiet()
        try:
            code = frame.f_code
        finally:
            if entered:
                self.busy.discard(self.get_ident())
        name = "the cell" if code.co_name == "<module>" else code.co_name
        return f"{name}, line {frame.f_lineno}"

    def refuse(self, what: str, frame) -> None:
        raise GuardError(f"the grader refuses this: the notebook's code {what} "
                         f"({self.where(frame)}); answers may not do this while they are "
                         "graded")

    # --- the audit hook -----------------------------------------------------------------
    def audit(self, event, args):
        handler = self.handlers.get(event)
        if handler is None:
            if not event.startswith("ctypes."):
                return
            handler = self.on_ctypes
        ident = self.get_ident()
        if ident in self.busy:
            return
        self.busy.add(ident)
        try:
            try:
                frame = self.getframe(1)  # the Python frame that raised the event
            except ValueError:  # raised from C with no Python frame above
                return
            if frame.f_globals is not GUARD_GLOBALS:
                handler(event, args, frame)
        finally:
            self.busy.discard(ident)

    def on_refused_anywhere(self, event, args, frame):
        bad = self.untrusted_frame(frame)
        if bad is not None:
            self.refuse(REFUSED_ANYWHERE[event], bad)

    def on_refused_from_caller(self, event, args, frame):
        if not self.frame_trusted(frame):
            self.refuse(REFUSED_FROM_CALLER[event], frame)

    def on_ctypes(self, event, args, frame):
        bad = self.untrusted_frame(frame)
        if bad is not None:
            self.refuse(f"uses ctypes ({event})", bad)

    def is_ipython_compiler(self, frame) -> bool:
        namespace = frame.f_globals
        return (namespace.get("__name__") == "IPython.core.compilerop"
                and self.library_path(namespace.get("__file__")))

    def is_importlib(self, frame) -> bool:
        entered = self.quiet()
        try:
            return frame.f_code.co_filename.startswith("<frozen importlib")
        finally:
            if entered:
                self.busy.discard(self.get_ident())

    def near_caller(self, frame):
        """The student's frame among ``frame`` and its caller (the student's code, or a
        library function it calls directly), or None."""
        if not self.frame_trusted(frame):
            return frame
        outer = frame.f_back
        if outer is not None and not self.frame_trusted(outer):
            return outer
        return None

    def on_compile(self, event, args, frame):
        source, filename = args
        if self.is_ipython_compiler(frame):
            bad = self.untrusted_frame(frame)
            if bad is not None:
                self.refuse("runs a cell", bad)
            self.record_cell(filename, source)
            return
        if self.library_path(filename) and self.is_importlib(frame):
            return  # a library module compiled for a lazy import
        # exec, eval, compile by the student's code, or by a library function it calls
        # directly (typing.ForwardRef, code.InteractiveInterpreter, ...); a library compiling
        # its own code deeper down (a dataclass defined during a lazy import) is not refused
        bad = self.near_caller(frame)
        if bad is not None:
            self.refuse("compiles code (exec, eval, compile)", bad)

    def record_cell(self, filename, source) -> None:
        """A cell IPython compiles: trusted if its source is one of the instructor's cells;
        a file name that ever held other code stays untrusted."""
        if not isinstance(filename, str):
            return
        old = self.cells.get(filename)
        if isinstance(source, (str, bytes)):
            trusted = fingerprint(source) in self.trusted
            new = trusted if old is None else (old and trusted)
        else:
            new = False if old is None else old
        if new != old:
            self.cells[filename] = new
            for code in [c for c, t in self.code_trust.items() if t and c.co_filename == filename]:
                del self.code_trust[code]

    def on_exec(self, event, args, frame):
        code = args[0] if args else None
        if not isinstance(code, types.CodeType) or self.library_path(code.co_filename):
            return  # not code, or a library module run by a (lazy) import
        bad = self.near_caller(frame)
        if bad is not None:
            self.refuse("executes code (exec, eval)", bad)
        if self.untrusted_frame(frame) is not None and code.co_filename not in self.cells:
            # generated while the student's code runs: whatever it becomes counts as theirs
            self.distrust(code)

    def distrust(self, code) -> None:
        todo = [code]
        while todo:
            item = todo.pop()
            self.code_trust[item] = False
            todo += [c for c in item.co_consts if isinstance(c, types.CodeType)]

    def on_marshal(self, event, args, frame):
        bad = self.untrusted_frame(frame)
        if bad is None:
            return
        if self.is_importlib(frame):
            path = frame.f_locals.get("bytecode_path") or frame.f_locals.get("source_path")
            if self.library_path(path):
                return
        self.refuse("loads code (marshal)", bad)

    def on_import(self, event, args, frame):
        filename = args[1] if len(args) > 1 else None
        if isinstance(filename, str) and not self.library_path(filename):
            bad = self.untrusted_frame(frame)
            if bad is not None:
                self.refuse(f"imports code from {filename}", bad)

    def on_getframe(self, event, args, frame):
        # the student's code, or a library function it calls directly (inspect.currentframe)
        if not self.frame_trusted(frame):
            self.refuse("reads a frame (sys._getframe)", frame)
        outer = frame.f_back
        if outer is not None and not self.frame_trusted(outer):
            self.refuse("reads a frame (sys._getframe, through a library)", outer)

    def on_getattr(self, event, args, frame):
        if len(args) > 1 and args[1] in FRAME_READS and not self.frame_trusted(frame):
            self.refuse(f"reads {args[1]} (frames and code)", frame)

    def on_setattr(self, event, args, frame):
        target = args[0] if args else None
        name = args[1] if len(args) > 1 else None
        if self.frame_trusted(frame):
            return
        if name == "__class__":
            self.refuse("changes the class of an object (__class__)", frame)
        if self.frozen is not None and (target is self.frozen[0] or target is self.frozen[1]):
            self.refuse("changes the grader's tools", frame)

    def path_of(self, value):
        if isinstance(value, int) or value is None:
            return None
        try:
            path = os.fsdecode(value)
        except TypeError:
            return None
        return os.path.realpath(os.path.abspath(path))

    def on_open(self, event, args, frame):
        path = self.path_of(args[0] if args else None)
        if path is None:
            return
        bad = self.untrusted_frame(frame)
        if bad is None:
            return
        mode = args[1] if len(args) > 1 else None
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
            flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
        if path.endswith(CODE_SUFFIXES) and not self.library_path(path):
            self.refuse(f"opens Python code outside the libraries ({path})", bad)
        if writes and not self.under(path, self.writable):
            self.refuse(f"writes {path}, outside its folder and /tmp", bad)
        if not writes and not self.under(path, self.readable):
            self.refuse(f"reads {path}, outside its folder, /tmp and the installation", bad)

    @staticmethod
    def under(path: str, places: tuple) -> bool:
        return path.startswith(places) or (path + os.sep).startswith(places)

    def on_write(self, event, args, frame):
        bad = self.untrusted_frame(frame)
        if bad is None:
            return
        for position in WRITE_EVENTS[event]:
            path = self.path_of(args[position] if len(args) > position else None)
            if path is not None and not self.under(path, self.writable):
                self.refuse(f"changes {path} ({event}), outside its folder and /tmp", bad)

    # --- wrappers -----------------------------------------------------------------------
    def guarded_import(self, name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name:
            namespace = globals if isinstance(globals, dict) else None
            library = (namespace is not None and namespace is not self.user_ns
                       and self.library_path(namespace.get("__file__")))
            if not library and name.partition(".")[0] not in self.allowed:
                frame = self.caller(1)
                # an import statement of the student's code (not a C function it called,
                # such as np.fromfile, importing for itself with the caller's globals)
                if frame is not None and not self.frame_trusted(frame) and self.importing(frame):
                    self.refuse(f"imports {name} (allowed: {', '.join(sorted(self.allowed))})",
                                frame)
        self.import_depth += 1
        try:
            return self.original_import(name, globals, locals, fromlist, level)
        finally:
            self.import_depth -= 1
            # the modules this import loaded are guarded before the importer gets them
            if not self.import_depth and len(sys.modules) != self.modules_seen:
                self.guard_modules()

    def importing(self, frame) -> bool:
        """Whether ``frame`` is at an import statement."""
        entered = self.quiet()
        try:
            code = frame.f_code
            return code.co_code[frame.f_lasti] == IMPORT_NAME
        except (IndexError, AttributeError):
            return True
        finally:
            if entered:
                self.busy.discard(self.get_ident())

    def refusing(self, function, what: str, anywhere: bool = True):
        """``function``, refused to the student's code (anywhere on the stack, or as the
        direct caller)."""
        guard = self

        def guarded(*args, **kwargs):
            frame = guard.caller(1)
            bad = guard.untrusted_frame(frame) if anywhere else (
                frame if frame is not None and not guard.frame_trusted(frame) else None)
            if bad is not None:
                guard.refuse(what, bad)
            return function(*args, **kwargs)

        guarded.__name__ = getattr(function, "__name__", "guarded")
        guarded.__doc__ = getattr(function, "__doc__", None)
        return guarded

    def check_module_write(self, module, name):
        """Refused near the student's code (it, or a library function it calls directly), and
        while the student's code is anywhere below, to a library writing another package's
        module (copy.copy, unittest.mock on the student's behalf); a library setting its
        own state lazily (matplotlib choosing its backend) or during an import is fine."""
        frame = self.caller(2)
        if frame is None or frame.f_globals is GUARD_GLOBALS or self.is_importlib(frame):
            return
        bad = self.near_caller(frame)
        writer = str(frame.f_globals.get("__name__", "")).partition(".")[0]
        target = str(getattr(module, "__name__", "")).partition(".")[0]
        if bad is None and not self.import_depth and writer != target:
            bad = self.untrusted_frame(frame)
        if bad is not None:
            self.refuse(f"changes {getattr(module, '__name__', '?')}.{name}, an attribute of "
                        "a module", bad)

    def guard_modules(self) -> None:
        """Every plain module becomes a GuardedModule (those with their own class keep it);
        ctypes' raw memory functions (no audit event) are refused once ctypes is loaded."""
        ctypes = sys.modules.get("ctypes")
        if ctypes is not None and not getattr(ctypes, "_course_guarded", False):
            for name in ("memmove", "memset"):
                if hasattr(ctypes, name):
                    types.ModuleType.__setattr__(ctypes, name, self.refusing(
                        getattr(ctypes, name), f"writes memory (ctypes.{name})"))
            types.ModuleType.__setattr__(ctypes, "_course_guarded", True)
        for module in list(sys.modules.values()):
            if type(module) is types.ModuleType:
                try:
                    module.__class__ = GuardedModule
                except TypeError:
                    pass
        self.modules_seen = len(sys.modules)

    # --- library types: what a test may receive -----------------------------------------
    def library_type(self, cls) -> bool:
        """A class whose every class is Python's or a library's: static C types, and classes
        found under their name in a library module (or local to a library function) whose
        functions are all library code (none put there by the notebook since)."""
        return all(self.library_class(k) for k in cls.__mro__)

    def library_class(self, klass) -> bool:
        if not klass.__flags__ & HEAPTYPE:
            return True  # a static C type: no Python code in it, and it cannot be changed
        named = self.type_verdicts.get(klass)
        if named is None:
            module = sys.modules.get(getattr(klass, "__module__", None))
            named = module is not None and module is not sys.modules.get("__main__") and (
                self.library_path(getattr(module, "__file__", None)))
            if named:
                found = module
                for part in klass.__qualname__.split("."):
                    found = getattr(found, part, None)
                named = found is klass or "<locals>" in klass.__qualname__
            self.type_verdicts[klass] = named
        return named and self.functions_trusted(klass)

    def functions_trusted(self, klass) -> bool:
        for value in vars(klass).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            code = getattr(value, "__code__", None) if isinstance(
                value, types.FunctionType) else None
            if code is not None and not (self.code_trust.get(code, True)
                                         and self.file_trusted(code.co_filename)):
                return False
        return True

    def allowed_result_type(self, cls) -> bool:
        """What an answer may return: library types, and of the notebook's classes the
        assignment's own classes, torch modules and plain named tuples (typing.NamedTuple,
        with nothing of their own but what namedtuple makes)."""
        if self.library_type(cls):
            return True
        torch = sys.modules.get("torch")
        if torch is not None and issubclass(cls, torch.nn.Module):
            return True
        for klass in cls.__mro__:
            if self.library_class(klass):
                continue
            if klass.__module__ == "__main__" and klass.__name__ in self.answer_classes:
                continue
            own = {k for k, v in vars(klass).items() if callable(v) or isinstance(
                v, (staticmethod, classmethod, property))}
            if not (issubclass(klass, tuple) and hasattr(klass, "_fields")
                    and own <= NAMEDTUPLE_METHODS):
                return False
        return True

    def check_value(self, value, what: str, depth: int = 0) -> None:
        kind = type(value)
        if kind in (int, float, complex, bool, str, bytes, type(None)):
            return
        if depth > 8:
            return
        if not self.allowed_result_type(kind):
            raise GuardError(f"the grader refuses this: {what} is an object of {kind.__qualname__}"
                             ", a class defined in the notebook; answers return tensors, "
                             "numbers and containers of them")
        if isinstance(value, (tuple, list)):
            for item in value[:10_000]:
                self.check_value(item, what, depth + 1)
        elif isinstance(value, dict):
            for key, item in list(value.items())[:10_000]:
                self.check_value(key, what, depth + 1)
                self.check_value(item, what, depth + 1)
        elif getattr(value, "dtype", None) is not None and str(getattr(value, "dtype", "")) == (
                "object") and kind.__module__ == "numpy":
            raise GuardError(f"the grader refuses this: {what} is a numpy array of Python "
                             "objects")

    def mode_depths(self):
        torch = sys.modules.get("torch")
        if torch is None:
            return (0, 0)
        return (torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack())

    def drop_modes(self, depths) -> bool:
        """Pop the modes pushed above ``depths``; True if there were any."""
        torch = sys.modules.get("torch")
        dropped = False
        while torch is not None and torch._C._len_torch_dispatch_stack() > depths[0]:
            torch._C._pop_torch_dispatch_stack(None)
            dropped = True
        while torch is not None and torch._C._len_torch_function_stack() > depths[1]:
            torch._C._pop_torch_function_stack()
            dropped = True
        return dropped

    def checked_comparison(self, function, name: str):
        guard = self

        def compare(*args, **kwargs):
            if guard.mode_depths() != (0, 0):
                raise GuardError(f"the grader refuses this: _grader.{name} called while a "
                                 "dispatch or function mode is active (the answer left one)")
            for value in [*args, *(v for k, v in kwargs.items() if k != "msg")]:
                guard.check_value(value, f"a value compared by _grader.{name}")
            return function(*args, **kwargs)

        compare.__name__ = name
        compare.__doc__ = getattr(function, "__doc__", None)
        compare.__wrapped__ = function
        return compare

    # --- answers: what a test passes in, what it gets back -------------------------------
    def inputs_of(self, args, kwargs):
        """[(object, its state)] for the tensors, lists and dicts a test passes in (and those
        inside its lists, tuples and dicts)."""
        torch = sys.modules.get("torch")
        tensor = torch.Tensor if torch is not None else None
        found, todo, seen = [], [*args, *kwargs.values()], set()
        while todo and len(found) < 1000:
            value = todo.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            kind = type(value)
            if tensor is not None and isinstance(value, tensor):
                found.append((value, self.tensor_state(value)))
            elif kind is list:
                found.append((value, list(value)))
                todo += value[:1000]
            elif kind is dict:
                found.append((value, list(value.items())))
                todo += list(value.values())[:1000]
            elif kind is tuple:
                todo += list(value[:1000])
        return found

    def state_now(self, value):
        kind = type(value)
        if kind is list:
            return list(value)
        if kind is dict:
            return list(value.items())
        return self.tensor_state(value)

    @staticmethod
    def same(before, now) -> bool:
        if isinstance(before, tuple):  # a tensor's state
            return before == now
        return len(before) == len(now) and all(
            (a is b) if not isinstance(a, tuple) else (a[0] == b[0] and a[1] is b[1])
            for a, b in zip(before, now, strict=True))

    @staticmethod
    def tensor_state(t):
        try:
            version = t._version
        except Exception:  # inference tensors have none
            version = None
        state = [version, tuple(t.shape), t.dtype]
        try:
            state += [t.stride(), t.data_ptr()]
            storage = t.untyped_storage()
            size = storage.nbytes()
            if t.device.type == "cpu" and 0 < size <= 256 << 20:
                import ctypes

                view = (ctypes.c_char * size).from_address(storage.data_ptr())
                state.append(hashlib.blake2b(memoryview(view), digest_size=16).digest())
        except Exception:  # sparse, meta, ...: the version counter only
            pass
        return tuple(state)

    def wrap_answer(self, function, name: str):
        guard = self

        def answer(*args, **kwargs):
            before = guard.inputs_of(args, kwargs)
            depths = guard.mode_depths()
            try:
                result = function(*args, **kwargs)
            finally:
                leaked = guard.drop_modes(depths)
            if leaked:
                raise GuardError(f"the grader refuses this: {name} left a dispatch or "
                                 "function mode active")
            for value, state in before:
                if not guard.same(state, guard.state_now(value)):
                    raise GuardError(f"the grader refuses this: {name} modified an input the "
                                     "test passed in (work on copies)")
            guard.check_value(result, f"the result of {name}")
            return result

        answer.__name__ = getattr(function, "__name__", name)
        answer.__qualname__ = getattr(function, "__qualname__", name)
        answer.__doc__ = getattr(function, "__doc__", None)
        answer.__wrapped__ = function
        return answer

    # --- cell boundaries ----------------------------------------------------------------
    def pre_run_cell(self, info=None):
        raw = getattr(info, "raw_cell", "") or ""
        ran = getattr(info, "transformed_cell", None) or raw
        self.cell_trusted = fingerprint(ran) in self.trusted
        self.cell_rewritten = fingerprint(raw) in self.trusted and not self.cell_trusted
        self.restore_shell()
        if not self.cell_trusted:
            return
        problems = self.restore_before_trusted()
        for name in self.answers:
            value = self.user_ns.get(name)
            if callable(value) and not isinstance(value, type) and name not in self.wrapped:
                wrapper = self.wrap_answer(value, name)
                self.wrapped[name] = (value, wrapper)
                self.user_ns[name] = wrapper
        if problems:
            self.report(problems)

    def post_run_cell(self, result=None):
        problems = []
        if self.cell_trusted:
            for name, (original, wrapper) in self.wrapped.items():
                if self.user_ns.get(name) is wrapper:
                    self.user_ns[name] = original
            self.wrapped.clear()
            problems += self.verify_after_trusted()
            self.record_after_trusted()
        if self.cell_rewritten:
            problems.append("this read-only cell was rewritten before it ran (an input "
                            "transformer of the notebook's code)")
        self.guard_modules()
        self.restore_shell()
        if problems:
            self.report(problems)

    def report(self, problems) -> None:
        error = GuardError("the grader's runtime guard: " + "; ".join(problems))
        try:
            self.shell.showtraceback((GuardError, error, None))
        except Exception:  # pragma: no cover - a shell without tracebacks
            sys.stderr.write(f"GuardError: {error}\n")

    def restore_before_trusted(self) -> list[str]:
        import signal

        ns = self.user_ns
        for name, value in self.genuine.items():
            if ns.get(name, _MISSING) is not value:
                ns[name] = value
        for name in list(ns):
            if (name in self.builtin_names and name not in self.initial_names
                    and ns[name] is not self.trusted_shadows.get(name, _MISSING)):
                del ns[name]
        for sig, handler in self.signal_handlers.items():
            try:
                if signal.getsignal(sig) is not handler:
                    self.original_signal(sig, handler)
            except (OSError, ValueError, TypeError):
                pass
        for timer in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF):
            if signal.getitimer(timer) != (0.0, 0.0):
                self.original_setitimer(timer, 0)
        self.original_alarm(0)
        sys.path[:] = self.sys_lists["path"]
        sys.meta_path[:] = self.sys_lists["meta_path"]
        sys.path_hooks[:] = self.sys_lists["path_hooks"]
        if builtins.__import__ is not self.import_wrapper:
            types.ModuleType.__setattr__(builtins, "__import__", self.import_wrapper)
        problems = []
        here = self.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident != here and self.untrusted_frame(frame) is not None:
                problems.append("a thread started by the notebook's code is still running")
        return problems

    def record_after_trusted(self) -> None:
        ns = self.user_ns
        for name in self.protected:
            if name not in self.genuine and name in ns:
                self.genuine[name] = ns[name]
        grader = ns.get("_grader")
        if self.frozen is None and isinstance(grader, types.SimpleNamespace):
            frozen = self.freeze(grader)
            ns["_grader"] = frozen
            self.genuine["_grader"] = frozen
        for name in self.builtin_names & set(ns) - self.initial_names:
            self.trusted_shadows[name] = ns[name]
        for name in ("path", "meta_path", "path_hooks"):  # what the libraries added
            kept = self.sys_lists[name]
            kept += [item for item in getattr(sys, name) if item not in kept and (
                self.library_path(item) if isinstance(item, str) else not self.students(item))]

    def freeze(self, tools):
        """The grader tools as a frozen object: a class without instance dictionary whose
        metaclass refuses attribute writes; its comparisons refuse objects of the notebook's
        classes and active modes."""
        def refuse(cls, name, value=None):
            raise GuardError("the grader refuses this: the grader's tools cannot be changed")

        meta = type("FrozenTools", (type,), {"__setattr__": refuse, "__delattr__": refuse})
        attributes = {"__slots__": (), "__repr__": lambda self: "<grader tools (read-only)>"}
        for key, value in vars(tools).items():
            if key in ("assert_close", "allclose", "equal", "isclose"):
                value = self.checked_comparison(value, key)
            attributes[key] = staticmethod(value) if isinstance(value, types.FunctionType) else (
                value)
        cls = meta("GraderTools", (), attributes)
        frozen = cls()
        self.frozen = (frozen, cls)
        self.frozen_items = dict(cls.__dict__)
        self.genuine_check = tools.check
        return frozen

    def verify_after_trusted(self) -> list[str]:
        problems = []
        ns = self.user_ns
        for name, value in self.genuine.items():
            if ns.get(name, _MISSING) is not value:
                problems.append(f"{name} was rebound while this cell ran")
                ns[name] = value
        if self.frozen is not None:
            cls = self.frozen[1]
            items = dict(cls.__dict__)
            if items.keys() != self.frozen_items.keys() or any(
                    items[k] is not v for k, v in self.frozen_items.items()):
                problems.append("the grader's tools were changed while this cell ran")
                for key in items.keys() - self.frozen_items.keys():
                    type.__delattr__(cls, key)
                for key, value in self.frozen_items.items():
                    if key not in ("__dict__", "__weakref__"):
                        try:
                            type.__setattr__(cls, key, value)
                        except (AttributeError, TypeError):
                            pass
            try:
                self.genuine_check()
            except Exception as error:
                problems.append(f"{type(error).__name__}: {error}")
        return problems

    def snapshot_shell(self) -> None:
        shell = self.shell
        self.shell_lists = []
        for owner, name in [(shell, "input_transformers_cleanup"),
                            (shell, "input_transformers_post"), (shell, "ast_transformers"),
                            (getattr(shell, "input_transformer_manager", None),
                             "cleanup_transforms"),
                            (getattr(shell, "input_transformer_manager", None),
                             "line_transforms"),
                            (getattr(shell, "input_transformer_manager", None),
                             "token_transformers")]:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, list):
                self.shell_lists.append((owner, name, value, list(value)))
        events = getattr(shell, "events", None)
        self.event_lists = {k: (v, list(v)) for k, v in getattr(events, "callbacks", {}).items()}
        self.instances = [(obj, dict(vars(obj))) for obj in
                          (shell, getattr(shell, "kernel", None), events,
                           getattr(shell, "compile", None),
                           getattr(shell, "input_transformer_manager", None))
                          if obj is not None and hasattr(obj, "__dict__")]
        kernel = getattr(shell, "kernel", None)
        handlers = getattr(kernel, "shell_handlers", None)
        self.kernel_handlers = (handlers, dict(handlers)) if isinstance(handlers, dict) else None
        self.sys_lists = {"path": list(sys.path), "meta_path": list(sys.meta_path),
                          "path_hooks": list(sys.path_hooks)}
        self.sys_hooks = {name: getattr(sys, name) for name in
                          ("displayhook", "excepthook", "stdout", "stderr", "stdin")}

    @staticmethod
    def is_method(cls, name: str) -> bool:
        for klass in cls.__mro__:
            if name in vars(klass):
                return isinstance(vars(klass)[name], (types.FunctionType, staticmethod,
                                                      classmethod))
        return False

    def students(self, item) -> bool:
        """An input transformer, AST transformer or event callback of the student's code."""
        function = getattr(item, "__func__", item)
        if isinstance(function, types.FunctionType):
            code = function.__code__
            return not (self.code_trust.get(code, True) and self.file_trusted(code.co_filename))
        if isinstance(item, type):
            return not self.library_type(item)
        return not self.library_type(type(item))

    def restore_shell(self) -> None:
        """IPython's transformers and event callbacks without those of the student's code
        (the libraries' stay: matplotlib's inline backend registers its own); the kernel's
        handlers and the shell's and kernel's instance attributes as at the kernel's start."""
        for owner, name, value, items in self.shell_lists:
            if getattr(owner, name, None) is not value:
                object.__setattr__(owner, name, value)
            if any(self.students(item) for item in value) or any(
                    item not in value for item in items):
                value[:] = [item for item in value if not self.students(item)] + [
                    item for item in items if item not in value]
        events = getattr(self.shell, "events", None)
        for key, (value, items) in self.event_lists.items():
            if events is not None and events.callbacks.get(key) is not value:
                events.callbacks[key] = value
            if any(self.students(item) for item in value) or any(
                    item not in value for item in items):
                value[:] = [item for item in value if not self.students(item)] + [
                    item for item in items if item not in value]
        for obj, attributes in self.instances:
            current = vars(obj)
            for key in [k for k in current if k not in attributes]:
                if self.is_method(type(obj), key):  # a method shadowed on the instance
                    del current[key]
            for key, value in attributes.items():
                if current.get(key, _MISSING) is not value and key in (
                        "events", "compile", "input_transformer_manager", "user_ns",
                        "user_module", "displayhook", "display_pub", "kernel",
                        "shell_handlers", "ast_transformers", "input_transformers_cleanup",
                        "input_transformers_post", "custom_exceptions", "callbacks",
                        "cleanup_transforms", "line_transforms", "token_transformers"):
                    current[key] = value
        if self.kernel_handlers is not None:
            handlers, items = self.kernel_handlers
            if handlers != items:
                handlers.clear()
                handlers.update(items)
        for name, value in self.sys_hooks.items():
            if getattr(sys, name) is not value:
                setattr(sys, name, value)

    # --- start --------------------------------------------------------------------------
    def start(self) -> None:
        import atexit
        import signal

        from IPython import get_ipython

        self.shell = get_ipython()
        self.user_ns = self.shell.user_ns
        self.initial_names = set(self.user_ns)
        self.builtin_names = set(dir(builtins)) - IPYTHON_BUILTINS
        self.genuine["__builtins__"] = self.user_ns.get("__builtins__", builtins)
        # the working folder (and IPython's '') off the import path: a file the notebook
        # writes there never stands in for a library module
        sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.realpath(
            p) != self.workdir]
        # signals and timers, atexit: refused to the student's code
        import _signal

        self.original_signal = _signal.signal
        self.original_setitimer = _signal.setitimer
        self.original_alarm = _signal.alarm
        self.signal_handlers = {}
        for sig in signal.valid_signals():
            if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
                continue  # SIGINT: the grader's interrupt, set by the kernel at every cell
            try:
                self.signal_handlers[sig] = signal.getsignal(sig)
            except (ValueError, OSError):
                pass
        for name in ("signal", "setitimer", "alarm", "siginterrupt", "set_wakeup_fd",
                     "pthread_sigmask", "pthread_kill", "sigwait", "sigtimedwait",
                     "sigwaitinfo"):
            original = getattr(_signal, name, None)
            if original is None:
                continue
            wrapper = self.refusing(original, f"sets signals or timers ({name})")
            setattr(_signal, name, wrapper)
            if getattr(signal, name, None) is original:
                setattr(signal, name, wrapper)
        atexit.register = self.refusing(atexit.register, "registers an exit function (atexit)",
                                        anywhere=False)
        # threads (Python 3.11 raises no audit event for them)
        import _thread
        import threading

        for module, names in ((_thread, ("start_new_thread", "start_new",
                                         "start_joinable_thread")),
                              (threading, ("_start_new_thread", "_start_joinable_thread"))):
            for name in names:
                original = getattr(module, name, None)
                if original is not None:
                    setattr(module, name, self.refusing(original, "starts a thread"))

        # imports
        self.import_wrapper = self.guarded_import
        builtins.__import__ = self.import_wrapper
        # IPython's cell boundaries
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)
        self.snapshot_shell()
        self.guard_modules()
        sys.addaudithook(self.audit)
