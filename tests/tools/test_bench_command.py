"""stoker bench: the table, the suggestion and the plot on tiny shards. Behaviour only:
the numbers depend on the machine, so no timing is asserted."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

import stoker
import stoker.tools.bench as bench
from tests.support.shards import make_samples, write_tar

GRID = ["--threads", "1,2", "--batch-sizes", "8,32", "--samples", "100"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_tar(folder / "a.tar", make_samples(200, seed=0))
    write_tar(folder / "b.tar", make_samples(200, seed=1))
    return str(folder)


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


def table_rows(out: str) -> list[str]:
    """The configuration cell of each body row of the table."""
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    return [line.split("|")[1].strip() for line in lines[1:]]


def test_table_and_suggestion(data, capsys):
    assert run_bench([data, *GRID, "--dataloader-workers", "0", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "2 shard(s), 400 samples, fields: cls, raw" in out
    assert table_rows(out) == [
        "sequential read",
        "stoker threads=1 batch=8",
        "stoker threads=1 batch=32",
        "stoker threads=2 batch=8",
        "stoker threads=2 batch=32",
        "DataLoader workers=0 batch=32",
    ]
    header = next(line for line in out.splitlines() if line.startswith("| configuration"))
    for column in ("samples/s", "MB/s", "first batch (ms)", "x DataLoader"):
        assert column in header
    dataloader = next(line for line in out.splitlines() if "DataLoader workers=0" in line)
    assert dataloader.split("|")[-2].strip() == "1.00"  # the baseline against itself
    best = [line for line in out.splitlines() if line.startswith("best: ")]
    assert len(best) == 1
    assert "num_threads=" in best[0] and "batch_size=" in best[0]
    assert "x DataLoader" in best[0] and "% of a sequential read" in best[0]


def test_reads_the_sample_limit(data):
    """Each row stops at --samples (a whole batch past it at most), or at the dataset."""
    ds = stoker.Dataset(data)
    fields = ["cls", "raw"]

    def loader() -> stoker.Loader:
        return stoker.Loader(
            ds, batch_size=32, num_threads=1, fields={f: stoker.Bytes() for f in fields}
        )

    def count(batch: dict) -> tuple[int, int]:
        return len(batch["__key__"]), sum(sum(map(len, batch[f])) for f in fields)

    samples, nbytes, seconds, first = bench.timed(loader, count, 100)
    assert samples == 128 and nbytes > 0 and 0 < first <= seconds
    samples, _, _, _ = bench.timed(loader, count, 10_000)
    assert samples == len(ds)


def test_sequential_read_stops_at_its_budget(data):
    paths = stoker.Dataset(data).shards
    total = sum(os.path.getsize(p) for p in paths)
    got, seconds, first = bench.sequential_read(paths, total)
    assert got == total and 0 <= first <= seconds
    got, _, _ = bench.sequential_read(paths, 1000)
    assert 1000 <= got <= bench.CHUNK


def suggested(rates: dict[int, float]) -> str:
    rows = [
        bench.Row("stoker", rate, 0, 1.0, 0.0, threads=t, batch_size=64)
        for t, rate in rates.items()
    ]
    return bench.suggestion(rows)


def test_fewer_threads_are_preferred_when_close():
    assert suggested({1: 100.0, 2: 200.0, 4: 198.0}).startswith("best: num_threads=2,")
    close = suggested({1: 100.0, 2: 196.0, 4: 200.0})
    assert close.startswith("best: num_threads=2, batch_size=64 (196 samples/s)")
    assert "fewer threads than the fastest (num_threads=4" in close
    assert "fewer threads" not in suggested({1: 100.0, 2: 150.0, 4: 200.0})


def test_plot_writes_a_png(data, tmp_path, capsys):
    target = tmp_path / "grid.png"
    argv = [data, *GRID, "--dataloader-workers", "0", "--plot", str(target)]
    assert run_bench(argv) == 0
    assert target.read_bytes()[:8] == PNG
    assert f"plot: {target}" in capsys.readouterr().out


def test_plot_into_a_missing_folder_fails_before_measuring(data, tmp_path, capsys):
    with pytest.raises(stoker.StokerError, match="does not exist"):
        run_bench([data, *GRID, "--plot", str(tmp_path / "nowhere" / "grid.png")])
    assert capsys.readouterr().out == ""


def test_missing_source_is_a_stoker_error(tmp_path):
    with pytest.raises(stoker.StokerError, match="missing.tar"):
        run_bench([str(tmp_path / "missing.tar"), *GRID])


def test_without_torch_the_dataloader_rows_are_skipped(data, capsys, monkeypatch):
    monkeypatch.setattr(bench, "_import_torch", lambda: None)
    assert run_bench([data, *GRID, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert not any(row.startswith("DataLoader") for row in table_rows(out))
    assert "note: torch is not installed" in out
    assert "x DataLoader" not in out.split("best: ")[1]


def test_optional_fields_are_left_out(tmp_path, capsys):
    samples = make_samples(40)
    for _, fields in samples[::2]:
        fields["json"] = b"{}"
    write_tar(tmp_path / "a.tar", samples)
    argv = [str(tmp_path), "--threads", "1", "--batch-sizes", "8", "--dataloader-workers", "0"]
    assert run_bench(argv) == 0
    assert "note: fields json are not in every sample" in capsys.readouterr().out


def test_bad_grid_values_are_refused():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for bad in (["--threads", "0"], ["--batch-sizes", "a,b"], ["--samples", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["data/", *bad])
    assert parser.parse_args(["data/", "--threads", "4,1,4"]).threads == [1, 4]


def test_default_threads_keep_one_and_the_cores():
    assert bench.default_threads(1) == [1]
    assert bench.default_threads(2) == [1, 2]
    assert bench.default_threads(3) == [1, 2, 3]
    assert bench.default_threads(16) == [1, 2, 4, 16]


def test_as_a_separate_process(data, tmp_path):
    """Outside pytest, with a real forked DataLoader worker."""
    argv = [data, *GRID, "--dataloader-workers", "0,1"]
    code = (
        "import argparse, stoker.tools.bench as b; p = argparse.ArgumentParser(); "
        "b.add_arguments(p); "
        f"raise SystemExit(b.run(p.parse_args({argv!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "DataLoader workers=1 batch=32" in result.stdout
    assert "best: num_threads=" in result.stdout
    assert result.stderr == ""  # not a terminal: no progress bar


def test_a_file_of_millions_of_rows_is_benched_without_a_permutation_of_them(tmp_path, capsys):
    """The DataLoader rows read --samples samples in a random order, drawn without a
    permutation of every sample (shuffle=True's list of 5M ints was 180 MB here, and of a
    billion-row file more than the machine); `stoker inspect` sums its sizes up without
    an array of them either."""
    import tracemalloc

    import numpy as np

    from stoker.tools.cli import main as cli

    path = tmp_path / "rows.npy"
    rows = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(5_000_000, 16))
    rows[-1] = 7
    rows.flush()
    del rows
    tracemalloc.start()
    try:
        argv = [str(path), "--threads", "1", "--batch-sizes", "64", "--samples", "2000"]
        assert run_bench([*argv, "--dataloader-workers", "0", "--quiet"]) == 0
        assert cli(["inspect", str(path)]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out = capsys.readouterr().out
    assert "DataLoader workers=0 batch=64" in out
    assert "npy         5,000,000       16 B       16 B       16 B  80.0 MB" in out
    assert peak < 30e6, peak
