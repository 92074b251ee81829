"""Build script: the metadata, dependencies and package data are in setup.cfg; this file only lists
the packages, because one of them, ``substation.configs`` (the bundled configs and layout plans),
comes from the repository's top-level ``configs/`` folder (``package_dir``), which ``find:`` in
setup.cfg cannot express."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["substation*"]) + ["substation.configs"],
      package_dir={"substation.configs": "configs"})
