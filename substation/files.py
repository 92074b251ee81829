"""Writing outputs safely: files and folders appear whole (one rename) or not at all; an output folder that
cannot be renamed (a mount point) is refilled file by file, after its new contents are complete."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Callable

__all__ = ["OutputError", "OUTPUT_MARKER", "atomic_write", "atomic_write_text", "check_output_dir", "check_writable",
           "publish_dir", "publish_files", "remove_path"]


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a temporary file next to ``path`` (parent folders are created), make it
    readable (0644) and rename it onto ``path``; a failed ``write`` leaves ``path`` untouched.

    Raises:
        OSError: the folder or file cannot be written.
    """
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str, text: str) -> None:
    """:func:`atomic_write` of a text."""
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    atomic_write(path, write)


#: Written into every folder ``publish_dir`` creates: only such folders (or empty ones) are replaced.
OUTPUT_MARKER = ".substation-output"


class OutputError(ValueError):
    """An output path that Substation will not overwrite."""


def remove_path(path: str, ignore_errors: bool = False) -> None:
    """Delete a file, a link or a folder tree; with ``ignore_errors``, as much of it as can be deleted.

    Raises:
        OSError: it could not be deleted (without ``ignore_errors``).
    """
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=ignore_errors)
        else:
            os.unlink(path)
    except OSError:
        if not ignore_errors:
            raise


def check_writable(path: str, what: str, into: bool = False) -> str:
    """``path`` as an absolute path, after checking that it can be written: the folder that will hold
    it (``path`` itself with ``into``: files are written inside it) or, where that does not exist yet,
    its nearest existing ancestor, is a folder this process may write. Callers ask before long work.

    Raises:
        OutputError: that folder is not writable (permissions, a read-only file system) or is a file;
            ``path`` (a file to write, not ``into``) is an existing folder.
    """
    path = os.path.abspath(path)
    if not into and os.path.isdir(path):
        raise OutputError(f"{what} {path}: is a folder; give the name of a file to write")
    folder = path if into else os.path.dirname(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise OutputError(f"{what} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or not _can_create_in(folder):
        raise OutputError(f"{what} {path}: the folder {folder} is not writable (permissions or a read-only "
                          f"file system)")
    return path


def _can_create_in(folder: str) -> bool:
    """Whether a folder can be created (and is removed again) in ``folder``: os.access alone passes for
    root on any mode bits and for file systems such as /proc that refuse new entries."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".substation-probe-", dir=folder))
        return True
    except OSError:
        return False


def check_output_dir(out: str) -> str:
    """``out`` as an absolute path, after checking that :func:`publish_dir` may replace it (callers ask
    before long work, so a refused ``--out`` costs nothing).

    Raises:
        OutputError: ``out`` exists and is a file, or a non-empty folder that Substation did not write;
            neither ``out`` (where it exists) nor the folder that would hold it is writable
            (:func:`check_writable`).
    """
    out = os.path.abspath(out)
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise OutputError(f"--out {out} is an existing file; choose a folder")
        if os.listdir(out) and not os.path.exists(os.path.join(out, OUTPUT_MARKER)):
            raise OutputError(f"refusing to replace {out}: a non-empty folder that substation did not write "
                              f"(no {OUTPUT_MARKER}); choose another --out")
        return check_writable(out, "--out", into=True)  # replaced in place where its parent is not writable
    return check_writable(out, "--out")


def _is_mount_point(path: str) -> bool:
    """Whether ``path`` is a mount point, bind mounts of a folder onto itself included (Linux lists them in
    /proc/self/mountinfo; os.path.ismount compares devices and misses them)."""
    if os.path.ismount(path):
        return True
    try:
        with open("/proc/self/mountinfo") as f:
            points = {line.split()[4] for line in f if len(line.split()) > 4}
    except OSError:
        return False
    decoded = {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points}
    return os.path.realpath(path) in decoded


def _replaceable_by_rename(out: str) -> bool:
    parent = os.path.dirname(out)
    return not (os.path.exists(out) and (_is_mount_point(out) or not os.access(parent, os.W_OK | os.X_OK)))


def publish_dir(build, out: str) -> None:
    """Fill a fresh folder with ``build(tmpdir)`` and put it at ``out``, replacing an old ``out`` only once
    the new one is complete: with one rename of the new folder, or, where ``out`` cannot be renamed (a
    mount point such as a container volume, or a folder whose parent is not writable), by deleting the
    old files and moving the new ones in, each with one rename.

    Raises:
        OutputError: as :func:`check_output_dir`; the temporary folder cannot be created.
    """
    out = check_output_dir(out)
    in_place = not _replaceable_by_rename(out)
    parent = out if in_place else os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    except OSError as e:
        raise OutputError(f"--out {out}: cannot create a folder in {parent} ({e.strerror})") from None
    os.chmod(tmp, 0o755)
    try:
        build(tmp)
        with open(os.path.join(tmp, OUTPUT_MARKER), "w") as f:
            f.write("written by substation; `substation compile --out` replaces this folder as a whole\n")
        if in_place:
            for name in os.listdir(out):
                if os.path.join(out, name) != tmp:
                    remove_path(os.path.join(out, name))
            for name in os.listdir(tmp):
                os.replace(os.path.join(tmp, name), os.path.join(out, name))
        elif os.path.exists(out):
            trash = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
            try:
                os.rename(out, os.path.join(trash, "old"))
                os.rename(tmp, out)
            finally:
                shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def publish_files(build, folder: str) -> list[str]:
    """Write the files ``build(tmpdir)`` creates into ``folder``, each with one atomic replace; other
    files in ``folder`` are left alone. Returns the names written.

    Raises:
        OutputError: ``folder`` is an existing file or cannot be written (:func:`check_writable`).
    """
    folder = os.path.abspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise OutputError(f"--out {folder} is an existing file; choose a folder")
    check_writable(folder, "--out", into=True)
    os.makedirs(folder, exist_ok=True)
    try:
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=folder)
    except OSError as e:
        raise OutputError(f"--out {folder}: cannot create a folder there ({e.strerror})") from None
    try:
        build(tmp)
        names = sorted(os.listdir(tmp))
        for name in names:
            os.chmod(os.path.join(tmp, name), 0o644)
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


