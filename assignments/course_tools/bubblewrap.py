"""The command line of the autograding sandbox: bubblewrap's namespaces, the filesystem view
of the kernel (an allow-list), its environment, and the scratch copy of the submission.

Used by ``course_tools/sandbox.py``; see its docstring for what is isolated and why.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# Environment variables a kernel may see (nothing else of the grader's environment, which
# can hold tokens such as JUPYTERHUB_API_TOKEN). HIDDEN_TEST_SEED: the seed a hidden test
# prints, set by the instructor to rerun a grade with it (assignments/README.md).
ENV_KEEP = ("LANG", "LANGUAGE", "TZ", "PYTHONHASHSEED", "PYTHONWARNINGS", "NBGRADER_EXECUTION",
            "MPLBACKEND", "CUDA_VISIBLE_DEVICES", "JPY_SESSION_NAME", "HIDDEN_TEST_SEED")
ENV_KEEP_PREFIXES = ("LC_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "NUMEXPR_")
# /etc: only what the dynamic loader, the time zone and fonts (matplotlib) need.
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
             "/etc/alternatives", "/etc/fonts")
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
MIB = 1 << 20


class SandboxUnavailable(RuntimeError):
    """The sandbox is enabled but cannot be started on this machine."""


def namespace_args(as_root: bool) -> list[str]:
    """New PID, network, IPC, UTS and cgroup namespaces. As root: no user namespace (the
    launcher then switches the kernel to an unprivileged id, keeping only the two
    capabilities that needs, and losing them with root); otherwise a user namespace in which
    no further one can be made."""
    common = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
              "--unshare-cgroup-try", "--die-with-parent"]
    if as_root:
        return [*common, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return ["--unshare-user", "--disable-userns", *common]


def _existing(paths) -> set[str]:
    found = set()
    for path in paths:
        if path and os.path.isabs(path) and os.path.exists(path):
            found |= {os.path.abspath(path), os.path.realpath(path)}
    return found


def python_paths(protected: list[str]) -> list[str]:
    """Host folders the kernel's Python needs, outside /usr: its installation and the
    environment (an error if one overlaps a protected folder), and the other entries of
    ``sys.path`` (editable installs) that do not overlap one (the course's own tools)."""
    needed = _existing([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                        str(Path(os.path.realpath(sys.executable)).parent.parent)])
    for path in needed:
        for folder in protected:
            if _overlaps(path, folder):
                raise SandboxUnavailable(
                    f"the kernel needs {path}, which overlaps {folder} (the course folder "
                    "must stay invisible to student code): move the Python environment or "
                    "the course folder so that neither contains the other")
    optional = {p for p in _existing(sys.path) - needed
                if not any(_overlaps(p, folder) for folder in protected)}
    kept: list[str] = []
    for path in sorted(needed | optional):  # sorted: a folder comes before what it holds
        if not _inside(path, "/usr") and not any(_inside(path, k) for k in kept):
            kept.append(path)
    return kept


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _overlaps(path: str, protected: str) -> bool:
    """True if binding ``path`` would show ``protected`` (or a part of it)."""
    path, protected = os.path.realpath(path), os.path.realpath(protected)
    return _inside(path, protected) or _inside(protected, path)


def _parents(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def bwrap_args(namespaces: list[str], *, tmp_bytes: int, devices: list[str],
               read_only_paths: list[str], run_dir: str, work_dir: str, workdir_inside: str,
               protected: list[str], env: dict[str, str],
               tmp_files: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """The bwrap options (everything before the command) for one kernel: ``namespaces``,
    then the filesystem view, its working directory and its environment. ``tmp_files``:
    ``(file, path under /tmp)`` pairs, each file bound read-only there (skipped if missing),
    in folders any user may write (the kernel may run as another user)."""
    args = [*namespaces, "--ro-bind", "/usr", "/usr"]
    for path in SYSTEM_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--perms", "0755", "--dir", "/etc"]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    for source, inside in tmp_files:
        if not inside.startswith("/tmp/") or ".." in Path(inside).parts:
            raise ValueError(f"tmp_files: {inside!r} is not a path under /tmp")
        for parent in _parents(inside)[1:]:
            args += ["--perms", "1777", "--dir", parent]
        args += ["--ro-bind-try", source, inside]
    for device in devices:
        args += ["--dev-bind-try", device, device]
    extra = [os.path.abspath(p) for p in read_only_paths]
    for path in extra:
        for folder in protected:
            if _overlaps(path, folder):
                raise SandboxUnavailable(f"c.Sandbox.read_only_paths: {path} overlaps {folder}, "
                                         "which student code must not see")
    read_only = python_paths(protected) + extra
    binds = [(p, "--ro-bind") for p in read_only] + [(run_dir, "--bind")]
    made: set[str] = set()
    for path, _ in binds + [(workdir_inside, "--bind")]:
        for parent in _parents(path):
            if parent not in made and parent not in ("/usr", "/tmp", "/proc", "/dev"):
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
    for path, kind in binds:
        args += [kind, path, path]
    args += ["--bind", work_dir, workdir_inside, "--remount-ro", "/",
             "--chdir", workdir_inside, "--clearenv"]
    for key, value in sorted(env.items()):
        args += ["--setenv", key, value]
    return args


def kernel_env(launch_env: dict[str, str], workdir_inside: str) -> dict[str, str]:
    """The kernel's environment: an allow-list of the grader's, and a neutral home."""
    env = {k: v for k, v in launch_env.items()
           if k in ENV_KEEP or k.startswith(ENV_KEEP_PREFIXES)}
    env.update(HOME="/tmp", TMPDIR="/tmp", USER="student", LOGNAME="student",
               PATH=os.pathsep.join([os.path.join(sys.prefix, "bin"), "/usr/bin", "/bin"]),
               PYTHONNOUSERSITE="1", PWD=workdir_inside)
    return env


def copy_submission(source: str | None, target: Path, keep=None) -> None:
    """Regular files of ``source`` (recursively; no notebook, no link) into ``target``;
    only those for which ``keep(relative path)`` is true, when given."""
    target.mkdir(parents=True, exist_ok=True)
    if not source or not os.path.isdir(source):
        return
    for folder, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        relative = os.path.relpath(folder, source)
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".ipynb") or os.path.islink(path) or not os.path.isfile(path):
                continue
            if keep is not None and not keep(os.path.normpath(os.path.join(relative, name))):
                continue
            destination = target / relative / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)


def regular_file(root: str, relative: str) -> bool:
    """True if ``root/relative`` is a regular file reached through no symbolic link."""
    path = root
    for part in Path(relative).parts:
        path = os.path.join(path, part)
        if os.path.islink(path):
            return False
    return os.path.isfile(path)


def chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(folder, name), uid, gid, follow_symlinks=False)


def remove_tree(path: Path) -> None:
    def retry(function, name, _):
        os.chmod(os.path.dirname(name), 0o700)  # the kernel may have made a folder read-only
        function(name)
    shutil.rmtree(path, onerror=retry)
