"""The build cache: reuse, atomic publication, failed and corrupted builds, concurrent builders."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from substation.backends.cpu import build
from substation.backends.cpu.build import BuildError, build_library

SOURCE = textwrap.dedent("""
    #include "substation_cpu.h"
    extern "C" int answer(void) { return %d; }
""")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def entries(cache):
    return sorted(p for p in os.listdir(cache) if not p.startswith("."))


def test_second_build_is_cached(cache):
    first = build_library(SOURCE % 1, "t")
    second = build_library(SOURCE % 1, "t")
    assert not first.cached and first.seconds > 0 and second.cached and second.path == first.path
    assert len(entries(cache)) == 1
    other = build_library(SOURCE % 2, "t")
    assert other.path != first.path and len(entries(cache)) == 2


def test_failed_build_is_not_recorded(cache):
    with pytest.raises(BuildError, match="compiling bad failed"):
        build_library("this is not C++", "bad")
    assert entries(cache) == [] and os.listdir(cache) == []


def test_corrupted_entry_is_rebuilt(cache):
    first = build_library(SOURCE % 3, "t")
    with open(first.path, "r+b") as f:
        f.seek(100)
        f.write(b"\0garbage\0")
    again = build_library(SOURCE % 3, "t")
    assert not again.cached and again.path == first.path
    import ctypes
    assert ctypes.CDLL(again.path).answer() == 3


def test_key_changes_with_the_library_folders(monkeypatch):
    """Builds carry the MKL folder as rpath: a second environment (another clone's .venv) sharing the
    cache must not load a build linked against the first one's, which may be gone."""
    tc = build.toolchain()
    key = build.build_key(SOURCE % 5)
    moved = dataclasses.replace(tc, blas_libs=tuple(os.path.join("/elsewhere/.venv/lib", os.path.basename(p))
                                                    for p in tc.blas_libs))
    monkeypatch.setattr(build, "toolchain", lambda: moved)
    assert build.build_key(SOURCE % 5) != key


def test_entry_replaced_by_a_file_is_rebuilt_without_leftovers(cache):
    key = build.build_key(SOURCE % 5)
    os.makedirs(cache)
    (cache / key).write_text("not a cache entry")
    result = build_library(SOURCE % 5, "t")
    assert not result.cached and os.path.isdir(cache / key) and os.listdir(cache) == [key]
    import ctypes
    assert ctypes.CDLL(result.path).answer() == 5


def test_unwritable_cache_names_the_folder_on_a_miss_and_serves_hits(cache, monkeypatch):
    hit = build_library(SOURCE % 6, "t")
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    assert build_library(SOURCE % 6, "t").path == hit.path
    with pytest.raises(BuildError, match=f"the build cache folder {cache} is not writable .*SUBSTATION_CACHE_DIR"):
        build_library(SOURCE % 7, "t")


def test_interrupted_build_leaves_nothing_loadable(cache):
    """A build killed before publication leaves only a private temporary folder, never an entry."""
    key = build.build_key(SOURCE % 4)
    os.makedirs(cache / ".tmp-t-killed" / "x")  # what a killed build leaves behind
    os.makedirs(cache / key)  # a half-written entry without manifest (e.g. copied by hand)
    result = build_library(SOURCE % 4, "t")
    assert not result.cached and os.path.exists(cache / key / "manifest.json")


def test_two_processes_build_the_same_source(cache):
    code = textwrap.dedent(f"""
        import sys
        from substation.backends.cpu.build import build_library
        print(build_library({SOURCE % 5!r}, "race").path)
    """)
    env = dict(os.environ, SUBSTATION_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    paths = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert paths[0] == paths[1] and len(entries(cache)) == 1
    assert [p for p in os.listdir(cache) if p.startswith(".tmp")] == []


def test_cache_lists_prunes_unused_and_clears(cache, capsys):
    from substation.cli import main
    old, new = build_library(SOURCE % 6, "old"), build_library(SOURCE % 7, "new")
    (cache / "tune").mkdir()
    (cache / "tune" / "record.json").write_text("{}")
    day = 86400
    os.utime(os.path.dirname(old.path), (0, os.path.getmtime(old.path) - 3 * day))
    listed = build.cache_entries()
    assert [e.label for e in listed] == ["old", "new"] and all(e.bytes > os.path.getsize(old.path) for e in listed)
    assert build_library(SOURCE % 6, "old").cached  # a load marks the build used...
    assert [e.label for e in build.cache_entries()] == ["new", "old"]
    os.utime(os.path.dirname(old.path), (0, os.path.getmtime(old.path) - 3 * day))  # ...three days ago again
    assert main(["cache", "--prune-days", "2"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 build, " in out and f"build cache {cache}: 1 build, " in out
    assert f"tuning records (kept by --prune-days and --clear): 1 in {cache / 'tune'}, 0 of them" in out
    assert entries(cache) == [os.path.basename(os.path.dirname(new.path)), "tune"]
    assert [e.path for e in build.prune_cache()] == [os.path.dirname(new.path)]
    assert entries(cache) == ["tune"] and (cache / "tune" / "record.json").exists()
    assert main(["cache", "--clear"]) == 0 and "removed 0 builds, 0.0 MiB" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unused_seconds must be >= 0"):
        build.prune_cache(-1.0)


def test_showing_or_clearing_an_absent_cache_creates_nothing(cache, capsys, tmp_path, monkeypatch):
    from substation.cli import main
    assert main(["cache"]) == 0 and main(["cache", "--clear"]) == 0
    out = capsys.readouterr().out
    assert f"build cache {cache} (not created yet): 0 builds, 0.0 MiB" in out and "removed 0 builds" in out
    assert not cache.exists() and build.cache_entries() == [] and build.prune_cache() == []
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("")
    with pytest.raises(BuildError, match=r"the build cache folder .*file cannot be read \(Not a directory\)"):
        build.cache_entries()


def test_cache_lists_and_removes_builds_only(cache, monkeypatch):
    build_library(SOURCE % 8, "kept-apart")
    lookalike = cache / ("0" * 32)  # a build's name, but its manifest names no such key
    lookalike.mkdir()
    (lookalike / "manifest.json").write_text('{"foo": 1}')
    mine = cache / "notes"
    (mine / "sub").mkdir(parents=True)
    (mine / "manifest.json").write_text(json.dumps({"key": "notes"}))
    old_trash = cache / "my.trash-stuff"
    old_trash.mkdir()
    os.utime(old_trash, (0, 0))
    assert [e.label for e in build.cache_entries()] == ["kept-apart"]
    real_rename = os.rename

    def read_only(src, dst):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(os, "rename", read_only)
    with pytest.raises(BuildError, match=r"removed 0 of 1 builds from .*; the others could not be removed "
                                         r"\(Read-only file system\)"):
        build.prune_cache()
    monkeypatch.setattr(os, "rename", real_rename)
    assert len(build.prune_cache()) == 1
    assert sorted(os.listdir(cache)) == sorted([lookalike.name, "notes", "my.trash-stuff"])


def test_a_build_removed_before_it_is_loaded_is_built_again(cache, monkeypatch):
    """``substation cache --clear`` in another process between a layer's build and its load."""
    from substation.config import load_config
    from substation.pipeline import compile_layer
    real = build.build_libraries

    def then_cleared(*args, **kwargs):
        built = real(*args, **kwargs)
        build.prune_cache()
        return built
    monkeypatch.setattr("substation.pipeline.build_libraries", then_cleared)
    with pytest.raises(OSError):  # cleared again after the second build too: the load fails, naming the file
        compile_layer(load_config("tiny"), mode="eval")
    calls = []

    def cleared_once(*args, **kwargs):
        built = real(*args, **kwargs)
        if not calls:
            build.prune_cache()
        calls.append(1)
        return built
    monkeypatch.setattr("substation.pipeline.build_libraries", cleared_once)
    compiled = compile_layer(load_config("tiny"), mode="eval")
    assert len(calls) == 2 and os.path.exists(compiled.forward.path)
