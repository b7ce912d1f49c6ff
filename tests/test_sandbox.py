"""The autograding sandbox (assignments/course_tools/sandbox.py), attacked end to end.

A scratch copy of the course grades one small assignment (scaled_dot_product) for students
whose answer to one part (part 4, ``unit_variance_scale``) attacks the grader, and is correct
everywhere else. Every attack uses only what the integrity check allows (torch, numpy,
math), so the sandbox, not the integrity check, is what must stop it:

(a) overwrite the gradebook, (b) overwrite another student's submitted and autograded
notebooks, the release and the source, (c) read the source notebook (solutions, hidden
tests), the gradebook and the rules, (d) download from a server on this machine
(``torch.hub``), (e) a fork bomb (``torch.multiprocessing``) larger than the process limit,
(f) allocate more than the memory limit, (g) print 300 MB, (h) write a file larger than the
file size limit, (i) fill the scratch disk with files each just under that limit, (j) make
more files than the limit on their number (the grader deletes what they wrote: the later
parts keep their points). A student who ships a data file with the notebook and reads it keeps all
the points; one who submits a symbolic link (to the source notebook) is not graded: nbgrader
would copy the file it points to into autograded/ and the feedback.

Each attack answers correctly when it is not stopped, so a sandbox that lets it through
gives that student the part's point and fails the test. Checked for each: the attacked part
scores 0 and every other part its points (gradebook, grade table), the grade command
reports the limit reached, every file of the course folder is unchanged except what the
trusted nbgrader process writes for that student (gradebook rows, autograded/, reports,
grades CSV), no file holds the attack's marker, the server got no request, no process of
the sandbox is left.

The sandbox alone (integrity check bypassed) is attacked too: in a course whose
configuration drops the integrity check, and in a sandboxed kernel driven directly, with
``open``, ``socket``, ``os.fork`` and ``os.kill``.

Needs bubblewrap (``apt-get install -y bubblewrap``): without it these tests fail with that
command, they are never skipped. Cost: about 10 s per student (kernel start with torch).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "assignments"
BIN = Path(sys.executable).parent
NAME = "scaled_dot_product"
ATTACKED = "part4-scale"  # the answer cell each attack replaces, and its test cell
MARK = b"PWNED"  # what the attacks write; their source spells it reversed ("DENWP"[::-1])

sys.path.insert(0, str(COURSE))
from course_tools import bubblewrap, integrity, limits, sandbox  # noqa: E402

# --- the attacks: the body of unit_variance_scale(d, sigma), before its correct return ------
TRY_ALL = '''
def _try_all(actions):
    """Run every action. If none ran without an error, raise the last error."""
    last = None
    for action in actions:
        try:
            action()
            return
        except Exception as error:
            last = error
    raise last
'''

ATTACKS = {
    "a-gradebook": '''
    payload = np.frombuffer(("DENWP"[::-1] + "-gradebook").encode(), dtype=np.uint8)
    targets = ["../../../gradebook.db", "@COURSE@/gradebook.db"]
    _try_all([lambda t=t: payload.tofile(t) for t in targets])
''',
    "b-notebooks": '''
    payload = np.frombuffer(("DENWP"[::-1] + "-notebook").encode(), dtype=np.uint8)
    targets = ["../../../submitted/victim/@NAME@/@NAME@.ipynb",
               "../../victim/@NAME@/@NAME@.ipynb",
               "@COURSE@/submitted/victim/@NAME@/@NAME@.ipynb",
               "@COURSE@/autograded/victim/@NAME@/@NAME@.ipynb",
               "@COURSE@/release/@NAME@/@NAME@.ipynb", "@COURSE@/source/@NAME@/@NAME@.ipynb"]
    _try_all([lambda t=t: payload.tofile(t) for t in targets])
''',
    "c-source": '''
    sources = ["../../../source/@NAME@/@NAME@.ipynb", "@COURSE@/source/@NAME@/@NAME@.ipynb",
               "@COURSE@/gradebook.db", "@COURSE@/rules/@NAME@.json"]
    _try_all([lambda s=s: np.fromfile(s, dtype=np.uint8) for s in sources])
''',
    "d-network": '''
    import torch.hub
    urls = [f"http://{host}:@PORT@/steal" for host in @HOSTS@]
    _try_all([lambda u=u: torch.hub.download_url_to_file(u, "downloaded.bin", progress=False)
              for u in urls])
''',
    "e-forkbomb": '''
    if not _grow(@DEPTH@):  # 2 ** (depth + 1) - 1 processes alive together
        raise RuntimeError("the fork bomb was stopped")
''',
    "f-memory": '''
    hoard = torch.empty(@MEMORY_BYTES@ + 2**30, dtype=torch.uint8)  # untouched: no real memory
    assert hoard.numel() > @MEMORY_BYTES@
''',
    "g-output": '''
    for _ in range(300):
        print("x" * 2**20)  # 300 MB in all
''',
    "h-filesize": '''
    np.zeros(@FILE_BYTES@ + 2**20, dtype=np.uint8).tofile("big.bin")
''',
    "i-diskfill": '''
    block = np.ones(@FILE_BYTES@ - 2**20, dtype=np.uint8)  # each file just under the limit
    for number in range(@DISK_BYTES@ // block.size + 2):
        block.tofile(f"fill{number}.bin")
''',
    "j-manyfiles": '''
    for number in range(@MAX_FILES@ + 100):
        np.zeros(1, dtype=np.uint8).tofile(f"many{number}.bin")
''',
}
# Files planted next to a student's notebook: a link to the source notebook ("linked"), which
# nbgrader would copy into autograded/ and the feedback as the file it points to (so the grade
# command refuses that submission), and a data file the answer of "shipped" reads (the
# sandbox keeps what a student really submitted).
LINKED = '''
def unit_variance_scale(d, sigma):
    """Reads the source notebook through a submitted link, then the correct answer."""
    assert np.fromfile("notes.txt", dtype=np.uint8).size > 0
    return sigma**2 * math.sqrt(d)
'''
SHIPPED = '''
def unit_variance_scale(d, sigma):
    """Reads the data file shipped with the submission, then the correct answer."""
    assert np.fromfile("mydata.bin", dtype=np.uint8).tolist() == [1, 2, 3]
    return sigma**2 * math.sqrt(d)
'''


def _plant(course: Path, student: str, folder: Path) -> None:
    if student == "linked":
        (folder / "notes.txt").symlink_to(course / "source" / NAME / f"{NAME}.ipynb")
    elif student == "shipped":
        (folder / "mydata.bin").write_bytes(bytes([1, 2, 3]))

FORK_BOMB = '''
import torch.multiprocessing as mp


def _node(depth):
    if not _grow(depth):
        raise SystemExit(1)


def _grow(depth):
    """A binary tree of processes that all wait together; False if a fork failed below."""
    if depth == 0:
        reader, writer = mp.Pipe()
        reader.poll(2)  # keep the leaves alive for 2 s
        return True
    children, ok = [], True
    try:
        for _ in range(2):
            child = mp.Process(target=_node, args=(depth - 1,))
            child.start()
            children.append(child)
    except OSError as error:
        print("fork failed:", type(error).__name__, error)
        ok = False
    for child in children:
        child.join()
        ok = ok and child.exitcode == 0
    return ok
'''


def _fill(code: str, course: Path, port: int, hosts: list[str]) -> str:
    settings = sandbox.Sandbox(config=_config(COURSE))
    depth = 1
    while 2 ** (depth + 1) - 1 <= settings.max_processes + 32:  # more than the limit allows
        depth += 1
    for token, value in {"@COURSE@": str(course), "@NAME@": NAME, "@PORT@": str(port),
                         "@HOSTS@": repr(hosts), "@DEPTH@": str(depth),
                         "@MEMORY_BYTES@": str(settings.memory_limit_mb << 20),
                         "@FILE_BYTES@": str(settings.max_file_mb << 20),
                         "@DISK_BYTES@": str(settings.disk_limit_mb << 20),
                         "@MAX_FILES@": str(settings.max_files)}.items():
        code = code.replace(token, value)
    return code


def _attack_source(kind: str, course: Path, port: int, hosts: list[str]) -> str:
    prelude = TRY_ALL + (FORK_BOMB if kind == "e-forkbomb" else "")
    return _fill(prelude + "\n\ndef unit_variance_scale(d, sigma):\n"
                 '    """The attack, then the correct answer."""' + ATTACKS[kind]
                 + "    return sigma**2 * math.sqrt(d)\n", course, port, hosts)


RAW_ATTACKS = {  # integrity check off: anything Python can do
    "part1-moments": '''
import os
def dot_product_moments(d, mu, sigma):
    last = None
    for path in ["@COURSE@/gradebook.db", "../../../gradebook.db",
                 "@COURSE@/submitted/victim/@NAME@/@NAME@.ipynb"]:
        try:
            with open(path, "ab") as handle:
                handle.write(("DENWP"[::-1] + "-raw").encode())
            return float(d * mu**2), float(d * (sigma**4 + 2 * mu**2 * sigma**2))
        except OSError as error:
            last = error
    print(os.listdir("/"), os.getuid())
    raise last
''',
    "part3-simulation": '''
import socket
def simulate_dot_products(d, mu, sigma, num_samples, generator):
    last = None
    for host in @HOSTS@:
        try:
            socket.create_connection((host, @PORT@), timeout=2).close()
            q = mu + sigma * torch.randn((num_samples, d), generator=generator, dtype=torch.float64)
            k = mu + sigma * torch.randn((num_samples, d), generator=generator, dtype=torch.float64)
            scores = (q * k).sum(dim=-1)
            return scores.mean().item(), scores.var().item()
        except OSError as error:
            last = error
    raise last
''',
    "part4-scale": '''
import os, signal
def unit_variance_scale(d, sigma):
    os.kill(os.getpid(), signal.SIGKILL)
    return sigma**2 * math.sqrt(d)
''',
}


# --- helpers ---------------------------------------------------------------------------------
def _config(course: Path):
    from traitlets.config.loader import PyFileConfigLoader

    return PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the gradebook runs `alembic`
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no new files in course_tools/__pycache__
    env["TMPDIR"] = str(tmp)  # the sandboxes' scratch folders: checked empty afterwards
    env["JUPYTERHUB_API_TOKEN"] = "secret-token-of-the-grader"  # must not reach a kernel
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("MPLBACKEND", None)
    return env


def _run(args: list[str], cwd: Path, tmp: Path, check: bool = True):
    result = subprocess.run(args, cwd=cwd, env=_env(tmp), capture_output=True, text=True,
                            timeout=1800)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def _meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def _with_answer(source, grade_id: str, code: str):
    nb = nbformat.from_dict(json.loads(nbformat.writes(source)))
    cells = [c for c in nb.cells if _meta(c).get("grade_id") == f"{grade_id}-solution"]
    assert len(cells) == 1, grade_id
    cells[0].source = code
    return nb


def _tests(source) -> dict[str, float]:
    return {_meta(c)["grade_id"]: float(_meta(c)["points"]) for c in source.cells
            if c.cell_type == "code" and _meta(c).get("grade") and not _meta(c).get("solution")}


def _snapshot(course: Path) -> dict[str, str]:
    return {str(p.relative_to(course)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(course.rglob("*")) if p.is_file()}


def _trusted_output(path: str, students: list[str]) -> bool:
    """Files the trusted nbgrader process writes while grading these students."""
    parts = Path(path).parts
    return (path == "gradebook.db"
            or parts[:1] == ("autograded",) and parts[1] in students
            or parts[:2] == ("grading_reports", NAME) and parts[2] in students
            or path == f"grades/{NAME}.csv")


def _files_with_mark(*folders: Path) -> list[str]:
    return [str(p) for folder in folders for p in folder.rglob("*")
            if p.is_file() and not p.is_symlink() and MARK in p.read_bytes()]


def _sandbox_processes(tmp: Path) -> list[str]:
    """Command lines of processes that still use a scratch folder under ``tmp`` (after up to
    5 s: the processes of a sandbox end with it, but not in the same instant)."""
    for _ in range(50):
        found = _processes_using(tmp)
        if not found:
            return found
        time.sleep(0.1)
    return found


def _processes_using(tmp: Path) -> list[str]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            except OSError:
                continue
            if str(tmp).encode() in cmdline:
                found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


def _table(output: str, student: str) -> str:
    start = output.index(f"== {student} ==")
    end = output.find("\n== ", start + 1)
    return output[start:end if end > 0 else len(output)]


class _Server(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.requests.append(self.path)
        body = b"leaked"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("0.0.0.0", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    hosts = ["127.0.0.1"]
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            hosts.append(address)
    except OSError:
        pass
    yield httpd.server_address[1], hosts, _Server.requests
    httpd.shutdown()


@pytest.fixture(scope="module")
def bwrap():
    """bubblewrap must be installed and able to build a sandbox: fail (never skip) otherwise."""
    if shutil.which("bwrap") is None:
        pytest.fail(f"bubblewrap is not installed: run `{sandbox.INSTALL}` (the grader refuses "
                    "to autograde without it, so these tests cannot run either)")
    try:
        sandbox.Sandbox().check()
    except sandbox.SandboxUnavailable as error:
        pytest.fail(str(error))


def _make_course(root: Path, tmp: Path, *, integrity_check: bool = True) -> Path:
    course = root / "course"
    course.mkdir(parents=True)
    shutil.copy(COURSE / "nbgrader_config.py", course)
    for folder in ("course_tools", "rules"):
        shutil.copytree(COURSE / folder, course / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(COURSE / "source" / NAME, course / "source" / NAME)
    if not integrity_check:  # the sandbox alone
        with (course / "nbgrader_config.py").open("a") as handle:
            handle.write("\nc.Autograde.sanitize_preprocessors = [p for p in "
                         "c.Autograde.sanitize_preprocessors if p is not IntegrityCheck]\n")
    _run([str(BIN / "nbgrader"), "generate_assignment", NAME, "--force"], course, tmp)
    return course


def _grade(course: Path, tmp: Path, students: dict) -> dict:
    for student, nb in students.items():
        folder = course / "submitted" / student / NAME
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / f"{NAME}.ipynb")
        _plant(course, student, folder)
    before = _snapshot(course)
    # the course's own time limit per cell (30 s): a flood of output is cut and drained well
    # within it, even on a busy machine
    result = _run([sys.executable, "-m", "course_tools.grade", NAME], course, tmp, check=False)
    return {"course": course, "before": before, "after": _snapshot(course), "result": result,
            "output": result.stdout + result.stderr, "tmp": tmp,
            "students": [s for s in students if s != "linked"]}  # graded ones


@pytest.fixture(scope="module")
def attacked(bwrap, server, tmp_path_factory):
    """Grade the attacks (integrity check on) and two honest students."""
    port, hosts, _ = server
    root = tmp_path_factory.mktemp("sandbox-course")
    tmp = tmp_path_factory.mktemp("sandbox-tmp")
    course = _make_course(root, tmp)
    source = nbformat.read(course / "source" / NAME / f"{NAME}.ipynb", as_version=4)
    students = {kind: _with_answer(source, ATTACKED, _attack_source(kind, course, port, hosts))
                for kind in ATTACKS}
    students["honest"] = source
    students["shipped"] = _with_answer(source, ATTACKED, SHIPPED)
    students["linked"] = _with_answer(source, ATTACKED, LINKED)
    students["victim"] = source  # graded after the attackers (names are sorted)
    graded = _grade(course, tmp, students)
    graded["source"] = source
    graded["sources"] = {kind: _attack_source(kind, course, port, hosts) for kind in ATTACKS}
    return graded


def _scores(graded) -> dict[str, dict[str, float]]:
    from nbgrader.api import Gradebook

    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    course = graded["course"]
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        return {student: {g.name: g.auto_score for g in
                          gradebook.find_submission_notebook(NAME, NAME, student).grades}
                for student in graded["students"]}


# --- the tests -------------------------------------------------------------------------------
def test_attacks_pass_the_integrity_check():
    """Only torch, numpy and math: the integrity check lets every attack through, so what
    stops them in the tests below is the sandbox."""
    rules = integrity.load_rules(NAME, COURSE / "rules")
    protected = {"math", "np", "plt", "torch"}
    for kind in ATTACKS:
        code = _attack_source(kind, Path("/course"), 8000, ["127.0.0.1"])
        assert integrity.check_source(code, rules, protected) == [], kind
        assert "@" not in code, code  # every placeholder filled
    for code in RAW_ATTACKS.values():  # these the integrity check does reject
        assert integrity.check_source(_fill(code, Path("/c"), 1, ["h"]), rules, protected)


def test_each_attack_costs_only_its_own_part(attacked):
    tests = _tests(attacked["source"])
    scores = _scores(attacked)
    output = attacked["output"]
    for student in attacked["students"]:
        got = {part: scores[student][part] for part in tests}
        lost = {f"{ATTACKED}-test"} if student in ATTACKS else set()
        expected = {part: 0.0 if part in lost else points for part, points in tests.items()}
        assert got == expected, f"{student}: {got}\n{_table(output, student)}"
    # the submission with a link is not graded at all, and says why
    assert attacked["result"].returncode == 1, output[-3000:]
    assert "NOT GRADED: linked (" in output, output[-3000:]
    assert "holds symbolic links (notes.txt)" in _table(output, "linked")
    assert not (attacked["course"] / "autograded" / "linked").exists()


def test_course_folder_unchanged_but_for_the_graders_outputs(attacked):
    before, after = attacked["before"], attacked["after"]
    students = attacked["students"]
    changed = sorted(p for p in before if after.get(p) != before[p])
    assert changed == ["gradebook.db"], changed
    new = sorted(p for p in set(after) - set(before) if not _trusted_output(p, students))
    assert new == [], new
    # the autograded folders hold only what nbgrader put there (the notebook and the files
    # submitted with it): no file the kernel wrote
    autograded = {p for p in after if p.startswith("autograded/")}
    assert {f"autograded/{s}/{NAME}/{NAME}.ipynb" for s in students} <= autograded
    assert {p for p in autograded if not p.endswith(f"/{NAME}.ipynb")} == {
        "autograded/" + p[len("submitted/"):] for p in before if p.startswith("submitted/")
        and not p.endswith(".ipynb") and p.split("/")[1] in students}, sorted(autograded)
    # no file anywhere holds what an attack wrote (its source spells the mark reversed)
    assert _files_with_mark(attacked["course"], attacked["tmp"]) == []
    assert not [p for p in Path("/tmp").iterdir() if MARK.decode() in p.name]


def test_network_is_unreachable(attacked, server):
    _, _, requests = server
    assert requests == [], requests
    assert "tried to use the network" in _table(attacked["output"], "d-network")


def test_limits_are_reported_per_student(attacked):
    output = attacked["output"]
    expected = {
        "e-forkbomb": "process limit",
        "f-memory": "memory limit",
        "g-output": "output limit",
        "h-filesize": "file size limit",
        "i-diskfill": "disk limit: its files took more than",
        "j-manyfiles": "disk limit: it made more than",
    }
    for student, words in expected.items():
        table = _table(output, student)
        assert (f"limit: {ATTACKED}-test: {words}" in table
                or f"stopped: {ATTACKED}-test: {words}" in table), table
    for student in ("honest", "shipped", "victim"):
        assert "limit:" not in _table(output, student)
    assert "sandbox: bubblewrap, no network" in output


def test_output_is_capped(attacked):
    """The printed 300 MB are cut: the autograded notebook stays small and the attacked test
    fails for the output limit (OutputLimitError, or the kernel was stopped for it)."""
    path = attacked["course"] / "autograded" / "g-output" / NAME / f"{NAME}.ipynb"
    limit = _config(COURSE).GuardedExecute.max_output_bytes
    assert path.stat().st_size < 3 * limit + 200_000, path.stat().st_size
    nb = nbformat.read(path, as_version=4)
    test = next(c for c in nb.cells if _meta(c).get("grade_id") == f"{ATTACKED}-test")
    errors = [o for o in test.outputs if o.output_type == "error"]
    assert any(o.ename == "OutputLimitError" or o.ename == "CellStoppedError"
               and "output limit" in o.evalue for o in errors), errors


def test_nothing_is_left_running_or_on_disk(attacked):
    assert _sandbox_processes(attacked["tmp"]) == []
    assert list(attacked["tmp"].iterdir()) == []  # every scratch copy was deleted


def test_sandbox_alone_holds(bwrap, server, tmp_path_factory):
    """Integrity check off: raw open(), socket and os.kill in the answers. The files stay
    unchanged, the network unreachable, a killed kernel costs only its part and is reported
    with the signal; the honest parts (part5) keep their points."""
    port, hosts, requests = server
    root = tmp_path_factory.mktemp("sandbox-alone")
    tmp = tmp_path_factory.mktemp("sandbox-alone-tmp")
    course = _make_course(root, tmp, integrity_check=False)
    source = nbformat.read(course / "source" / NAME / f"{NAME}.ipynb", as_version=4)
    raw = source
    for grade_id, code in RAW_ATTACKS.items():
        raw = _with_answer(raw, grade_id, _fill(code, course, port, hosts))
    graded = _grade(course, tmp, {"raw": raw, "victim": source})
    scores = _scores(graded)
    tests = _tests(source)
    lost = {f"{grade_id}-test" for grade_id in RAW_ATTACKS}
    assert {p: scores["raw"][p] for p in tests} == {
        p: 0.0 if p in lost else v for p, v in tests.items()}, graded["output"][-4000:]
    assert {p: scores["victim"][p] for p in tests} == tests
    table = _table(graded["output"], "raw")
    assert "part4-scale-test: kernel killed by SIGKILL" in table, table
    assert "tried to use the network" in table, table
    changed = sorted(p for p in graded["before"] if graded["after"].get(p) != graded["before"][p])
    assert changed == ["gradebook.db"], changed
    assert not [p for p in set(graded["after"]) - set(graded["before"])
                if not _trusted_output(p, graded["students"])]
    assert _files_with_mark(course, tmp) == []
    assert requests == []
    assert _sandbox_processes(tmp) == [] and list(tmp.iterdir()) == []


def _run_cells(course: Path, workdir: Path, cells: list[str], timeout: int = 20,
               sleeping_cell_timeout: int | None = None):
    """Run cells in one sandboxed kernel (no nbgrader, no integrity check); the notebook.
    ``sleeping_cell_timeout``, if given, is the limit of the cells that call ``time.sleep``
    (the ones a test expects to be interrupted); the others get ``timeout``, long enough
    for a busy machine (a cell of a fraction of a second took over 8 s beside a full
    test run on two cores)."""
    from nbclient import NotebookClient

    def cell_timeout(cell) -> int:
        if sleeping_cell_timeout is not None and "time.sleep" in cell.source:
            return sleeping_cell_timeout
        return timeout

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    config = _config(course)
    client = NotebookClient(nb, timeout_func=cell_timeout, interrupt_on_timeout=True,
                            allow_errors=True,
                            kernel_manager_class=sandbox.SandboxedKernelManager, config=config,
                            resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


def _text(cell) -> str:
    return "".join(o.get("text", "") + o.get("evalue", "") + str(o.get("data", ""))
                   for o in cell.outputs)


def test_sandboxed_kernel_directly(bwrap, tmp_path, monkeypatch):
    """The kernel's view: its own folder only, no secrets, an unprivileged user, a fork bomb
    stopped at the process limit, memory and file size limits, and interrupts still work."""
    course = tmp_path / "course"
    shutil.copytree(COURSE, course, ignore=shutil.ignore_patterns(
        "__pycache__", "release", "submitted", "autograded", "feedback", "exchange"))
    (course / "gradebook.db").write_bytes(b"grades")
    # as nbgrader leaves them: the submitted files copied next to the restored notebook, a
    # submitted link copied as the file it points to
    submitted = course / "submitted" / "someone" / NAME
    submitted.mkdir(parents=True)
    (submitted / "data.txt").write_text("shipped with the submission")
    (submitted / "link.txt").symlink_to(course / "gradebook.db")
    workdir = course / "autograded" / "someone" / NAME
    workdir.mkdir(parents=True)
    (workdir / "data.txt").write_text("shipped with the submission")
    (workdir / "link.txt").write_text("grades")
    (workdir / f"{NAME}.ipynb").write_text("{} hidden tests")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "secret-token-of-the-grader")
    settings = sandbox.Sandbox(config=_config(course))
    before = _snapshot(course)
    nb = _run_cells(course, workdir, [
        "import os; print(sorted(os.listdir('.')), os.getcwd(), os.getuid() != 0)",
        f"print(open({str(course / 'gradebook.db')!r}).read())",
        "print(sorted(os.environ))",
        "open('note.txt', 'w').write('mine'); print(open('note.txt').read())",
        # a fork bomb with os.fork: every child lives 3 s
        "import select\ncount = 0\ntry:\n    while count < 10_000:\n"
        "        if os.fork() == 0:\n            select.select([], [], [], 3)\n"
        "            os._exit(0)\n        count += 1\nexcept OSError as error:\n"
        "    print('stopped at', count, error)",
        # the children that exited are zombies until reaped, and hold their places under the
        # process limit: reaped, they no longer stop numpy's OpenBLAS from starting threads
        "try:\n    while True:\n        os.wait()\nexcept ChildProcessError:\n"
        "    print('kernel alive')",
        f"x = bytearray({settings.memory_limit_mb << 20} + 2**30)",
        f"with open('big.bin', 'wb') as big:\n"
        f"    big.write(bytes({(settings.max_file_mb + 1) << 20}))",
        "import time\ntime.sleep(600)",
        "print('after the interrupt')",
        # matplotlib reads the grader's font list instead of building its own (fc-list)
        "import subprocess\nruns = []\nrun_program = subprocess.check_output\n"
        "def recorded(args, *rest, **options):\n    runs.append(args)\n"
        "    return run_program(args, *rest, **options)\n"
        "subprocess.check_output = recorded\n"
        "from matplotlib import font_manager\n"
        "print('programs run:', runs, 'fonts:', len(font_manager.fontManager.ttflist) > 0)",
    ], timeout=120, sleeping_cell_timeout=8)
    listing, secret, gradebook = _text(nb.cells[0]), _text(nb.cells[2]), nb.cells[1]
    assert "['data.txt']" in listing and f"/home/student/{NAME}" in listing, listing
    assert "True" in listing  # not root inside
    assert gradebook.outputs[0].ename == "FileNotFoundError", _text(gradebook)
    assert "JUPYTERHUB_API_TOKEN" not in secret and "HOME" in secret, secret
    assert "mine" in _text(nb.cells[3])
    bomb = _text(nb.cells[4])
    assert "stopped at" in bomb, bomb
    assert int(bomb.split("stopped at")[1].split()[0]) < settings.max_processes
    assert "kernel alive" in _text(nb.cells[5])
    assert nb.cells[6].outputs[0].ename == "MemoryError"
    assert "File too large" in _text(nb.cells[7])
    # the time limit still works
    assert any(o.get("ename") == "KeyboardInterrupt" for o in nb.cells[8].outputs)
    assert "after the interrupt" in _text(nb.cells[9])
    assert sandbox.matplotlib_font_list(), "the grader has no matplotlib font list to share"
    fonts = nb.cells[10]
    assert _text(fonts).strip() == "programs run: [] fonts: True", _text(fonts)
    assert not [o for o in fonts.outputs if o.get("name") == "stderr"], fonts.outputs
    assert _snapshot(course) == before
    assert list(scratch.iterdir()) == [] and _sandbox_processes(scratch) == []


def test_files_bound_under_tmp_only():
    options = dict(tmp_bytes=1 << 20, devices=[], read_only_paths=[], run_dir="/r",
                   work_dir="/w", workdir_inside="/home/student/x", protected=[], env={})
    args = bubblewrap.bwrap_args([], **options, tmp_files=(("/a/list.json", "/tmp/.c/m/l"),))
    tail = args[args.index("/tmp") + 1:]
    assert tail[:10] == ["--perms", "1777", "--dir", "/tmp/.c", "--perms", "1777", "--dir",
                         "/tmp/.c/m", "--ro-bind-try", "/a/list.json"], tail
    for outside in ("/etc/passwd", "/tmp/../etc/x", "tmp/x"):
        with pytest.raises(ValueError, match="not a path under /tmp"):
            bubblewrap.bwrap_args([], **options, tmp_files=(("/a", outside),))


def test_death_reasons():
    def reason(code, log=""):
        return limits.death_reason(code, log, 4096, 64)

    assert reason(134, "terminate called after std::bad_alloc") == (
        "kernel killed: memory limit (4096 MiB)")
    assert reason(-9).startswith("kernel killed by SIGKILL") and "SIGKILL" in reason(137)
    assert reason(128 + 11) == "kernel killed by SIGSEGV"
    assert reason(128 + 25) == "kernel killed: file size limit (64 MiB)"
    assert reason(3) == "the kernel exited with status 3"


def test_missing_bubblewrap_and_opt_out_are_explicit(tmp_path):
    course = tmp_path / "course"
    course.mkdir()
    shutil.copy(COURSE / "nbgrader_config.py", course)
    shutil.copytree(COURSE / "course_tools", course / "course_tools",
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = course / "nbgrader_config.py"
    text = config.read_text()
    assert "c.Sandbox.enabled = True" in text  # the course's default
    config.write_text(text + "\nc.Sandbox.bwrap = 'no-such-bwrap'\n")
    with pytest.raises(sandbox.SandboxUnavailable, match="apt-get install -y bubblewrap"):
        sandbox.preflight(course)
    old_bwrap = tmp_path / "bwrap"  # a bubblewrap without the options the sandbox needs
    old_bwrap.write_text("#!/bin/sh\necho 'usage: bwrap [OPTIONS...] [--] COMMAND'\n")
    old_bwrap.chmod(0o755)
    with pytest.raises(sandbox.SandboxUnavailable, match="too old .*--disable-userns"):
        sandbox.Sandbox(bwrap=str(old_bwrap)).check()
    # the grade command says so before grading anything
    (course / "submitted" / "someone" / NAME).mkdir(parents=True)
    (course / "release" / NAME).mkdir(parents=True)
    result = _run([sys.executable, "-m", "course_tools.grade", NAME], course, tmp_path,
                  check=False)
    assert result.returncode == 2 and "apt-get install -y bubblewrap" in result.stderr
    config.write_text(text.replace("c.Sandbox.enabled = True", "c.Sandbox.enabled = False")
                      + "\nc.Sandbox.bwrap = 'no-such-bwrap'\n")
    assert "sandbox: OFF" in sandbox.preflight(course).describe()


def test_config_uses_the_sandbox():
    from course_tools.execution import GuardedExecute

    config = _config(COURSE)
    assert config.Sandbox.enabled is True
    assert config.Autograde.autograde_preprocessors[0] is GuardedExecute
    assert GuardedExecute(config=config).kernel_manager_class is sandbox.SandboxedKernelManager
    settings = sandbox.Sandbox(config=config)
    # enough for a kernel with torch (about 300 MiB of data, a dozen threads), bounded
    assert 1024 <= settings.memory_limit_mb <= 16384
    assert 64 <= settings.max_processes <= 4096
