"""scripts/ci_provenance.py, which .ci/run runs before any test: it passes in the test
environment as .ci/run makes it, and fails, naming the cause, on what .ci/run did not
install (a Python path into the machine's own site-packages, a Debian package left out of
the list)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests.support import REPO as ROOT

SCRIPT = os.path.join(ROOT, "scripts", "ci_provenance.py")
# The Debian packages .ci/run installs, as it names them.
CI_RUN = os.path.join(ROOT, ".ci", "run")
with open(CI_RUN) as _f:
    APT = re.search(r'^packages="([^"]*)"', _f.read(), re.M)[1]

pytestmark = pytest.mark.skipif(
    shutil.which("dpkg") is None or sys.prefix == sys.base_prefix,
    reason="needs Debian's dpkg and a virtual environment, as .ci/run has",
)


def _run(apt: str, **env: str) -> subprocess.CompletedProcess:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME")
    }
    return subprocess.run(
        [sys.executable, SCRIPT, "--apt", apt],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=120,
    )


def test_a_stray_python_path_and_a_missing_package_are_named():
    base_site = sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"]
    out = _run("g++", PYTHONPATH=base_site)
    assert out.returncode == 1, out.stdout
    assert "PYTHONPATH is set" in out.stdout
    assert f"sys.path holds {base_site}" in out.stdout
    # (Which package: what the tests use from Debian beyond g++, say clang for clang++, or
    # libjpeg62-turbo where the extension was built from this tree, not from the wheel.)
    assert re.search(r"comes from \S+, which \.ci/run does not install", out.stdout), out.stdout


def test_what_ci_installs_passes():
    if not all(shutil.which(p) for p in ("weed", "zip", "tar", "openssl")):
        pytest.skip("weed, zip, tar or openssl is not on PATH (outside .ci/run)")
    untracked = subprocess.run(
        ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=all", "tests"],
        capture_output=True,
        text=True,
    ).stdout
    if any(line.startswith("??") for line in untracked.splitlines()):
        pytest.skip("files under tests/ that git does not hold (a working checkout)")
    out = _run(APT)
    if "is not installed" in out.stdout or "not installed:" in out.stdout:
        pytest.skip("this machine lacks some of .ci/run's Debian packages")
    assert out.returncode == 0, out.stdout
    assert "ci_provenance: ok" in out.stdout
    assert "libblosc" in out.stdout and "the test environment (pip)" in out.stdout


@pytest.mark.skipif(
    os.environ.get("STOKER_TEST_NO_COMPILER") != "1",
    reason="only where .ci/run takes the compilers off PATH, as for a wheel's user",
)
def test_the_tests_run_with_no_compiler_on_path():
    found = {name: shutil.which(name) for name in ("cc", "gcc", "g++", "c++", "clang", "clang++")}
    assert not any(found.values()), found
