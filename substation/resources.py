"""Files shipped with Substation, found through :mod:`importlib.resources`: the C++/CUDA sources of
``substation/csrc/`` and the bundled configs and layout plans.

The configs live in the repository's top-level ``configs/`` folder. A wheel ships them as
``substation/configs/`` (``setup.py`` maps the folder into the package); an editable install or a
source checkout on ``sys.path`` reads the top-level folder next to the package.
"""
from __future__ import annotations

import importlib.resources
import os

__all__ = ["csrc_dir", "csrc_file", "configs_dir", "bundled_file", "bundled_names"]


def _folder(package: str) -> str:
    """The folder that ``package`` is imported from.

    Raises:
        FileNotFoundError: the package is not imported from a folder (e.g. from a zip file), so the C++
            compiler could not read its files.
    """
    root = importlib.resources.files(package)
    if not isinstance(root, os.PathLike):
        raise FileNotFoundError(f"package {package} is imported from {root}, not from a folder; install "
                                "substation with pip so that its C++ sources and configs are files")
    return os.fspath(root)


def csrc_dir() -> str:
    """The folder of the C++ and CUDA headers that generated code includes.

    Returns:
        The absolute path of ``substation/csrc``.

    Raises:
        FileNotFoundError: the package is not imported from a folder.
    """
    return _folder("substation.csrc")


def csrc_file(name: str) -> str:
    """A file of ``substation/csrc`` (``substation_cpu.h``, ``substation_cuda.cuh``, ``substation_probe.cpp``).

    Returns:
        Its absolute path.

    Raises:
        FileNotFoundError: the install lacks the file (the message names it).
    """
    path = os.path.join(csrc_dir(), name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: this substation install lacks its C++ sources "
                                "(substation/csrc/*.h, *.cuh, *.cpp); reinstall it with pip")
    return path


def configs_dir() -> str:
    """The folder of the bundled configs (``<name>.yaml``) and layout plans (``<name>.plan.json``).

    Returns:
        ``substation/configs`` of an installed wheel, else the top-level ``configs/`` of the source
        checkout (the folder holding ``setup.cfg``) that ``substation`` is imported from.

    Raises:
        FileNotFoundError: neither folder exists (the message names both).
    """
    package = _folder("substation")
    installed = os.path.join(package, "configs")
    if os.path.isdir(installed):
        return installed
    checkout = os.path.dirname(package)
    if os.path.isfile(os.path.join(checkout, "setup.cfg")) and os.path.isdir(os.path.join(checkout, "configs")):
        return os.path.join(checkout, "configs")
    raise FileNotFoundError(f"no bundled configs: neither {installed} (installed package) nor "
                            f"{os.path.join(checkout, 'configs')} (source checkout) exists; reinstall substation "
                            "with pip, or pass a config file path")


def bundled_file(name: str, suffix: str) -> str | None:
    """A bundled config or plan by name: ``bundled_file("bert-base", ".yaml")``.

    Returns:
        The path of ``<configs_dir()>/<name><suffix>`` if that file exists, else None.

    Raises:
        FileNotFoundError: there is no configs folder at all (see :func:`configs_dir`).
    """
    path = os.path.join(configs_dir(), f"{name}{suffix}")
    return path if os.path.isfile(path) else None


def bundled_names(suffix: str) -> list[str]:
    """The names of the bundled files ending in ``suffix`` (``".yaml"``: configs, ``".plan.json"``:
    layout plans), sorted; none when there is no configs folder."""
    try:
        folder = configs_dir()
    except FileNotFoundError:
        return []
    return sorted(n[:-len(suffix)] for n in os.listdir(folder) if n.endswith(suffix))
