"""Parquet (and Arrow) files read remotely, byte-exact against the same files read locally:
over http from the tests' aiohttp server, and from s3:// prefixes of a real S3 server
(SeaweedFS, skipped where ``weed`` is not installed); and a loader asking for one small
column of a file with a large one moves about that column's bytes, not the file's."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

import stoker
from tests.support import object_store
from tests.support.server import ShardServer
from tests.support.tables import chunk_bytes, expected_rows, footer, make_table

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FAST = stoker.FetchOptions(backoff=0.01, max_backoff=0.05, stall_timeout=2.0, retries=4)
NAMES = ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
_options = itertools.count()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """Three Parquet files of every type (codecs snappy, zstd, none), an Arrow file, and
    `wide.parquet`: a small label column beside ~4 MB of blobs."""
    root = str(tmp_path_factory.mktemp("tables-remote"))
    for i, (name, codec) in enumerate(zip(NAMES, ["snappy", "zstd", None])):
        pq.write_table(
            make_table(40 + 10 * i, seed=20 + i),
            os.path.join(root, name),
            row_group_size=16,
            compression=codec,
            data_page_size=256,
            write_batch_size=8,
        )
    table = make_table(30, seed=30).drop_columns(["flag"])
    sink = pa.OSFile(os.path.join(root, "rows.arrow"), "wb")
    with sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=10)
    rng = np.random.default_rng(31)
    n = 2000
    wide = pa.table(
        {
            "label": pa.array(rng.integers(0, 1 << 40, n), pa.int64()),
            "blob": pa.array(
                [rng.integers(0, 256, 2_000, dtype=np.uint8).tobytes() for _ in range(n)],
                pa.binary(),
            ),
        }
    )
    pq.write_table(wide, os.path.join(root, "wide.parquet"), row_group_size=500)
    return root


def values(ds) -> list[dict]:
    """Every sample of `ds`, its fields as bytes (with their dtype), by one batch."""
    out = []
    for sample in ds.get_batch(np.arange(len(ds))):
        out.append(
            {
                k: v if isinstance(v, str) else (np.asarray(v).dtype.str, np.asarray(v).tobytes())
                for k, v in sample.items()
            }
        )
    return out


def label_rows(ds, batch_size=32) -> tuple[dict[str, int], dict]:
    loader = stoker.Loader(
        ds, batch_size=batch_size, fields={"label": stoker.Int()}, shuffle=True, seed=0
    )
    labels = {}
    for batch in loader:
        labels.update(zip(batch["__key__"], batch["label"].tolist()))
    return labels, loader.stats()


def footer_bytes(path: str) -> int:
    """A Parquet file's footer and its last 8 bytes (its length and magic)."""
    return len(footer(path)[1]) + 8


def wide_labels(data: str) -> dict[str, int]:
    column = pq.read_table(os.path.join(data, "wide.parquet")).column("label").to_pylist()
    return {f"wide/{i}": v for i, v in enumerate(column)}


# -- http ---------------------------------------------------------------------------------


@pytest.fixture
def server(data):
    with ShardServer(data) as srv:
        yield srv


def test_parquet_over_http_reads_as_the_local_files(server, data, tmp_path):
    urls = [server.url_for(n) for n in NAMES]
    remote = stoker.Dataset(urls, cache_dir=tmp_path / "c", fetch=FAST)
    assert len(remote) == 40 + 50 + 60
    local = stoker.Dataset([os.path.join(data, n) for n in NAMES])
    assert values(remote) == values(local)
    assert values(remote)[45]["__key__"] == "part-1/5"
    loader = stoker.Loader(
        remote, batch_size=16, fields={"id": stoker.Int(), "image": stoker.Bytes()}
    )
    seen = {}
    for batch in loader:
        for k, i, image in zip(batch["__key__"], batch["id"].tolist(), batch["image"]):
            seen[k] = (i, bytes(image))
    for n in NAMES:
        stem = n.removesuffix(".parquet")
        table = pq.read_table(os.path.join(data, n))
        for r, row in enumerate(expected_rows(table)):
            assert seen[f"{stem}/{r}"] == (int(row["id"]), row["image.bytes"].tobytes())


def test_an_arrow_file_over_http(server, data, tmp_path):
    remote = stoker.Dataset(server.url_for("rows.arrow"), cache_dir=tmp_path / "c", fetch=FAST)
    assert values(remote) == values(stoker.Dataset(os.path.join(data, "rows.arrow")))


def test_over_http_a_loader_moves_only_the_column_it_asks_for(server, data, tmp_path):
    path = os.path.join(data, "wide.parquet")
    ds = stoker.Dataset(server.url_for("wide.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
    opened = server.bytes_sent  # (the footer)
    assert opened < os.path.getsize(path) / 10, opened
    labels, stats = label_rows(ds)
    assert labels == wide_labels(data)
    label_bytes = chunk_bytes(path, "label")
    assert stats["bytes_read"] <= 1.2 * label_bytes, (stats["bytes_read"], label_bytes)
    moved = server.bytes_sent - opened
    # The footer is read again (by the process that fetches): here it is as large as the
    # column, of its blobs' min and max, where a real file's is a speck of its columns.
    assert moved <= 1.2 * label_bytes + footer_bytes(path), (moved, label_bytes)
    assert os.path.getsize(path) > 100 * moved


def wide_rows(data: str) -> dict[str, tuple[int, bytes]]:
    table = pq.read_table(os.path.join(data, "wide.parquet"))
    labels, blobs = table.column("label").to_pylist(), table.column("blob").to_pylist()
    return {f"wide/{i}": (v, b) for i, (v, b) in enumerate(zip(labels, blobs))}


def label_and_blob_rows(ds) -> dict[str, tuple[int, bytes]]:
    loader = stoker.Loader(
        ds, batch_size=100, fields={"label": stoker.Int(), "blob": stoker.Bytes()}, seed=1
    )
    seen = {}
    for batch in loader:
        for k, v, b in zip(batch["__key__"], batch["label"].tolist(), batch["blob"]):
            seen[k] = (v, bytes(b))
    return seen


def cached_file(cache_dir) -> str:
    found = [
        os.path.join(folder, n)
        for folder, dirs, files in os.walk(cache_dir)
        for n in files
        if n.endswith(".parquet")
    ]
    assert len(found) == 1, found
    return found[0]


def test_a_copy_in_part_takes_the_room_of_its_ranges_only(server, data, tmp_path):
    path = os.path.join(data, "wide.parquet")
    ds = stoker.Dataset(server.url_for("wide.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
    label_rows(ds)
    copy = cached_file(tmp_path / "c")
    assert os.path.getsize(copy) == os.path.getsize(path)  # read at the same offsets
    with open(copy, "rb") as f:
        assert f.read(4) == bytes(4)  # what tells a copy in part from a whole one
    usage = stoker.remote.cache_for(str(tmp_path / "c")).usage()
    assert usage < os.path.getsize(path) / 20, usage


def test_a_second_loader_fetches_only_the_columns_the_copy_lacks(server, data, tmp_path):
    path = os.path.join(data, "wide.parquet")
    ds = stoker.Dataset(server.url_for("wide.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
    label_rows(ds)
    before = server.bytes_sent
    assert label_and_blob_rows(ds) == wide_rows(data)
    moved = server.bytes_sent - before
    blob_bytes = chunk_bytes(path, "blob")
    assert blob_bytes <= moved <= 1.05 * blob_bytes + 2 * footer_bytes(path), (moved, blob_bytes)
    # And a third, in a fresh dataset on the same cache, fetches nothing more.
    again = stoker.Dataset(server.url_for("wide.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
    before = server.bytes_sent
    assert label_and_blob_rows(again) == wide_rows(data)
    assert server.bytes_sent - before < footer_bytes(path) + 1024


def test_every_field_of_a_file_cached_in_part_reads_as_the_local_file(server, data, tmp_path):
    path = os.path.join(data, "wide.parquet")
    ds = stoker.Dataset(server.url_for("wide.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
    label_rows(ds)
    assert values(ds) == values(stoker.Dataset(path))  # all fields: the rest fetched
    with open(cached_file(tmp_path / "c"), "rb") as copy, open(path, "rb") as whole:
        assert copy.read() == whole.read()


def test_a_copy_in_part_whose_record_is_lost_is_fetched_again(server, data, tmp_path):
    cache_dir = tmp_path / "c"
    ds = stoker.Dataset(server.url_for("wide.parquet"), cache_dir=cache_dir, fetch=FAST)
    label_rows(ds)
    copy = cached_file(cache_dir)
    records = stoker.remote.cache_for(str(cache_dir)).records
    assert records.copy_ranges(copy)
    os.unlink(records._path("copy: " + os.path.relpath(copy, str(cache_dir))))
    assert records.copy_ranges(copy) is None  # (what samples the file has is still known)
    again = stoker.Dataset(server.url_for("wide.parquet"), cache_dir=cache_dir, fetch=FAST)
    assert label_rows(again)[0] == wide_labels(data)
    assert records.copy_ranges(copy)  # fetched anew, in part
    assert label_and_blob_rows(again) == wide_rows(data)


def test_a_range_cut_off_mid_body_is_asked_for_again(server, data, tmp_path):
    ds = stoker.Dataset(server.url_for("wide.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
    server.fault("wide.parquet", "reset", times=3)
    assert label_and_blob_rows(ds) == wide_rows(data)
    assert any(r.status == 206 for r in server.requests)


def test_a_range_that_keeps_failing_is_an_error_naming_the_url(server, data, tmp_path):
    ds = stoker.Dataset(server.url_for("wide.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
    server.fault("wide.parquet", "short", times=None)
    with pytest.raises(stoker.FetchError, match="wide.parquet"):
        label_rows(ds)
    server.clear_faults()
    assert label_rows(ds)[0] == wide_labels(data)  # nothing half-written was kept


def test_a_server_that_ignores_ranges_sends_the_file_whole(data, tmp_path):
    path = os.path.join(data, "wide.parquet")
    with ShardServer(data, ranges=False) as srv:
        ds = stoker.Dataset(srv.url_for("wide.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
        assert label_rows(ds)[0] == wide_labels(data)
    with open(cached_file(tmp_path / "c"), "rb") as copy, open(path, "rb") as whole:
        assert copy.read() == whole.read()


def test_a_file_changed_before_its_copy_in_part_grows_is_not_mixed(data, tmp_path):
    import shutil

    folder = tmp_path / "served"
    folder.mkdir()
    shutil.copy(os.path.join(data, "wide.parquet"), folder / "wide.parquet")
    with ShardServer(folder) as srv:
        ds = stoker.Dataset(srv.url_for("wide.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
        assert label_rows(ds)[0] == wide_labels(data)
        table = pq.read_table(folder / "wide.parquet")
        blob = pa.array([bytes(len(b.as_py())) for b in table.column("blob")], pa.binary())
        pq.write_table(table.set_column(1, "blob", blob), folder / "wide.parquet")
        with pytest.raises(stoker.StokerError, match="wide.parquet"):
            label_and_blob_rows(ds)


def test_a_remote_file_changed_on_the_server_is_not_mixed(server, data, tmp_path):
    """A file replaced after open: an error naming the URL, or the old rows, never a mix."""
    import shutil

    folder = tmp_path / "served"
    folder.mkdir()
    shutil.copy(os.path.join(data, NAMES[0]), folder / "x.parquet")
    with ShardServer(folder) as srv:
        ds = stoker.Dataset(srv.url_for("x.parquet"), cache_dir=tmp_path / "c", fetch=FAST)
        before = pq.read_table(folder / "x.parquet").column("id").to_pylist()
        pq.write_table(
            make_table(40, seed=99).set_column(0, "id", pa.array(range(5000, 5040), pa.int64())),
            folder / "x.parquet",
            row_group_size=16,
        )
        try:
            labels = {}
            for batch in stoker.Loader(ds, batch_size=8, fields={"id": stoker.Int()}):
                labels.update(zip(batch["__key__"], batch["id"].tolist()))
        except stoker.StokerError as e:
            assert "x.parquet" in str(e)
            return
        assert [labels[f"x/{i}"] for i in range(40)] == before


# -- s3 -----------------------------------------------------------------------------------


def options(**kw: object) -> stoker.FetchOptions:
    """Options no other test used (each test's store is its own, as in tests/remote)."""
    base = {"retries": 2, "backoff": 0.01, "max_backoff": 0.05, "connect_timeout": 2.0}
    return stoker.FetchOptions(**{**base, **kw, "cache_wait": 700.0 + next(_options)})


@pytest.fixture(scope="module")
def store(tmp_path_factory, data):
    pytest.importorskip("botocore")
    with object_store.started_for_tests(tmp_path_factory, "tables") as server:
        for name in [*NAMES, "wide.parquet", "rows.arrow"]:
            folder = "wide" if name == "wide.parquet" else "set"
            server.put_file("tables", f"{folder}/{name}", os.path.join(data, name))
        yield server


@pytest.fixture
def env(store, tmp_path, monkeypatch):
    return object_store.use_store(store, monkeypatch, tmp_path)


def test_an_s3_prefix_of_parquet_files_reads_as_the_local_files(data, env, tmp_path):
    ds = stoker.Dataset("s3://tables/set/", cache_dir=tmp_path / "c", fetch=options())
    assert ds.shards == [f"s3://tables/set/{n}" for n in sorted([*NAMES, "rows.arrow"])]
    local = stoker.Dataset([os.path.join(data, n) for n in sorted([*NAMES, "rows.arrow"])])
    assert values(ds) == values(local)


def _asked(requests, size: int, name: str = "wide.parquet") -> int:
    """Bytes the GETs of object `name` among `requests` asked for (a GET with no Range:
    the whole object, of `size` bytes)."""
    total = 0
    for method, path, span in requests:
        if method != "GET" or not path.endswith("/" + name):
            continue
        if not span:
            total += size
            continue
        first, _, last = span.removeprefix("bytes=").partition("-")
        if first == "":  # a suffix: the last N bytes
            total += int(last)
        else:
            total += (int(last) if last else size - 1) - int(first) + 1
    return total


def test_from_s3_a_loader_reads_only_the_column_it_asks_for(store, data, env, tmp_path):
    path = os.path.join(data, "wide.parquet")
    with object_store.CountingProxy(store.endpoint) as proxy:
        env.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        ds = stoker.Dataset("s3://tables/wide/", cache_dir=tmp_path / "c", fetch=options())
        opened = len(proxy.requests)
        assert _asked(proxy.requests, os.path.getsize(path)) < os.path.getsize(path) / 10
        labels, stats = label_rows(ds)
        loading = proxy.requests[opened:]
    assert labels == wide_labels(data)
    label_bytes = chunk_bytes(path, "label")
    assert stats["bytes_read"] <= 1.2 * label_bytes, (stats["bytes_read"], label_bytes)
    moved = _asked(loading, os.path.getsize(path))
    assert moved <= 1.2 * label_bytes + footer_bytes(path), (moved, label_bytes, loading)
