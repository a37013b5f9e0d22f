"""Loader: order, ranks, resume, zero-copy batches, errors, the fields= and map= paths."""

import gc
import io
import json
import tarfile
import threading
import time
import zipfile

import numpy as np
import pytest
import torch

import stoker
from tests.support.concurrency import run_in_fork
from tests.support.shards import write_tar, write_tar_members, write_zip

SHAPE = (3, 4, 4)


def _write_dataset(folder, n_shards=5, per_shard=37, seed=0):
    """Shards of samples with a fixed-shape 'raw', an integer 'cls' and variable 'jpg'."""
    rng = np.random.default_rng(seed)
    truth = {}
    for s in range(n_shards):
        samples = []
        for i in range(per_shard):
            key = f"s{s}/{i:04d}"
            raw = rng.integers(0, 256, int(np.prod(SHAPE)), dtype=np.uint8).tobytes()
            cls = int(rng.integers(-5, 1000))
            jpg = rng.bytes(int(rng.integers(1, 200)))
            fields = {"raw": raw, "cls": f" {cls}\n".encode(), "jpg": jpg}
            samples.append((key, fields))
            truth[key] = (raw, cls, jpg)
        write_tar(folder / f"shard-{s:04d}.tar", samples)
    return stoker.Dataset(str(folder)), truth


FIELDS = {"raw": stoker.Raw(SHAPE, "uint8"), "cls": stoker.Int(), "jpg": stoker.Bytes()}


@pytest.fixture
def data(tmp_path):
    return _write_dataset(tmp_path)


def _keys(loader):
    return [key for batch in loader for key in batch["__key__"]]


def test_batches_hold_the_bytes_on_disk(data):
    ds, truth = data
    seen = 0
    for batch in stoker.Loader(ds, 16, fields=FIELDS):
        assert batch["raw"].shape[1:] == SHAPE and batch["raw"].dtype == torch.uint8
        for j, key in enumerate(batch["__key__"]):
            raw, cls, jpg = truth[key]
            assert batch["raw"][j].numpy().tobytes() == raw
            assert int(batch["cls"][j]) == cls
            assert bytes(batch["jpg"][j]) == jpg
            seen += 1
    assert seen == len(ds)


@pytest.mark.parametrize("threads,prefetch", [(1, 1), (2, 4), (5, 9)])
def test_order_independent_of_threads_and_prefetch(data, threads, prefetch):
    ds, _ = data
    reference = _keys(stoker.Loader(ds, 10, fields=FIELDS, seed=4))
    again = _keys(
        stoker.Loader(ds, 10, fields=FIELDS, seed=4, num_threads=threads, prefetch=prefetch)
    )
    assert again == reference


def test_epochs_reshuffle_and_cover_the_same_samples(data):
    ds, truth = data
    loader = stoker.Loader(ds, 16, fields=FIELDS)
    first, second = _keys(loader), _keys(loader)  # epochs advance by themselves
    assert sorted(first) == sorted(second) == sorted(truth)
    assert first != second
    loader.set_epoch(0)
    assert _keys(loader) == first
    assert _keys(stoker.Loader(ds, 16, fields=FIELDS, shuffle=False)) == ds.keys(range(len(ds)))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks(data, world, drop_last):
    ds, truth = data
    loaders = [
        stoker.Loader(ds, 8, fields=FIELDS, rank=r, world_size=world, drop_last=drop_last)
        for r in range(world)
    ]
    per_rank = [_keys(loader) for loader in loaders]
    assert len({len(loader) for loader in loaders}) == 1  # same number of batches
    union = [k for keys in per_rank for k in keys]
    if drop_last:
        assert len(set(union)) == len(union)  # disjoint
    else:
        assert set(union) == set(truth)  # covering


def test_rank_from_environment(data, monkeypatch):
    ds, _ = data
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = stoker.Loader(ds, 8, fields=FIELDS)
    assert (loader.rank, loader.world_size) == (1, 3)
    with pytest.raises(stoker.StokerError, match="rank 3"):
        stoker.Loader(ds, 8, rank=3, world_size=3)


@pytest.mark.parametrize("stop_after", [0, 1, 7, 12, 13, 25])
def test_resume_is_exact(data, stop_after):
    ds, _ = data
    # 185 samples, batches of 15: 13 per epoch; stop points cross the epoch boundary
    first = stoker.Loader(ds, 15, fields=FIELDS, seed=9)
    state = first.state_dict() if stop_after == 0 else None
    expected, taken = [], 0
    for _ in range(2):
        for batch in first:
            taken += 1
            if taken > stop_after:
                expected.append(batch["__key__"])
            if taken == stop_after:  # after `stop_after` batches, through JSON
                state = json.loads(json.dumps(first.state_dict()))
    resumed = stoker.Loader(ds, 15, fields=FIELDS, seed=9, num_threads=3, prefetch=1)
    resumed.load_state_dict(state)
    got = []
    while len(got) < len(expected):
        got.extend(batch["__key__"] for batch in resumed)
    assert got[: len(expected)] == expected


def test_resume_refuses_a_different_setup(data):
    ds, _ = data
    state = stoker.Loader(ds, 15, fields=FIELDS).state_dict()
    with pytest.raises(stoker.StokerError, match="batch_size=15"):
        stoker.Loader(ds, 16, fields=FIELDS).load_state_dict(state)


def test_held_batches_are_never_overwritten(data):
    ds, _ = data
    held, copies = [], []
    for _ in range(3):
        for batch in stoker.Loader(ds, 8, fields=FIELDS, prefetch=2):
            held.append(batch["raw"])
            copies.append(batch["raw"].clone())
    assert all(torch.equal(h, c) for h, c in zip(held, copies))


def test_npy_rows(tmp_path):
    a = np.arange(40 * 6, dtype="<f4").reshape(40, 2, 3)
    np.save(tmp_path / "a.npy", a)
    ds = stoker.Dataset(str(tmp_path / "a.npy"))
    rows = []
    for batch in stoker.Loader(ds, 16, fields={"npy": stoker.Npy()}, shuffle=False):
        assert batch["npy"].dtype == torch.float32
        rows.append(batch["npy"].numpy())
    assert np.array_equal(np.concatenate(rows), a)


def _npy_bytes(a):
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_npy_members_of_a_tar(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"k{i:03d}": rng.standard_normal((2, 5)).astype("<f8") for i in range(30)}
    samples = [(k, {"npy": _npy_bytes(a), "cls": b"1"}) for k, a in arrays.items()]
    ds = stoker.Dataset(write_tar(tmp_path / "n.tar", samples))
    for batch in stoker.Loader(ds, 8, fields={"npy": stoker.Npy()}):
        assert batch["npy"].dtype == torch.float64 and batch["npy"].shape[1:] == (2, 5)
        for j, key in enumerate(batch["__key__"]):
            assert np.array_equal(batch["npy"][j].numpy(), arrays[key])


def test_npy_members_that_differ(tmp_path):
    samples = [(f"k{i:03d}", {"npy": _npy_bytes(np.zeros(4 if i != 9 else 5))}) for i in range(12)]
    ds = stoker.Dataset(write_tar(tmp_path / "n.tar", samples))
    loader = stoker.Loader(ds, 4, shuffle=False, fields={"npy": stoker.Npy()})
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(stoker.ShardFormatError, match=r"n\.tar: offset \d+: field 'npy'"):
        next(it)
    samples = [(f"k{i}", {"npy": _npy_bytes(np.zeros(3))}) for i in range(4)]
    zipped = stoker.Dataset(write_zip(tmp_path / "n.zip", samples, zipfile.ZIP_DEFLATED))
    with pytest.raises(stoker.ShardFormatError, match="compressed .npy members"):
        next(iter(stoker.Loader(zipped, 4, fields={"npy": stoker.Npy()})))


def test_csv_labels_as_a_field(tmp_path):
    root = tmp_path / "files"
    root.mkdir()
    lines = ["filename,label"]
    for i in range(20):
        (root / f"{i}.raw").write_bytes(bytes([i]) * 48)
        lines.append(f"{i}.raw,{i * 3}")
    (tmp_path / "labels.csv").write_text("\n".join(lines))
    ds = stoker.Dataset.from_csv(tmp_path / "labels.csv", root)
    loader = stoker.Loader(ds, 8, fields={"raw": stoker.Raw(SHAPE), "label": stoker.Int()})
    for batch in loader:
        for j, key in enumerate(batch["__key__"]):
            assert int(batch["label"][j]) == int(key) * 3
            assert batch["raw"][j].flatten()[0] == int(key)


def test_int_and_raw_fields_of_a_deflated_zip(tmp_path):
    # Compressed members are inflated by the reader; their integers are parsed afterwards.
    samples = [
        (f"k{i:03d}", {"cls": b"%d" % (i * 7 - 30), "raw": bytes([i]) * 48}) for i in range(40)
    ]
    path = write_zip(tmp_path / "d.zip", samples, zipfile.ZIP_DEFLATED)
    fields = {"cls": stoker.Int(), "raw": stoker.Raw(SHAPE)}
    for batch in stoker.Loader(stoker.Dataset(path), 16, fields=fields):
        for j, key in enumerate(batch["__key__"]):
            i = int(key[1:])
            assert int(batch["cls"][j]) == i * 7 - 30
            assert batch["raw"][j].flatten().tolist() == [i] * 48


def test_map_path(data):
    ds, truth = data

    def decode(sample):
        raw = np.frombuffer(sample["raw"], np.uint8).reshape(SHAPE).astype(np.float32)
        return {
            "__key__": sample["__key__"],
            "image": raw / 255,
            "label": int(bytes(sample["cls"])),
        }

    batches = list(stoker.Loader(ds, 16, map=decode))
    batch = batches[0]
    assert batch["image"].shape == (16, *SHAPE) and batch["image"].dtype == torch.float32
    assert batch["label"].tolist() == [truth[k][1] for k in batch["__key__"]]
    assert sum(len(b["__key__"]) for b in batches) == len(ds)


# -- errors and clean-up ------------------------------------------------------


def test_wrong_raw_size(data):
    ds, _ = data
    with pytest.raises(stoker.ShardFormatError, match=r"shard-\d+\.tar: offset \d+: field 'raw'"):
        next(iter(stoker.Loader(ds, 8, fields={"raw": stoker.Raw((5,))})))


def test_an_error_ahead_waits_for_its_batch(tmp_path):
    # Sample 30 (the 4th batch of 8, in order) has a wrong-size member: batches 0-2 are
    # read and handed out even though the 4th was submitted (and failed) before them.
    samples = [(f"k{i:03d}", {"raw": bytes(48 if i != 30 else 47)}) for i in range(40)]
    loader = stoker.Loader(
        stoker.Dataset(write_tar(tmp_path / "s.tar", samples)),
        8,
        shuffle=False,
        prefetch=4,
        fields={"raw": stoker.Raw(SHAPE)},
    )
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.raises(stoker.ShardFormatError, match="sample 'k030' is 47 bytes"):
        next(it)
    assert loader.state_dict()["batches_done"] == 3


def test_map_threads_do_not_pile_up(data):
    ds, _ = data
    before = threading.active_count()
    for _ in range(10):
        loader = stoker.Loader(ds, 8, map=lambda s: s["__key__"], collate=list)
        for i, _ in enumerate(loader):
            if i == 1:
                break
        del loader
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before + 2


def test_not_an_integer(tmp_path):
    samples = [(f"k{i}", {"cls": b"12" if i != 5 else b"twelve"}) for i in range(10)]
    path = write_tar(tmp_path / "ints.tar", samples)
    loader = stoker.Loader(stoker.Dataset(path), 10, fields={"cls": stoker.Int()})
    with pytest.raises(
        stoker.ShardFormatError,
        match=r"ints\.tar: offset \d+: field 'cls' of sample 'k5': not an integer: 'twelve'$",
    ):
        next(iter(loader))


def test_missing_field(tmp_path):
    path = tmp_path / "m.tar"
    write_tar_members(path, [(name, b"1") for name in ["a.cls", "a.raw", "b.cls"]])
    loader = stoker.Loader(
        stoker.Dataset(str(path)), 2, shuffle=False, fields={"raw": stoker.Bytes()}
    )
    with pytest.raises(stoker.StokerError, match="sample 'b' .* has no field 'raw'"):
        next(iter(loader))
    with pytest.raises(stoker.StokerError, match="field 'png' is in no sample"):
        stoker.Loader(stoker.Dataset(str(path)), 2, fields={"png": stoker.Bytes()})


def test_a_bad_shard_fails_its_batch_without_hanging(tmp_path):
    ds, _ = _write_dataset(tmp_path, n_shards=3)
    (tmp_path / "shard-0002.tar").write_bytes(b"")  # truncated after the dataset opened
    loader = stoker.Loader(ds, 8, fields=FIELDS, shuffle=False)
    it = iter(loader)
    for _ in range(4):  # the first shard's batches are fine
        next(it)
    with pytest.raises(stoker.ShardFormatError, match="shard-0002.tar"):
        for _ in it:
            pass


def test_breaking_out_cancels_reads_ahead(data):
    ds, _ = data
    loader = stoker.Loader(ds, 4, fields=FIELDS, prefetch=8)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    # the loop resumes where it stopped: three batches were handed out
    assert loader.state_dict()["batches_done"] == 3


def test_cuda_device_without_cuda_is_a_clear_error(data):
    ds, _ = data
    if stoker.cuda_status()["cuda"]:
        pytest.skip("this machine has CUDA")
    with pytest.raises(stoker.CudaError, match="'cuda:0' needs CUDA"):
        stoker.Loader(ds, 8, device="cuda")
    with pytest.raises(stoker.StokerError, match="not a CUDA device"):
        stoker.Loader(ds, 8, device="cuda:x")
    with pytest.raises(stoker.StokerError, match="'cpu', 'cuda' or 'cuda:N'"):
        stoker.Loader(ds, 8, device="mps")


def test_stats(data):
    ds, _ = data
    loader = stoker.Loader(ds, 16, fields=FIELDS)
    for _ in loader:
        pass
    stats = loader.stats()
    assert stats["samples"] == len(ds) and stats["batches"] == len(loader)
    assert stats["bytes"] > 0 and 0 <= stats["input_bound_fraction"] <= 1


@pytest.mark.parametrize("stored", [True, False])
def test_ascii_int_rule(tmp_path, stored):
    # The C++ reader parses Int() members, stored (straight from disk) and deflated
    # (inflated first): an optional sign and 1 to 18 digits, whitespace around allowed.
    texts = [
        b"0",
        b"-12",
        b" 42\n",
        b"+7",
        b"",
        b"1 2",
        b"x",
        b"-",
        b"9" * 19,
        b"123456789012345678",
    ]
    bad = [False, False, False, False, True, True, True, True, True, False]
    values = {0: 0, 1: -12, 2: 42, 3: 7, 9: 123456789012345678}
    method = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    for i, text in enumerate(texts):
        path = write_zip(tmp_path / f"{stored}-{i}.zip", [("k", {"cls": text})], method)
        loader = stoker.Loader(stoker.Dataset(path), 1, fields={"cls": stoker.Int()})
        if bad[i]:
            with pytest.raises(stoker.ShardFormatError, match="not an integer"):
                next(iter(loader))
        else:
            assert int(next(iter(loader))["cls"][0]) == values[i]


@pytest.mark.parametrize("old_world,new_world", [(2, 3), (4, 2), (3, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_elastic_resume_across_world_sizes(data, old_world, new_world, drop_last):
    # All ranks stop after 3 batches; the job comes back with another world size. The
    # rest of the epoch is shared out: no sample read twice, none lost (drop_last aside).
    ds, truth = data
    kw = dict(fields=FIELDS, seed=5, drop_last=drop_last)
    before, state = [], None
    for r in range(old_world):
        loader = stoker.Loader(ds, 8, rank=r, world_size=old_world, **kw)
        it = iter(loader)
        for _ in range(3):
            before.extend(next(it)["__key__"])
        state = json.loads(json.dumps(loader.state_dict()))
    after, lengths = [], set()
    for r in range(new_world):
        loader = stoker.Loader(ds, 8, rank=r, world_size=new_world, **kw)
        loader.load_state_dict(state)
        lengths.add(len(loader))
        after.extend(k for batch in loader for k in batch["__key__"])
        state_after = loader.state_dict()  # saved again once the shared-out epoch is over
        assert (state_after["epoch"], state_after["batches_done"]) == (0, len(loader))
    assert len(lengths) == 1  # every new rank has the same number of batches
    everything = before + after
    if drop_last:
        assert len(set(everything)) == len(everything)  # nothing read twice
        assert len(truth) - len(set(everything)) < old_world + new_world * 8
    else:
        assert set(everything) == set(truth)  # nothing lost
        assert len(everything) - len(truth) < old_world + new_world


def test_set_epoch_after_loading_keeps_the_position(data):
    ds, _ = data
    first = stoker.Loader(ds, 15, fields=FIELDS)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    expected = [b["__key__"] for b in it]
    resumed = stoker.Loader(ds, 15, fields=FIELDS)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])  # the usual top of a resumed training loop
    assert [b["__key__"] for b in resumed] == expected
    assert len(resumed) == len(first) == 13  # a whole epoch, resumed or not


def test_a_new_iterator_starts_the_epoch_over(data):
    ds, _ = data
    loader = stoker.Loader(ds, 15, fields=FIELDS)
    peek = next(iter(loader))  # a glance at the first batch's shapes
    keys = [b["__key__"] for b in loader]
    assert keys[0] == peek["__key__"] and len(keys) == len(loader)


def test_elastic_resume_at_an_epoch_boundary_is_a_plain_one(data):
    ds, _ = data
    old = stoker.Loader(ds, 8, fields=FIELDS, rank=0, world_size=2)
    for _ in old:
        pass
    new = stoker.Loader(ds, 8, fields=FIELDS, rank=1, world_size=3)
    new.load_state_dict(old.state_dict())  # epoch 0 done: the next is epoch 1
    fresh = stoker.Loader(ds, 8, fields=FIELDS, rank=1, world_size=3)
    fresh.set_epoch(1)
    assert _keys(new) == _keys(fresh)
    state = new.state_dict()  # checkpointable again right away
    assert (state["epoch"], state["batches_done"]) == (1, len(new))


def test_loader_pickles_and_threads_are_its_own(data):
    import pickle

    ds, _ = data
    loader = stoker.Loader(ds, 16, fields=FIELDS, num_threads=3)
    assert loader.num_threads == 3
    again = pickle.loads(pickle.dumps(loader))
    assert _keys(again) == _keys(stoker.Loader(ds, 16, fields=FIELDS))


def test_default_collate_keeps_bytes_as_lists(data):
    ds, _ = data
    loader = stoker.Loader(ds, 5, shuffle=False)
    batch = next(iter(loader))
    assert isinstance(batch["jpg"], list) and isinstance(batch["raw"], list)
    with pytest.raises(stoker.StokerError, match="lack 'extra'"):
        odd = stoker.Loader(
            ds,
            5,
            shuffle=False,
            map=lambda s: {"a": 1} if s["__key__"].endswith("1") else {"a": 1, "extra": 2},
        )
        next(iter(odd))


def test_map_after_fork(data):
    ds, _ = data
    loader = stoker.Loader(ds, 16, map=lambda s: {"k": s["__key__"]}, collate=list)
    next(iter(loader))  # the parent made its executor
    run_in_fork(lambda: sum(len(b) for b in loader) == len(ds), 30, "map= after fork")


def test_empty_dataset(tmp_path):
    with tarfile.open(tmp_path / "e.tar", "w"):
        pass
    loader = stoker.Loader(
        stoker.Dataset(str(tmp_path / "e.tar")), 4, fields={"x": stoker.Raw((1,))}
    )
    assert len(loader) == 0 and list(loader) == []


def _take_len(loader):
    """One epoch as Lightning and ``zip(range(len(L)), L)`` read it: len(L) batches, and
    never the next() that would raise StopIteration."""
    return [b["__key__"] for _, b in zip(range(len(loader)), loader)]


def test_an_epoch_read_to_its_last_batch_is_over_without_stop_iteration(data):
    ds, _ = data
    loader = stoker.Loader(ds, 32, fields={"cls": stoker.Int()})
    a, b, c = _take_len(loader), _take_len(loader), _take_len(loader)
    assert a != b and b != c and a != c
    reference = stoker.Loader(ds, 32, fields={"cls": stoker.Int()})
    for epoch, seen in enumerate((a, b, c)):
        reference.set_epoch(epoch)
        assert [k["__key__"] for k in reference] == seen
    state = loader.state_dict()  # every batch of epoch 2 done
    assert (state["epoch"], state["batches_done"]) == (2, len(loader))


def test_a_state_saved_after_the_last_batch_resumes_at_the_next_epoch(data):
    ds, _ = data
    first = stoker.Loader(ds, 15, fields=FIELDS, seed=3)
    _take_len(first)
    state = json.loads(json.dumps(first.state_dict()))
    expected = _take_len(first)  # epoch 1
    resumed = stoker.Loader(ds, 15, fields=FIELDS, seed=3)
    resumed.load_state_dict(state)
    assert _take_len(resumed) == expected
    # A loop that names the saved epoch again finds it done, then goes on.
    pinned = stoker.Loader(ds, 15, fields=FIELDS, seed=3)
    pinned.load_state_dict(state)
    pinned.set_epoch(0)
    assert _keys(pinned) == []
    pinned.set_epoch(1)
    assert _take_len(pinned) == expected


@pytest.mark.parametrize("stop_after", [1, 12, 13, 14, 26])
def test_resume_is_exact_when_epochs_end_without_stop_iteration(data, stop_after):
    ds, _ = data
    first = stoker.Loader(ds, 15, fields=FIELDS, seed=9)  # 13 batches an epoch
    stream, state = [], None
    for _ in range(3):
        for _, batch in zip(range(len(first)), first):
            stream.append(batch["__key__"])
            if len(stream) == stop_after:
                state = json.loads(json.dumps(first.state_dict()))
    resumed = stoker.Loader(ds, 15, fields=FIELDS, seed=9, prefetch=1)
    resumed.load_state_dict(state)
    got = []
    while len(got) < len(stream) - stop_after:
        got.extend(_take_len(resumed))
    assert got[: len(stream) - stop_after] == stream[stop_after:]


def test_breaking_out_early_still_starts_the_epoch_over(data):
    ds, _ = data
    loader = stoker.Loader(ds, 15, fields=FIELDS)
    whole = _take_len(loader)
    loader.set_epoch(0)
    for _, _batch in zip(range(len(loader) - 1), loader):  # one batch short of the end
        pass
    assert _take_len(loader) == whole  # the epoch was not over: it starts again


def _mixed_extensions(folder):
    """ImageNet-like: .jpg, .JPEG and .png side by side, labels in .cls or .txt."""
    samples, truth = [], {}
    for i in range(30):
        image = b"image-%d" % i
        ext = ("jpg", "JPEG", "png")[i % 3]
        label_ext = "cls" if i % 2 else "txt"
        samples.append((f"k{i:02d}", {ext: image, label_ext: b"%d" % (i % 5)}))
        truth[f"k{i:02d}"] = (image, i % 5)
    return stoker.Dataset(write_tar(folder / "mixed.tar", samples)), truth


def test_field_alternatives_take_the_first_a_sample_has(tmp_path):
    ds, truth = _mixed_extensions(tmp_path)
    loader = stoker.Loader(
        ds, 8, fields={"jpg;jpeg;png": stoker.Bytes(), "cls;txt": stoker.Int()}, seed=2
    )
    seen = 0
    for batch in loader:
        assert set(batch) == {"jpg", "cls", "__key__"}  # named by the first alternative
        for j, key in enumerate(batch["__key__"]):
            assert bytes(batch["jpg"][j]) == truth[key][0]
            assert int(batch["cls"][j]) == truth[key][1]
            seen += 1
    assert seen == len(truth)


def test_field_alternatives_prefer_the_earlier_one(tmp_path):
    both = [(f"k{i}", {"jpg": b"j%d" % i, "png": b"p%d" % i}) for i in range(4)]
    ds = stoker.Dataset(write_tar(tmp_path / "both.tar", both))
    batch = next(iter(stoker.Loader(ds, 4, shuffle=False, fields={"png;jpg": stoker.Bytes()})))
    assert [bytes(v) for v in batch["png"]] == [b"p0", b"p1", b"p2", b"p3"]


def test_a_sample_with_none_of_the_alternatives_is_named(tmp_path):
    samples = [("a", {"jpg": b"1"}), ("b", {"txt": b"2"}), ("c", {"png": b"3"})]
    ds = stoker.Dataset(write_tar(tmp_path / "none.tar", samples))
    loader = stoker.Loader(ds, 3, shuffle=False, fields={"jpg;jpeg;png": stoker.Bytes()})
    with pytest.raises(
        stoker.ShardFormatError, match=r"sample 'b' \(#1\) has no field of 'jpg', 'jpeg', 'png'"
    ):
        next(iter(loader))
    with pytest.raises(stoker.StokerError, match="no sample has any of the fields 'gif;bmp'"):
        stoker.Loader(ds, 3, fields={"gif;bmp": stoker.Bytes()})


def test_field_alternatives_that_cannot_be(tmp_path):
    ds, _ = _mixed_extensions(tmp_path)
    with pytest.raises(stoker.UsageError, match="empty name"):
        stoker.Loader(ds, 8, fields={"jpg;": stoker.Bytes()})
    with pytest.raises(stoker.UsageError, match="names the batch entry 'jpg' twice"):
        stoker.Loader(ds, 8, fields={"jpg;png": stoker.Bytes(), "jpg": stoker.Bytes()})


def test_sampler_set_epoch_is_the_loaders(data):
    # Code written for a DataLoader with a DistributedSampler, and Lightning, call this.
    ds, _ = data
    loader = stoker.Loader(ds, 15, fields=FIELDS)
    reference = stoker.Loader(ds, 15, fields=FIELDS)
    loader.sampler.set_epoch(3)
    reference.set_epoch(3)
    assert _keys(loader) == _keys(reference)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("old_world,new_world", [(3, 1), (2, 3)])
def test_an_epoch_saved_at_its_end_is_over_in_any_world_size(data, drop_last, old_world, new_world):
    # What the old ranks dropped stays dropped: the next batches are the next epoch's.
    ds, _ = data
    kw = dict(fields=FIELDS, seed=5, drop_last=drop_last)
    old = stoker.Loader(ds, 8, rank=0, world_size=old_world, **kw)
    _take_len(old)
    state = json.loads(json.dumps(old.state_dict()))
    assert (state["epoch"], state["batches_done"]) == (0, len(old))
    for r in range(new_world):
        new = stoker.Loader(ds, 8, rank=r, world_size=new_world, **kw)
        new.load_state_dict(state)
        fresh = stoker.Loader(ds, 8, rank=r, world_size=new_world, **kw)
        fresh.set_epoch(1)
        assert _take_len(new) == _take_len(fresh)
        pinned = stoker.Loader(ds, 8, rank=r, world_size=new_world, **kw)
        pinned.load_state_dict(state)
        pinned.set_epoch(0)  # a loop that counts epochs itself, resuming epoch 0
        assert _keys(pinned) == []


def test_an_elastic_epoch_saved_at_its_end_says_it_is_over(data):
    ds, _ = data
    kw = dict(fields=FIELDS, seed=5, drop_last=True)
    old = stoker.Loader(ds, 8, rank=0, world_size=2, **kw)
    it = iter(old)
    for _ in range(3):
        next(it)
    state = old.state_dict()
    new = stoker.Loader(ds, 8, rank=0, world_size=3, **kw)
    new.load_state_dict(state)
    for _ in new:  # the rest of epoch 0, shared out over three ranks
        pass
    done = json.loads(json.dumps(new.state_dict()))
    assert (done["epoch"], done["batches_done"]) == (0, len(new))
    again = stoker.Loader(ds, 8, rank=0, world_size=3, **kw)
    again.load_state_dict(done)
    again.set_epoch(0)
    assert _keys(again) == []  # epoch 0 is over: an empty pass, not a replay
    fresh = stoker.Loader(ds, 8, rank=0, world_size=3, **kw)
    fresh.set_epoch(1)
    assert _take_len(again) == _take_len(fresh)


def test_an_old_iterator_that_ends_late_does_not_move_the_epoch(data):
    ds, _ = data
    loader = stoker.Loader(ds, 15, fields=FIELDS)
    old = iter(loader)
    first = [next(old)["__key__"] for _ in range(len(loader))]  # all of epoch 0
    new_epoch = iter(loader)  # epoch 0 is done: this one begins epoch 1
    second = next(new_epoch)["__key__"]
    assert list(old) == []  # the old one reaches StopIteration now
    rest = [b["__key__"] for b in new_epoch]
    reference = stoker.Loader(ds, 15, fields=FIELDS)
    assert _take_len(reference) == first
    assert _take_len(reference) == [second, *rest]
    assert loader.state_dict()["epoch"] == 1


def _npy_member(array) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_npy_members_of_another_shape_are_named(tmp_path):
    good, other = _npy_member(np.zeros((2, 3), np.float32)), _npy_member(np.zeros(7, np.int8))
    samples = [("a", {"npy": good}), ("b", {"npy": other})]
    loader = stoker.Loader(
        stoker.Dataset(write_tar(tmp_path / "n.tar", samples)), 2, shuffle=False,
        fields={"npy": stoker.Npy()},
    )  # fmt: skip
    with pytest.raises(stoker.ShardFormatError, match="sample 'b' does not hold a \\(2, 3\\)"):
        next(iter(loader))


def test_npy_members_whose_headers_differ_but_sizes_agree_are_caught(tmp_path):
    a, b = _npy_member(np.zeros(4, "<i4")), _npy_member(np.zeros(4, "<f4"))  # same size
    loader = stoker.Loader(
        stoker.Dataset(write_tar(tmp_path / "n.tar", [("a", {"npy": a}), ("b", {"npy": b})])),
        2, shuffle=False, fields={"npy": stoker.Npy()},
    )  # fmt: skip
    with pytest.raises(stoker.ShardFormatError, match="differs from the batch's first"):
        next(iter(loader))


def test_a_member_that_is_not_a_npy_file(tmp_path):
    loader = stoker.Loader(
        stoker.Dataset(write_tar(tmp_path / "n.tar", [("a", {"npy": b"not numpy at all"})])),
        1, fields={"npy": stoker.Npy()},
    )  # fmt: skip
    with pytest.raises(stoker.ShardFormatError, match="field 'npy' is not a .npy file: bad magic"):
        next(iter(loader))


def test_npy_rows_of_two_shapes_in_one_batch(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((3, 2), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((3, 5), np.float32))
    loader = stoker.Loader(
        stoker.Dataset(str(tmp_path)), 6, shuffle=False, fields={"npy": stoker.Npy()}
    )
    with pytest.raises(stoker.ShardFormatError, match="must share one dtype and shape"):
        next(iter(loader))


def test_a_deflated_integer_too_long_to_be_one(tmp_path):
    path = write_zip(tmp_path / "z.zip", [("k", {"cls": b"1" * 100})], zipfile.ZIP_DEFLATED)
    loader = stoker.Loader(stoker.Dataset(path), 1, fields={"cls": stoker.Int()})
    with pytest.raises(stoker.ShardFormatError, match="100 bytes: too long for an integer"):
        next(iter(loader))


def test_labels_must_be_one_per_file(tmp_path):
    for name in ("a.bin", "b.bin"):
        (tmp_path / name).write_bytes(b"x")
    with pytest.raises(stoker.UsageError, match="3 labels for 2 files"):
        stoker.Dataset.from_files(tmp_path, ["a.bin", "b.bin"], [1, 2, 3])
    columns = np.array([[0, 7], [1, 9]])[:, 1]  # not contiguous: fine
    ds = stoker.Dataset.from_files(tmp_path, ["a.bin", "b.bin"], columns)
    batch = next(iter(stoker.Loader(ds, 2, shuffle=False, fields={"label": stoker.Int()})))
    assert batch["label"].tolist() == [7, 9]


def test_a_pickled_loader_carries_no_epoch_order(data):
    import pickle

    ds, _ = data
    loader = stoker.Loader(ds, 8, fields=FIELDS)
    next(iter(loader))
    assert len(pickle.dumps(loader)) < len(pickle.dumps(ds)) + 20_000
