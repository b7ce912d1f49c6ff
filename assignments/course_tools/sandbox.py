"""The sandbox in which autograding runs a submission: bubblewrap (``bwrap``) around the kernel.

At autograde, nbgrader starts one Jupyter kernel per submitted notebook and runs the
student's code in it. ``SandboxedKernelManager`` (the kernel manager of ``GuardedExecute``,
``course_tools/execution.py``) starts that kernel inside a bubblewrap sandbox:

- **files**: the kernel sees a filesystem built from an allow-list: ``/usr`` (and the
  ``/bin``, ``/lib*`` links), a few files of ``/etc``, the Python installation and the
  environment read-only, a fresh ``/proc`` and minimal ``/dev``, a private size-limited
  ``/tmp`` (also ``HOME``; in it, read-only, the grader's matplotlib font list, which spares
  each kernel building it), and one writable folder: a scratch copy of this submission's
  folder (every file but the notebooks, which hold the hidden tests once nbgrader restored
  them, and what nbgrader copied through a submitted symbolic link), at
  ``/home/student/<assignment>``, its working directory. The course folder, the
  gradebook, ``source/``, ``rules/``, other submissions and the home directories are not in
  it. What the kernel writes stays in the scratch copy, which is deleted afterwards: the
  trusted nbgrader process keeps only the outputs it received and writes every grade.
- **network**: none (a new, empty network namespace). The kernel talks to nbgrader over
  Unix sockets (ZeroMQ ``ipc`` transport) in a private folder bound into the sandbox.
- **processes**: new PID, IPC, UTS and cgroup namespaces; the sandbox dies with its parent.
- **limits** (``setrlimit`` before the kernel starts, hard limits it cannot raise): memory
  (``RLIMIT_DATA``: heap and private mappings; ``RLIMIT_AS`` would also count the address
  space torch reserves without using it), processes and threads (``RLIMIT_NPROC``: a fork
  bomb stops there), size of any file written (``RLIMIT_FSIZE``), no core files. The cap on
  printed output is enforced by the trusted side (``GuardedExecute.max_output_bytes``).
- **identity**: run by an unprivileged account, bubblewrap makes a user namespace (the
  process limit then counts only the sandbox's processes) and forbids nested ones. Run as
  root (CI, containers), it builds the sandbox as root, then the kernel drops to the
  unprivileged ``Sandbox.uid`` (by default a fresh id per kernel, which no other process
  shares), so that the process limit applies (root is exempt from it) and root's rights do
  not reach the kernel.

Settings are ``c.Sandbox.<name>`` in ``nbgrader_config.py``. ``c.Sandbox.enabled = False`` is
the only way to grade without the sandbox (for machines without user namespaces); it is
never a silent fallback: a missing ``bwrap`` is an error naming the command that installs it.
``nbgrader validate`` (students', and the source checks) does not use the sandbox.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager
from traitlets import Bool, Integer, List, Unicode, default
from traitlets.config import Configurable

from .bubblewrap import (
    MIB,
    SandboxUnavailable,
    bwrap_args,
    chown_tree,
    copy_submission,
    kernel_env,
    namespace_args,
    regular_file,
    remove_tree,
)
from .channels import CappedKernelClient
from .limits import death_reason, sandbox_processes

INSTALL = "apt-get install -y bubblewrap"
WORKDIR_PARENT = "/home/student"
FRESH_UIDS, FRESH_UIDS_SPAN = 1 << 31, 1 << 24  # ids no account uses
REQUIRED_OPTIONS = ("--disable-userns", "--size", "--perms", "--remount-ro", "--clearenv")

# Runs inside the sandbox, before the kernel: hard limits, SIGINT back to its default (the
# wrapper ignores it so that an interrupt reaches only the kernel), and, when the sandbox was
# built by root, the switch to the unprivileged account. Then it becomes the kernel (exec).
LAUNCHER = """\
import json, os, resource, signal, sys
spec = json.loads(sys.argv[1])
for name, value in spec["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
signal.signal(signal.SIGINT, signal.SIG_DFL)
if os.getuid() == 0:
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    if os.getuid() == 0 or os.geteuid() == 0:
        sys.exit("sandbox: could not drop root")
os.execv(sys.argv[2], sys.argv[2:])
"""


class Sandbox(Configurable):
    """Settings of the autograding sandbox (``c.Sandbox.<name>`` in nbgrader_config.py)."""

    enabled = Bool(True, help=(
        "Run every autograded notebook in the bubblewrap sandbox. Set False only on a machine "
        "where user namespaces are unavailable: the student's code then runs with your rights "
        "and can read and write the course folder.")).tag(config=True)
    bwrap = Unicode("bwrap", help="The bubblewrap executable (name or path).").tag(config=True)
    memory_limit_mb = Integer(4096, help=(
        "RLIMIT_DATA of the kernel in MiB (heap and private mappings; a kernel with torch "
        "imported uses about 300).")).tag(config=True)
    max_processes = Integer(256, help=(
        "RLIMIT_NPROC: processes and threads in the sandbox (the kernel uses about 10 plus "
        "torch's, one per core: raise it on machines with more than about 100 cores)."
        )).tag(config=True)
    max_file_mb = Integer(64, help="RLIMIT_FSIZE: largest file the kernel may write, in MiB."
                          ).tag(config=True)
    tmp_size_mb = Integer(256, help="Size of the sandbox's private /tmp (also HOME), in MiB."
                          ).tag(config=True)
    disk_limit_mb = Integer(512, help=(
        "Scratch disk of one kernel in MiB: what the files it writes in its working folder "
        "(and the folder of its sockets) may take together, checked while each cell runs "
        "(several times a second: a cell writing faster may pass it by a fraction of a "
        "second of writes); past it the cell is interrupted. /tmp is limited by "
        "tmp_size_mb.")).tag(config=True)
    max_files = Integer(10000, help=(
        "Files and folders the kernel may have in its working folder (and the folder of its "
        "sockets), checked with disk_limit_mb.")).tag(config=True)
    uid = Integer(-1, help=(
        "User id of the kernel when grading runs as root. -1 (default): a fresh, unused id "
        "per kernel, from 2**31 on, so that no other process counts against its process "
        "limit (RLIMIT_NPROC counts per user) and no two sandboxes share one.")
        ).tag(config=True)
    read_only_paths = List(Unicode(), help=(
        "More host folders the kernel may read (e.g. a data set), bound read-only at the "
        "same path.")).tag(config=True)
    devices = List(Unicode(), help=(
        "Device nodes passed into the sandbox, e.g. ['/dev/nvidia0', '/dev/nvidiactl', "
        "'/dev/nvidia-uvm'] to grade on a GPU (none by default: grading runs on CPU)."
        )).tag(config=True)

    def kernel_uid(self) -> int:
        """The user id (and group id) of one kernel started by root."""
        return self.uid if self.uid >= 0 else FRESH_UIDS + secrets.randbelow(FRESH_UIDS_SPAN)

    def limits(self) -> dict[str, int]:
        return {"RLIMIT_DATA": self.memory_limit_mb * MIB, "RLIMIT_NPROC": self.max_processes,
                "RLIMIT_FSIZE": self.max_file_mb * MIB, "RLIMIT_CORE": 0}

    def describe(self) -> str:
        if not self.enabled:
            return ("sandbox: OFF (c.Sandbox.enabled = False): student code runs with your "
                    "rights")
        return (f"sandbox: bubblewrap, no network, memory {self.memory_limit_mb} MiB, "
                f"{self.max_processes} processes, files {self.max_file_mb} MiB, "
                f"/tmp {self.tmp_size_mb} MiB, scratch disk {self.disk_limit_mb} MiB and "
                f"{self.max_files} files in all")

    def executable(self) -> str:
        found = shutil.which(self.bwrap)
        if not found:
            raise SandboxUnavailable(
                f"bubblewrap ({self.bwrap!r}) is not installed, and autograding runs student "
                f"code only inside its sandbox. Install it with `{INSTALL}` (Debian/Ubuntu), "
                "or see 'Sandboxed autograding' in assignments/README.md.")
        return found

    def check(self) -> None:
        """Build a sandbox like a kernel's once and run ``true`` in it; raise
        SandboxUnavailable with the reason if bubblewrap is missing, too old or refused."""
        if not self.enabled:
            return
        bwrap = self.executable()
        options = subprocess.run([bwrap, "--help"], capture_output=True, text=True).stdout
        missing = [o for o in REQUIRED_OPTIONS if o not in options]
        if missing:
            raise SandboxUnavailable(
                f"this bubblewrap is too old (it lacks {', '.join(missing)}; version 0.8 or "
                f"later is needed): upgrade it (`{INSTALL}` on Debian 12, Ubuntu 24.04 or "
                "later)")
        with tempfile.TemporaryDirectory(prefix="ea-sandbox-check-") as box:
            run_dir, work_dir = Path(box) / "run", Path(box) / "work"
            run_dir.mkdir()
            work_dir.mkdir()
            args = bwrap_args(self.namespace_args(), tmp_bytes=self.tmp_size_mb * MIB,
                              devices=self.devices, read_only_paths=self.read_only_paths,
                              run_dir=str(run_dir), work_dir=str(work_dir),
                              workdir_inside=f"{WORKDIR_PARENT}/check", protected=[], env={})
            result = subprocess.run([bwrap, *args, "--", "true"], capture_output=True, text=True)
        if result.returncode != 0:
            raise SandboxUnavailable(
                f"bubblewrap cannot create its sandbox here: {result.stderr.strip()}. It needs "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 on "
                "Debian/Ubuntu kernels that have it, kernel.apparmor_restrict_unprivileged_userns"
                "=0 on Ubuntu 24.04, user.max_user_namespaces > 0; Docker's default seccomp "
                "profile blocks them) or root. See 'Sandboxed autograding' in "
                "assignments/README.md; set c.Sandbox.enabled = False only to grade without it.")

    @staticmethod
    def as_root() -> bool:
        return os.geteuid() == 0

    def namespace_args(self) -> list[str]:
        return namespace_args(self.as_root())


@functools.cache
def matplotlib_font_list() -> tuple[tuple[str, str], ...]:
    """The grader's matplotlib font list (``fontlist-v<N>.json``; importing
    ``matplotlib.font_manager`` builds it if missing) and where the kernel's matplotlib looks
    for it (``$HOME/.cache/matplotlib``, ``HOME`` being ``/tmp``): bound there read-only, it
    spares every kernel building the list again (``fc-list`` and a read of every font file,
    about 0.6 s of CPU per notebook). Nothing (no binding) where matplotlib is missing."""
    try:
        import matplotlib
        from matplotlib import font_manager
    except ImportError:
        return ()
    version = font_manager.FontManager.__version__
    path = Path(matplotlib.get_cachedir()) / f"fontlist-v{version}.json"
    if not path.is_file():
        return ()
    return ((str(path), f"/tmp/.cache/matplotlib/{path.name}"),)


class SandboxedKernelManager(AsyncKernelManager):
    """A kernel manager that starts the kernel inside the bubblewrap sandbox.

    The kernel's working directory (``cwd``, nbgrader's ``autograded/<student>/<assignment>``)
    is copied, without its notebooks and without what nbgrader copied through a submitted
    symbolic link, into a scratch folder that becomes the sandbox's only writable folder;
    the copy is deleted when the kernel is cleaned up.
    """

    _checked = False  # Sandbox.check() passed in this process

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.max_message_bytes = 2 * MIB  # GuardedExecute sets its output limit here
        self.sandbox = Sandbox(parent=self)
        self.box: Path | None = None
        self.exit_status: int | None = None
        self.log_tail = ""
        self._process = None
        self._log = None
        self.submitted_files: set[str] = set()  # of the scratch copy, before the kernel ran

    def submission_filter(self, folder: str | None):
        """Which files of nbgrader's ``autograded/<student>/<assignment>`` folder the kernel
        gets: those the student submitted as regular files, and those of the assignment's
        source folder. nbgrader copies a submitted symbolic link as the file it points to,
        read with the grader's rights (say, to ``source/<assignment>/<assignment>.ipynb``):
        that copy stays out of the sandbox. None (every file) outside nbgrader's layout."""
        from nbgrader.coursedir import CourseDirectory

        if not folder:
            return None
        coursedir, path = CourseDirectory(parent=self), Path(folder).resolve()
        student, assignment = path.parent.name, path.name
        autograded = coursedir.format_path(coursedir.autograded_directory, student, assignment)
        if Path(autograded).resolve() != path:
            return None
        submitted = coursedir.format_path(coursedir.submitted_directory, student, assignment)
        source = coursedir.format_path(coursedir.source_directory, ".", assignment)
        return lambda relative: (regular_file(submitted, relative)
                                 or regular_file(source, relative))

    def protected_folders(self) -> list[str]:
        from nbgrader.coursedir import CourseDirectory

        coursedir = CourseDirectory(parent=self)
        folders = [coursedir.root]
        if coursedir.db_url.startswith("sqlite:///"):
            folders.append(os.path.dirname(coursedir.db_url[len("sqlite:///"):]))
        return [os.path.abspath(f) for f in folders if f]

    async def _async_pre_start_kernel(self, **kw):
        if not self.sandbox.enabled:
            self.log.warning("SANDBOX DISABLED (c.Sandbox.enabled = False): the submission "
                             "runs with the grader's rights")
            return await super()._async_pre_start_kernel(**kw)
        if not SandboxedKernelManager._checked:  # once per grading process: a clear error
            self.sandbox.check()
            SandboxedKernelManager._checked = True
        bwrap = self.sandbox.executable()
        source = kw.get("cwd")
        self.box = Path(tempfile.mkdtemp(prefix="ea-sandbox-"))
        run_dir, work_dir = self.box / "run", self.box / "work"
        run_dir.mkdir()
        copy_submission(source, work_dir, keep=self.submission_filter(source))
        self.submitted_files = {str(p.relative_to(work_dir)) for p in work_dir.rglob("*")}
        uid = self.sandbox.kernel_uid()
        if self.sandbox.as_root():
            chown_tree(run_dir, uid, uid)
            chown_tree(work_dir, uid, uid)
        self.transport = "ipc"
        self.ip = str(run_dir / "kernel")
        self.connection_file = str(run_dir / "kernel.json")
        kw["cwd"] = str(self.box)
        kernel_cmd, kw = await super()._async_pre_start_kernel(**kw)
        os.chmod(self.connection_file, 0o644 if self.sandbox.as_root() else 0o600)
        workdir_inside = f"{WORKDIR_PARENT}/{Path(source).name if source else 'work'}"
        env = kernel_env(kw.get("env") or dict(os.environ), workdir_inside)
        options = bwrap_args(
            self.sandbox.namespace_args(), tmp_bytes=self.sandbox.tmp_size_mb * MIB,
            devices=self.sandbox.devices, read_only_paths=self.sandbox.read_only_paths,
            run_dir=str(run_dir), work_dir=str(work_dir), workdir_inside=workdir_inside,
            protected=self.protected_folders(), env=env, tmp_files=matplotlib_font_list())
        spec = json.dumps({"limits": self.sandbox.limits(), "uid": uid, "gid": uid})
        # sh ignores SIGINT for bwrap (jupyter_client interrupts the whole process group);
        # the launcher restores it for the kernel
        command = ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sandbox", bwrap, *options,
                   "--", sys.executable, "-I", "-S", "-c", LAUNCHER, spec, *kernel_cmd]
        self._log = open(self.box / "kernel.log", "wb")  # noqa: SIM115 (closed at cleanup)
        kw["stdout"] = kw["stderr"] = self._log
        self.log.debug("sandboxed kernel: %s", command)
        return command, kw

    pre_start_kernel = _async_pre_start_kernel

    @default("client_factory")
    def _client_factory_default(self):
        return CappedKernelClient

    @default("shutdown_wait_time")
    def _shutdown_wait_time_default(self):
        # A graded kernel holds nothing worth a graceful exit: one that does not answer the
        # shutdown request (a cell that ignored the interrupt) gets SIGTERM after half of
        # this, SIGKILL after all of it (jupyter_client's default is 5 s).
        return 1.0

    def client(self, **kwargs):
        kwargs.setdefault("max_message_bytes", self.max_message_bytes)
        return super().client(**kwargs)

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        await super()._async_launch_kernel(kernel_cmd, **kw)
        self._process = self.provisioner.process

    _launch_kernel = _async_launch_kernel

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        if self._process is not None:
            self.exit_status = self._process.poll()
        try:
            await super()._async_cleanup_resources(restart=restart)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.box is not None and not restart:
                log = self.box / "kernel.log"
                if log.is_file():
                    with log.open("rb") as handle:
                        handle.seek(max(0, log.stat().st_size - 4096))
                        self.log_tail = handle.read().decode(errors="replace")
                remove_tree(self.box)
                self.box = None

    cleanup_resources = _async_cleanup_resources

    def death_reason(self) -> str:
        return death_reason(self.exit_status, self.log_tail, self.sandbox.memory_limit_mb,
                            self.sandbox.max_file_mb)

    def files_at_limit(self) -> list[str]:
        """Files of the scratch copy that reached the file size limit (the write that went
        past it failed: EFBIG)."""
        if self.box is None:
            return []
        work, limit = self.box / "work", self.sandbox.max_file_mb * MIB
        return sorted(str(p.relative_to(work)) for p in work.rglob("*")
                      if p.is_file() and not p.is_symlink() and p.stat().st_size >= limit)

    def disk_problem(self) -> str | None:
        """Why the files of the sandbox's writable folders (``work``, ``run``) are over the
        scratch disk limits, or None. Counts allocated blocks (a sparse file costs what it
        holds) and stops counting at the first limit passed."""
        if self.box is None:
            return None
        limit_bytes, used, entries = self.sandbox.disk_limit_mb * MIB, 0, 0
        folders = [self.box / "work", self.box / "run"]
        while folders:
            try:
                scan = os.scandir(folders.pop())
            except OSError:
                continue
            with scan:
                for entry in scan:
                    entries += 1
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            folders.append(Path(entry.path))
                        used += entry.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
                    if entries > self.sandbox.max_files:
                        return (f"it made more than {self.sandbox.max_files} files and "
                                "folders (scratch disk limit)")
                    if used > limit_bytes:
                        return (f"its files took more than {self.sandbox.disk_limit_mb} MiB "
                                "of disk in all (scratch disk limit)")
        return None

    def remove_written_files(self) -> None:
        """Delete what the kernel wrote in its writable folders (the scratch disk limit was
        passed): every file and folder of ``work`` that the submission did not bring, and
        every regular file or folder of ``run`` but the connection file (the kernel's
        sockets stay)."""
        if self.box is None:
            return
        work, run = self.box / "work", self.box / "run"
        written = [p for p in work.rglob("*") if str(p.relative_to(work)) not in
                   self.submitted_files] + [p for p in run.iterdir() if p.name != "kernel.json"
                                            and (p.is_dir() or p.is_file())]
        for path in sorted(written, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    remove_tree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()

    def threads(self) -> int:
        """Threads of every process of the sandbox (what RLIMIT_NPROC counts)."""
        if self._process is None or self._process.poll() is not None:
            return 0
        return sandbox_processes(self._process.pid).threads

    def stop_stray_processes(self, rounds: int = 50) -> int:
        """SIGKILL every process of the sandbox but the kernel (and bubblewrap's init): what a
        cell started must not outlive it (a fork bomb, workers that print into later cells).
        Returns how many were stopped."""
        stopped: set[int] = set()
        for _ in range(rounds):  # a process may fork between the scan and the kill: rescan
            if self._process is None or self._process.poll() is not None:
                break
            found = sandbox_processes(self._process.pid).strays
            if not found:
                break
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            stopped |= set(found)
        return len(stopped)


def preflight(course: str | Path) -> Sandbox:
    """The course's sandbox settings, checked to work (raises SandboxUnavailable)."""
    from traitlets.config.loader import PyFileConfigLoader

    loader = PyFileConfigLoader("nbgrader_config.py", path=str(course))
    sandbox = Sandbox(config=loader.load_config())
    sandbox.check()
    return sandbox
