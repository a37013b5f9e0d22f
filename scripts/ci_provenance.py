"""Where everything the tests use comes from: fails unless it is what `.ci/run` installs.

    python scripts/ci_provenance.py --apt "PACKAGE ..." [--allow-gpu-driver]

Run by `.ci/run` with the test environment's Python, after it has installed what the
tests need and before any test runs. A clean clone on a fresh machine must pass exactly as
one on a machine where CI ran before: so every shared library stoker maps or opens at run
time (what the extension links, libzstd and libblosc for chunk codecs, the CUDA driver and
cuFile) and every program the tests start must come from

- the test environment itself (what pip installed into it), or
- a Debian package that `.ci/run` installs, or one those depend on, or
- the machine as every machine of its kind is: Debian's required and important packages,
  and what the machine's own Python needs (the libraries its lib-dynload links).

Anything else (a library a hand-run `make install` left in /usr/local, a package pip put
into the machine's Python, a file no package owns) is named, with why, and the check fails.
The test data must be what git holds: no file under tests/ that the checkout lacks.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Programs the tests and the later CI steps start, and what provides each.
PROGRAMS = ("weed", "zip", "tar", "openssl", "cc", "g++", "clang++")


def dpkg_owners(paths: list[str]) -> dict[str, str]:
    """The Debian package owning each of `paths` (resolved through symlinks, and through
    /usr merged with /lib, as dpkg records either spelling), asked in one dpkg call."""
    spellings: dict[str, str] = {}  # a spelling dpkg may know -> the path asked about
    for path in paths:
        for p in {path, os.path.realpath(path)}:
            spellings.setdefault(p, path)
            for a, b in (("/usr/lib/", "/lib/"), ("/usr/bin/", "/bin/"), ("/usr/sbin/", "/sbin/")):
                if p.startswith(a):
                    spellings.setdefault(b + p[len(a) :], path)
                elif p.startswith(b):
                    spellings.setdefault(a + p[len(b) :], path)
    if not spellings:
        return {}
    out = subprocess.run(["dpkg", "-S", *spellings], capture_output=True, text=True)
    owners: dict[str, str] = {}
    for line in out.stdout.splitlines():
        package, _, file = line.partition(": ")
        if file in spellings and not package.startswith("diversion"):
            owners.setdefault(spellings[file], package.split(",")[0].split(":")[0].strip())
    return owners


def installed_packages() -> dict[str, dict[str, str]]:
    """Every installed Debian package: its dependencies, what it provides, its priority."""
    fields = ("Package", "Status", "Priority", "Essential", "Depends", "Pre-Depends", "Provides")
    fmt = "\t".join("${" + f + "}" for f in fields) + "\n"
    out = subprocess.run(["dpkg-query", "-W", "-f", fmt], capture_output=True, text=True)
    packages = {}
    for line in out.stdout.splitlines():
        name, status, priority, essential, depends, pre, provides = (line.split("\t") + [""] * 7)[
            :7
        ]
        if "installed" in status.split():
            packages[name.split(":")[0]] = {
                "priority": priority,
                "essential": essential,
                "depends": ", ".join(d for d in (depends, pre) if d),
                "provides": provides,
            }
    return packages


def closure(roots: set[str], packages: dict[str, dict[str, str]]) -> set[str]:
    """`roots` and every installed package they depend on, through alternatives and
    virtual packages."""
    providers: dict[str, set[str]] = {}
    for name, info in packages.items():
        for provided in re.split(r"\s*,\s*", info["provides"]):
            if provided:
                providers.setdefault(provided.split()[0].split(":")[0], set()).add(name)
    seen: set[str] = set()
    todo = [r for r in roots if r in packages]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for clause in re.split(r"\s*,\s*", packages[name]["depends"]):
            for alternative in clause.split("|"):
                dep = alternative.strip().split()[0].split(":")[0] if alternative.strip() else ""
                for found in ({dep} if dep in packages else set()) | providers.get(dep, set()):
                    if found not in seen:
                        todo.append(found)
    return seen


def python_needs() -> set[str]:
    """The Debian packages the machine's own Python links (its lib-dynload modules)."""
    libs: set[str] = set()
    dynload = os.path.join(
        sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}"
    )
    for module in glob.glob(os.path.join(dynload, "lib-dynload", "*.so")):
        out = subprocess.run(["ldd", module], capture_output=True, text=True)
        libs.update(re.findall(r"=>\s*(/\S+)", out.stdout))
    return set(dpkg_owners(sorted(libs)).values())


def libraries_in_use(allow_gpu_driver: bool) -> tuple[list[str], list[str]]:
    """The shared libraries this process maps once stoker has opened every library it
    opens at run time, and notes on the ones it looked for and did not find."""
    import stoker

    notes = []
    for name, status in stoker.codec_status().items():
        if not status["available"]:
            notes.append(f"{name}: {status['reason']}")
    cuda = stoker.cuda_status()
    if cuda["cuda"] and not allow_gpu_driver:
        notes.append(f"CUDA driver found ({cuda.get('reason', '')}): a GPU machine")
    elif not cuda["cuda"]:
        notes.append(f"CUDA: {cuda['reason']} (tests/gpu skip; the host stand-in tests run)")
    if cuda.get("libcufile"):
        notes.append(f"cuFile: {cuda['libcufile']}")
    with open("/proc/self/maps") as f:
        mapped = sorted({line.split()[-1] for line in f if ".so" in line.split()[-1]})
    return mapped, notes


def test_data_problems() -> list[str]:
    """Files under tests/ that git does not hold (the tests would read what only this
    machine has)."""
    out = subprocess.run(
        ["git", "-C", ROOT, "status", "--porcelain", "--ignored", "--untracked-files=all", "tests"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return []  # not a git checkout (an unpacked sdist): nothing to compare with
    skip = ("__pycache__", ".pytest_cache", ".hypothesis")
    problems = []
    for line in out.stdout.splitlines():
        status, path = line[:2], line[3:]
        if status in ("??", "!!") and not any(part in skip for part in path.split("/")):
            problems.append(f"{path}: not in git ({'untracked' if status == '??' else 'ignored'})")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--apt", default="", help="the Debian packages .ci/run installs")
    parser.add_argument("--allow-gpu-driver", action="store_true")
    args = parser.parse_args()
    env_prefix = os.path.realpath(sys.prefix) + os.sep
    base = os.path.realpath(sys.base_prefix) + os.sep
    base_lib = os.path.join(base, "lib", "python")  # the stdlib, its zip, lib-dynload

    problems: list[str] = []
    for variable in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME"):
        if os.environ.get(variable):
            problems.append(f"{variable} is set ({os.environ[variable]}): .ci/run clears it")
    base_site = os.path.realpath(sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"])
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else ""
        ours = real.startswith(env_prefix) or real.startswith(os.path.realpath(ROOT) + os.sep)
        stdlib_only = real.startswith(base_lib) and not real.startswith(base_site)
        if real and not (ours or stdlib_only or real + os.sep == base):
            problems.append(f"sys.path holds {entry}, outside the test environment")

    packages = installed_packages()
    machine = {
        n
        for n, i in packages.items()
        if i["priority"] in ("required", "important") or i["essential"] == "yes"
    }
    wanted = set(args.apt.split())
    missing = sorted(wanted - set(packages))
    if missing:
        problems.append(f"Debian packages .ci/run installs are not installed: {' '.join(missing)}")
    allowed = closure(wanted, packages) | closure(machine | python_needs(), packages)

    mapped, notes = libraries_in_use(args.allow_gpu_driver)
    programs = {name: shutil.which(name) for name in PROGRAMS}
    outside = [p for p in mapped if not os.path.realpath(p).startswith(env_prefix)]
    outside += [
        p for p in programs.values() if p and not os.path.realpath(p).startswith(env_prefix)
    ]
    owners = dpkg_owners(outside)
    rows = []
    for path in mapped + [p for p in programs.values() if p]:
        real = os.path.realpath(path)
        if real.startswith(env_prefix):
            rows.append((path, "the test environment (pip)"))
        elif path in owners:
            package = owners[path]
            if package in wanted:
                why = f"Debian {package} (.ci/run installs it)"
            elif package in allowed:
                why = f"Debian {package} (a dependency, or on every machine of this kind)"
            else:
                why = f"Debian {package}: not installed by .ci/run nor on every machine"
                problems.append(f"{path} comes from {package}, which .ci/run does not install")
            rows.append((path, why))
        elif real.startswith(base_lib) or real.startswith(os.path.join(base, "lib", "libpython")):
            rows.append((path, "the machine's Python"))
        else:
            rows.append((path, "nothing .ci/run installs: left behind?"))
            problems.append(f"{path} is neither in the test environment nor from a Debian package")
    for name, found in programs.items():
        if found is None and name in ("weed", "zip", "tar", "openssl"):
            problems.append(f"{name} is not on PATH: a test needs it")
    problems += test_data_problems()

    width = max((len(p) for p, _ in rows), default=0)
    print("ci_provenance: where what the tests use comes from")
    for path, why in rows:
        print(f"  {path:<{width}}  {why}")
    for note in notes:
        print(f"  note: {note}")
    if problems:
        print("ci_provenance: FAILED: the tests would use what .ci/run did not install:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"ci_provenance: ok ({len(rows)} libraries and programs checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
