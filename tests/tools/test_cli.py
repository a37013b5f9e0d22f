import subprocess
import sys

import stoker
from stoker.tools.cli import main
from tests.support.shards import make_samples, write_tar


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


_WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # as if it were not installed
from stoker.tools.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_the_demo_without_torch_or_pillow_says_what_to_install(tmp_path):
    for hidden, named in (("torch", "needs torch:"), ("PIL", "needs Pillow:")):
        result = subprocess.run(
            [sys.executable, "-c", _WITHOUT, hidden, "demo"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1 and named in result.stderr
        assert "pip install 'stoker[demo]'" in result.stderr


def test_the_tools_work_without_tqdm(tmp_path):
    write_tar(tmp_path / "a.tar", make_samples(20))
    out = tmp_path / "packed"
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT, "tqdm", "pack", str(tmp_path / "a.tar"), str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert len(stoker.Dataset(str(out))) == 20
