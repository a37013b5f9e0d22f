import subprocess
import sys

from shards import make_samples, write_tar

import stoker
from stoker.tools.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"stoker {stoker.__version__}"


def test_inspect(tmp_path, capsys):
    write_tar(tmp_path / "a.tar", make_samples(3))
    assert main(["inspect", str(tmp_path)]) == 0
    assert "3 samples" in capsys.readouterr().out


def test_user_error_is_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "stoker", "inspect", str(tmp_path / "missing.tar")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "missing.tar" in result.stderr
    assert "Traceback" not in result.stderr
