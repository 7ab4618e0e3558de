"""The package's types reach its users: an installed ``tierkv`` carries the PEP 561 marker, so a
type checker reads its annotations instead of refusing it as untyped. (``scripts/lint`` checks
the annotations themselves with mypy.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


def test_the_built_package_carries_the_py_typed_marker(tmp_path):
    """What setuptools puts in a wheel, from the package's own configuration (pyproject.toml):
    its ``build_py`` step, which needs neither ``wheel`` nor the network."""
    subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q"]
        + ["build_py", "--build-lib", str(tmp_path)],
        cwd=PACKAGE,
        check=True,
    )
    assert (tmp_path / "tierkv" / "client.py").is_file(), "setuptools built something else"
    assert (tmp_path / "tierkv" / "py.typed").is_file()
