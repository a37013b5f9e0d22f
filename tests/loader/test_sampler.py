"""The sampler: a pure function of (seed, epoch, rank, world size, groups); no data read.

The lazy plans are checked against `reference_order`, the same algorithm written eagerly
and plainly: the whole line as a list, segments cut by hand, every bucket built."""

from __future__ import annotations

import pickle
import time
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest

from stoker.errors import StokerError, UsageError
from stoker.loader import sample_orders, sampler
from stoker.loader.epochs import EpochCursor, Order
from stoker.loader.sampler import MixSpec, _source_seed, plan_epoch

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # not among the test extras everywhere: the fixed cases still run
    given = None


# -- the reference ------------------------------------------------------------------------


def _gen(*words):
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(words))))


def _line(sizes, shuffle, seed, epoch):
    """Every sample along the line, and the group each comes from."""
    sizes = [int(s) for s in sizes]
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    order = _gen(seed, epoch, 0).permutation(len(sizes)) if shuffle else range(len(sizes))
    samples, groups = [], []
    for q in order:
        samples.extend(range(int(starts[q]), int(starts[q]) + sizes[q]))
        groups.extend([int(q)] * sizes[q])
    return samples, groups


def _per_rank(total, world, drop_last):
    return total // world if drop_last else -(-total // world)


def _stretch(seq, rank, world, drop_last):
    per = _per_rank(len(seq), world, drop_last)
    return [seq[(rank * per + i) % len(seq)] for i in range(per)]


def _mix_line(sizes, mix, shuffle, seed, epoch, window, block):
    """A Mix's whole epoch: every source's take of its stream, every label."""
    counts = [int(c) for c in mix.counts()]
    total = mix.epoch_samples
    bounds = np.concatenate([[0], np.cumsum(mix.groups)]).astype(int)
    firsts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    takes = []
    for s, c in enumerate(counts):
        own = list(sizes[bounds[s] : bounds[s + 1]])
        n = sum(own)
        if c and not n:
            raise UsageError("no samples")
        stream = []
        p = 0
        while len(stream) < (epoch + 1) * c:
            order = reference_order(
                own,
                shuffle=shuffle,
                seed=_source_seed(seed, s),
                epoch=p,
                rank=0,
                world_size=1,
                drop_last=False,
                shuffle_window=window,
            )
            stream.extend(int(firsts[bounds[s]]) + v for v in order)
            p += 1
        takes.append(stream[epoch * c : (epoch + 1) * c])
    by_block = {}
    for s, c in enumerate(counts):
        for k in range(c):
            key = Fraction(2 * k + 1, 2 * c) * total
            by_block.setdefault(int(key // block), []).append((key, s))
    labels = []
    for b in range(-(-total // block)):
        entries = sorted(by_block.get(b, []))
        if shuffle:
            plain = np.array(sorted(s for _, s in entries), np.int64)
            labels.extend(_gen(seed, epoch, 3, b).permutation(plain).tolist())
        else:
            labels.extend(s for _, s in entries)
    taken = [0] * len(counts)
    line = []
    for s in labels:
        line.append(takes[s][taken[s]])
        taken[s] += 1
    return line


def reference_order(
    sizes,
    *,
    shuffle,
    seed,
    epoch,
    rank,
    world_size,
    drop_last,
    shuffle_window=sampler.DEFAULT_SHUFFLE_WINDOW,
    consumed=None,
    mix=None,
    block=None,
):
    """The rank's whole order, computed eagerly from the algorithm's description."""
    sizes = [int(s) for s in sizes]
    w = max(1, shuffle_window)
    kw = dict(
        shuffle=shuffle, seed=seed, epoch=epoch, shuffle_window=shuffle_window, mix=mix, block=block
    )
    if consumed is not None:
        old_world, old_drop_last, done = consumed
        rest = []
        for r in range(old_world):
            rest.extend(
                reference_order(sizes, rank=r, world_size=old_world, drop_last=old_drop_last, **kw)[
                    done:
                ]
            )
        if mix is not None:
            line = _mix_line(sizes, mix, shuffle, seed, epoch, shuffle_window, block)
        else:
            line = _line(sizes, shuffle, seed, epoch)[0]
        if old_drop_last:
            rest.extend(line[old_world * _per_rank(len(line), old_world, True) :])
        return _stretch(rest, rank, world_size, drop_last) if rest else []
    if mix is not None:
        line = _mix_line(sizes, mix, shuffle, seed, epoch, shuffle_window, block)
        return _stretch(line, rank, world_size, drop_last) if line else []
    samples, groups = _line(sizes, shuffle, seed, epoch)
    if not samples:
        return []
    positions = _stretch(list(range(len(samples))), rank, world_size, drop_last)
    if not shuffle:
        return [samples[p] for p in positions]
    segments, previous = [], None
    for p in positions:
        if previous is not None and p == previous + 1 and groups[p] == groups[previous]:
            segments[-1].append(samples[p])
        else:
            segments.append([samples[p]])
        previous = p
    n = np.array([len(s) for s in segments], np.int64)
    counts = _gen(seed, epoch, 4, rank, world_size).multinomial(n, [1.0 / w] * w)
    buckets = [[] for _ in range(len(segments) + w - 1)]

    def permutation(size, lazy, *words):
        # A segment of more than LAZY_SEGMENT samples, and a bucket that may hold a piece
        # of one, are permuted by a KeyedPermutation; the rest by numpy's permutation.
        if lazy:
            return sample_orders.KeyedPermutation(size, *words).at(np.arange(size))
        return _gen(*words).permutation(size)

    large = n > sample_orders.LAZY_SEGMENT
    for j, segment in enumerate(segments):
        dealt = np.array(segment)[
            permutation(len(segment), large[j], seed, epoch, 6, rank, world_size, j)
        ]
        at = 0
        for i in range(w):
            buckets[j + i].extend(dealt[at : at + counts[j, i]].tolist())
            at += counts[j, i]
    order = []
    for k, bucket in enumerate(buckets):
        bucket = np.array(bucket, np.int64)
        lazy = large[max(0, k - w + 1) : k + 1].any()
        order.extend(bucket[permutation(len(bucket), lazy, seed, epoch, 5, rank, world_size, k)])
    return [int(v) for v in order]


# -- checks shared by the fixed cases and the generated ones ------------------------------


def _plan(sizes, **kw):
    kw.setdefault("batch_size", 8)
    return plan_epoch(sizes, **kw)


def _check_against_reference(sizes, block=None, **kw):
    """`plan.indices`, batch by batch, and random takes all give the reference."""
    block = block or sampler.MIX_BLOCK
    saved, sampler.MIX_BLOCK = sampler.MIX_BLOCK, block
    try:
        plan = _plan(sizes, **kw)
    finally:
        sampler.MIX_BLOCK = saved
    ref = np.array(
        reference_order(sizes, block=block, **{k: v for k, v in kw.items() if k != "batch_size"}),
        np.int64,
    )
    assert plan.samples == len(ref)
    assert np.array_equal(plan.indices, ref)
    b = plan.batch_size
    assert len(plan) == sampler.batch_count(len(ref), b, kw["drop_last"])
    for k in range(len(plan)):
        assert np.array_equal(plan.batch(k), ref[k * b : (k + 1) * b])
    rng = np.random.default_rng(len(ref))
    for _ in range(6):  # in no order: each comes without the ones before it
        a = int(rng.integers(0, len(ref) + 1))
        n = int(rng.integers(0, len(ref) - a + 1))
        assert np.array_equal(plan.take(a, n), ref[a : a + n])
    _check_spans(plan, sizes, int(rng.integers(0, len(plan) + 1)))
    return plan, ref


def _true_spans(plan, sizes, start):
    ends = np.cumsum(np.asarray(sizes, np.int64))
    first, last = {}, {}
    for k in range(start, len(plan)):
        for g in np.searchsorted(ends, plan.batch(k), side="right").tolist():
            first.setdefault(g, k)
            last[g] = k
    return first, last


def _check_spans(plan, sizes, start):
    groups, first, last = plan.group_spans(start)
    true_first, true_last = _true_spans(plan, sizes, start)
    got = dict(zip(groups.tolist(), zip(first.tolist(), last.tolist())))
    assert len(got) == len(groups)  # each group once
    assert set(got) == set(true_first)  # every group read, and nothing else
    for g, (f, l_) in got.items():
        assert start <= f <= true_first[g] and true_last[g] <= l_ < len(plan)
    assert np.all(np.diff(first) >= 0)  # in the order batches first read them
    if not (plan.samples and isinstance(plan._order, sampler._Shuffled)):
        assert got == {g: (true_first[g], true_last[g]) for g in true_first}  # walked: exact


FIXED = [
    dict(sizes=[3, 4], shuffle=True, seed=0, epoch=0, rank=0, world_size=1, drop_last=False),
    dict(
        sizes=[5, 0, 0, 7, 1, 0],
        shuffle=True,
        seed=4,
        epoch=1,
        rank=1,
        world_size=2,
        drop_last=False,
        shuffle_window=3,
    ),
    dict(sizes=[2], shuffle=True, seed=1, epoch=0, rank=4, world_size=5, drop_last=False),
    dict(
        sizes=[1, 1, 1],
        shuffle=True,
        seed=2,
        epoch=3,
        rank=6,
        world_size=7,
        drop_last=False,
        shuffle_window=1,
    ),
    dict(sizes=[1, 2], shuffle=True, seed=2, epoch=3, rank=2, world_size=7, drop_last=True),
    dict(
        sizes=[30, 1, 17, 2, 9],
        shuffle=True,
        seed=9,
        epoch=2,
        rank=2,
        world_size=3,
        drop_last=True,
        shuffle_window=5,
        batch_size=4,
    ),
    dict(
        sizes=[30, 1, 17, 2, 9],
        shuffle=False,
        seed=9,
        epoch=2,
        rank=2,
        world_size=4,
        drop_last=False,
        batch_size=5,
    ),
    dict(sizes=[0, 0], shuffle=True, seed=0, epoch=0, rank=0, world_size=2, drop_last=False),
    dict(
        sizes=list(range(1, 40)),
        shuffle=True,
        seed=5,
        epoch=0,
        rank=3,
        world_size=4,
        drop_last=False,
        shuffle_window=0,
        batch_size=3,
    ),
]


@pytest.mark.parametrize("case", FIXED)
def test_the_plan_is_the_reference(case):
    _check_against_reference(**case)


@pytest.fixture
def lazy_segments(monkeypatch):
    """Segments of more than 6 samples permuted lazily, as those of millions are."""
    monkeypatch.setattr(sample_orders, "LAZY_SEGMENT", 6)


@pytest.mark.parametrize("case", FIXED)
def test_lazily_permuted_plans_are_the_reference(case, lazy_segments):
    _check_against_reference(**case)


def test_lazily_permuted_plans_keep_the_guarantees(lazy_segments):
    sizes = np.array([40, 3, 17, 1, 0, 9, 64, 5, 2, 30], np.int64)
    for drop_last in (True, False):
        plans = _plans(sizes, 3, drop_last=drop_last, shuffle_window=3, batch_size=4)
        seen = np.concatenate([p.indices for p in plans])
        if drop_last:
            assert len(np.unique(seen)) == len(seen)  # disjoint ranks
        else:
            assert set(seen.tolist()) == set(range(int(sizes.sum())))  # every sample read
        for p in plans:
            assert len(np.unique(p.indices)) == p.samples  # each once in its stretch
            _check_spans(p, sizes, 2)
            again = pickle.loads(pickle.dumps(p))
            assert np.array_equal(again.indices, p.indices)
    one, other = (_plans(sizes, 1, seed=seed)[0].indices for seed in (1, 2))
    assert not np.array_equal(one, other)


def test_a_billion_row_group_plans_lazily():
    """One group of a billion samples (a .npy or HDF5 file read in place): a rank's segment
    of 125M samples is permuted where batches read it, not made whole (1 GB and 9 s at
    every epoch); its order is still a permutation of the stretch, batch by batch."""
    for world, rank in ((8, 0), (8, 7), (1, 0)):
        tracemalloc.start()
        try:
            began = time.perf_counter()
            plan = plan_epoch(
                [10**9],
                batch_size=256,
                shuffle=True,
                seed=1,
                epoch=2,
                rank=rank,
                world_size=world,
                drop_last=True,
            )
            first = plan.batch(0)
            took = time.perf_counter() - began
            middle = plan.batch(len(plan) // 2)
            last = plan.batch(len(plan) - 1)
            groups, _, _ = plan.group_spans(len(plan) - 3)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        stretch = 10**9 // world
        both = np.concatenate([first, middle, last])
        assert len(np.unique(both)) == 3 * 256
        assert (both >= rank * stretch).all() and (both < (rank + 1) * stretch).all()
        assert groups.tolist() == [0]
        assert peak < 50e6
        assert took < 2.0  # milliseconds; the bound only catches work in N


@pytest.mark.parametrize("world,done", [(3, 0), (2, 7), (4, 5)])
@pytest.mark.parametrize("old_drop_last,drop_last", [(True, True), (False, False), (True, False)])
def test_elastic_plans_are_the_reference(world, done, old_drop_last, drop_last):
    sizes = [13, 0, 4, 22, 1, 9]
    for rank in range(world):
        _check_against_reference(
            sizes,
            shuffle=True,
            seed=3,
            epoch=1,
            rank=rank,
            world_size=world,
            drop_last=drop_last,
            shuffle_window=3,
            consumed=(3, old_drop_last, done),
            batch_size=4,
        )


MIX_CASES = [
    dict(sizes=[10, 5, 0, 7], mix=MixSpec((2, 2), (0.7, 0.3), 50), shuffle=True),
    dict(sizes=[10, 5, 0, 7], mix=MixSpec((2, 2), (0.5, 0.5), 61), shuffle=False),
    dict(sizes=[3, 4, 6, 1, 2], mix=MixSpec((1, 3, 1), (0.2, 0.5, 0.3), 40), shuffle=True, block=5),
    dict(
        sizes=[3, 4, 6, 1, 2], mix=MixSpec((1, 3, 1), (0.2, 0.5, 0.3), 40), shuffle=False, block=3
    ),
    dict(sizes=[3, 4, 6, 1, 2], mix=MixSpec((1, 3, 1), (1.0, 0.0, 0.3), 33), shuffle=True, block=4),
]


@pytest.mark.parametrize("case", MIX_CASES)
@pytest.mark.parametrize("epoch", [0, 3])
@pytest.mark.parametrize("world,drop_last", [(1, False), (3, False), (2, True)])
def test_mix_plans_are_the_reference(case, epoch, world, drop_last):
    for rank in range(world):
        _check_against_reference(
            seed=11,
            epoch=epoch,
            rank=rank,
            world_size=world,
            drop_last=drop_last,
            shuffle_window=2,
            batch_size=6,
            **case,
        )
    _check_against_reference(
        seed=11,
        epoch=epoch,
        rank=0,
        world_size=world,
        drop_last=drop_last,
        shuffle_window=2,
        batch_size=6,
        consumed=(2, True, 5),
        **case,
    )


if given is not None:

    @st.composite
    def _cases(draw):
        world = draw(st.integers(1, 6))
        return dict(
            sizes=draw(st.lists(st.integers(0, 25), max_size=10)),
            shuffle=draw(st.booleans()),
            seed=draw(st.integers(0, 2**40)),
            epoch=draw(st.integers(0, 6)),
            rank=draw(st.integers(0, world - 1)),
            world_size=world,
            drop_last=draw(st.booleans()),
            shuffle_window=draw(st.integers(0, 6)),
            batch_size=draw(st.integers(1, 9)),
        )

    quick = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

    @quick
    @given(_cases())
    def test_generated_plans_are_the_reference(case):
        _check_against_reference(**case)

    @quick
    @given(_cases(), st.integers(1, 4), st.booleans(), st.integers(0, 30))
    def test_generated_elastic_plans_are_the_reference(case, old_world, old_drop_last, done):
        total = sum(case["sizes"])
        done = min(done, _per_rank(total, old_world, old_drop_last))
        _check_against_reference(consumed=(old_world, old_drop_last, done), **case)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        _cases(), st.integers(1, 3), st.integers(0, 80), st.sampled_from([2, 7, 65536]), st.data()
    )
    def test_generated_mix_plans_are_the_reference(case, sources, epoch_samples, block, data):
        sizes = case["sizes"] or [0]
        cuts = sorted(
            data.draw(
                st.lists(st.integers(0, len(sizes)), min_size=sources - 1, max_size=sources - 1)
            )
        )
        groups = tuple(np.diff([0, *cuts, len(sizes)]).tolist())
        weights = tuple(data.draw(st.lists(st.integers(0, 5), min_size=sources, max_size=sources)))
        if not sum(weights):
            weights = (1,) * sources
        mix = MixSpec(groups, tuple(float(w) for w in weights), epoch_samples)
        case = {**case, "sizes": sizes, "mix": mix, "block": block}
        empty = [
            s
            for s, c in enumerate(mix.counts())
            if c and not sum(sizes[sum(groups[:s]) : sum(groups[: s + 1])])
        ]
        if empty:
            with pytest.raises(UsageError, match=f"source {empty[0]} of a Mix has no samples"):
                _plan(**{k: v for k, v in case.items() if k != "block"})
        else:
            _check_against_reference(**case)


# -- what the order promises --------------------------------------------------------------


def _sizes(n_groups, seed=0):
    return np.random.default_rng(seed).integers(1, 60, n_groups)


def _plans(sizes, world, **kw):
    args = dict(batch_size=8, shuffle=True, seed=3, epoch=0, drop_last=False)
    args.update(kw)
    return [plan_epoch(sizes, rank=r, world_size=world, **args) for r in range(world)]


def test_natural_order_without_shuffle():
    plan = plan_epoch(
        [3, 4], batch_size=3, shuffle=False, seed=0, epoch=5, rank=0, world_size=1, drop_last=False
    )
    assert plan.indices.tolist() == list(range(7))
    assert [plan.batch(k).tolist() for k in range(len(plan))] == [[0, 1, 2], [3, 4, 5], [6]]


def test_same_arguments_same_order_and_epochs_and_seeds_differ():
    sizes = _sizes(30)
    orders = [
        np.concatenate([p.indices for p in _plans(sizes, 2, seed=s, epoch=e)])
        for s, e in [(0, 0), (0, 0), (0, 1), (1, 0)]
    ]
    assert np.array_equal(orders[0], orders[1])
    for order in orders:
        assert sorted(order.tolist()) == list(range(int(sizes.sum())))
    assert not np.array_equal(orders[0], orders[2])
    assert not np.array_equal(orders[0], orders[3])


@pytest.mark.parametrize("window", [1, 2, 5])
def test_samples_come_from_a_window_of_groups(window):
    sizes = np.full(40, 25)
    seed, epoch = 7, 0
    (plan,) = _plans(sizes, 1, seed=seed, shuffle_window=window)
    group_order = _gen(seed, epoch, 0).permutation(len(sizes))  # one rank: segment = group
    segment_of_group = np.empty(len(sizes), np.int64)
    segment_of_group[group_order] = np.arange(len(sizes))
    group = plan.indices // 25
    segment = segment_of_group[group]
    # Reading in order, a segment in use never lies `window` or more segments behind the
    # newest one started: at most `window` are open at once.
    newest = np.maximum.accumulate(segment)
    assert (newest - segment).max() <= window - 1
    # and the window really mixes: with window > 1, consecutive samples change group often
    if window > 1:
        assert (np.diff(group) != 0).mean() > 0.3


@pytest.mark.parametrize("n_groups", [1, 7, 50])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranks_balanced_and_covering(n_groups, world):
    sizes = _sizes(n_groups, seed=n_groups)
    total = int(sizes.sum())
    plans = _plans(sizes, world)
    assert len({len(p) for p in plans}) == 1  # same number of batches on every rank
    assert len({p.samples for p in plans}) == 1
    union = np.concatenate([p.indices for p in plans])
    assert set(union.tolist()) == set(range(total))  # nothing lost
    assert len(union) - total < world  # padding by wrap-around is at most world - 1


@pytest.mark.parametrize("world", [2, 3, 8])
def test_ranks_disjoint_with_drop_last(world):
    sizes = _sizes(23, seed=world)
    total = int(sizes.sum())
    plans = _plans(sizes, world, drop_last=True)
    union = np.concatenate([p.indices for p in plans])
    assert len(set(union.tolist())) == len(union)  # disjoint
    assert total - len(union) < world
    assert len({len(p) for p in plans}) == 1
    for p in plans:  # the partial last batch is dropped
        assert all(len(p.batch(k)) == p.batch_size for k in range(len(p)))


def test_each_rank_touches_a_share_of_the_groups():
    sizes = np.full(64, 100)
    for p in _plans(sizes, 8, shuffle_window=4):
        touched = np.unique(p.indices // 100)
        assert len(touched) <= 64 // 8 + 1  # its stretch: the window mixes within it


def test_more_ranks_than_samples():
    plans = _plans([2], 5)
    assert all(p.samples == 1 for p in plans)
    assert {int(p.indices[0]) for p in plans} == {0, 1}


@pytest.mark.parametrize("new_world", [3, 6])
def test_elastic_every_sample_once(new_world):
    # 4 ranks read `done` samples each; the rest shared out over 3 (or 6) ranks: with
    # drop_last on both sides, and a rest that splits evenly, every sample exactly once.
    sizes = np.array([17, 40, 3, 60, 25, 55, 40])  # 240 samples: 60 a rank
    done = 15
    kw = dict(batch_size=5, shuffle=True, seed=8, epoch=2, drop_last=True, shuffle_window=3)
    read = [plan_epoch(sizes, rank=r, world_size=4, **kw).take(0, done) for r in range(4)]
    rest = [
        plan_epoch(sizes, rank=r, world_size=new_world, consumed=(4, True, done), **kw)
        for r in range(new_world)
    ]
    assert len({len(p) for p in rest}) == 1
    everything = np.concatenate(read + [p.indices for p in rest])
    assert sorted(everything.tolist()) == list(range(240))


def test_elastic_with_a_dropped_end_and_uneven_rest():
    sizes = _sizes(15, seed=4)  # its total is not a multiple of 4
    total = int(sizes.sum())
    kw = dict(batch_size=4, shuffle=True, seed=1, epoch=0, drop_last=True)
    read = [plan_epoch(sizes, rank=r, world_size=4, **kw).take(0, 9) for r in range(4)]
    rest = [
        plan_epoch(sizes, rank=r, world_size=3, consumed=(4, True, 9), **kw).indices
        for r in range(3)
    ]
    everything = np.concatenate(read + rest).tolist()
    assert len(set(everything)) == len(everything)  # nothing twice
    assert total - len(everything) < 3  # only the new split's end is dropped


def test_mix_exact_counts_passes_without_repeats_and_disjoint_ranks():
    sizes = np.array([30, 30, 40, 20, 30])  # source 0: 100 samples, source 1: 50
    mix = MixSpec((3, 2), (0.6, 0.4), 150)  # 90 of source 0, 60 of source 1 (1.2 passes)
    kw = dict(batch_size=10, shuffle=True, seed=5, drop_last=True)
    streams = {0: [], 1: []}
    for epoch in range(3):
        plans = [
            plan_epoch(sizes, rank=r, world_size=3, epoch=epoch, mix=mix, **kw) for r in range(3)
        ]
        whole = plan_epoch(sizes, rank=0, world_size=1, epoch=epoch, mix=mix, **kw).indices
        assert np.array_equal(np.concatenate([p.indices for p in plans]), whole)
        source = (whole >= 100).astype(int)
        assert np.bincount(source, minlength=2).tolist() == [90, 60]
        for s in (0, 1):
            streams[s].extend(whole[source == s].tolist())  # a source's stream, in order
        if epoch == 0:  # within one pass of source 0: ranks disjoint, no sample twice
            assert len(set(whole[source == 0].tolist())) == 90
    for s, n in ((0, 100), (1, 50)):
        stream = streams[s]
        for p in range(len(stream) // n):  # each whole pass: every sample of it once
            assert sorted(stream[p * n : (p + 1) * n]) == list(range(100 * s, 100 * s + n))
        assert len(set(stream[len(stream) // n * n :])) == len(stream) % n


def test_mix_source_without_samples_is_refused():
    with pytest.raises(UsageError, match="source 1 of a Mix has no samples"):
        plan_epoch(
            [5, 0],
            batch_size=2,
            shuffle=True,
            seed=0,
            epoch=0,
            rank=0,
            world_size=1,
            drop_last=False,
            mix=MixSpec((1, 1), (1.0, 1.0), 10),
        )


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("start", [0, 3, 11])
def test_group_spans_cover_what_batches_read(shuffle, start):
    sizes = _sizes(40, seed=2)
    for p in _plans(sizes, 3, shuffle=shuffle, drop_last=True, shuffle_window=4, batch_size=5):
        _check_spans(p, sizes, start)
    mix = MixSpec((25, 15), (0.3, 0.7), 500)
    for p in _plans(sizes, 2, shuffle=shuffle, mix=mix, batch_size=7):
        _check_spans(p, sizes, start)


def test_a_plan_pickles_without_its_caches():
    (plan,) = _plans(_sizes(20), 1)
    plan.batch(3)
    again = pickle.loads(pickle.dumps(plan))
    assert np.array_equal(again.indices, plan.indices)


def test_a_billion_samples_plan_lazily():
    # Kept cheap on purpose: 100,000 groups of 10,000 samples must plan and give batches
    # without anything of the epoch's length (an int64 array of it would be 8 GB).
    sizes = np.full(100_000, 10_000, np.int64)
    for rank in (0, 63):
        tracemalloc.start()
        try:
            began = time.perf_counter()
            plan = plan_epoch(
                sizes,
                batch_size=256,
                shuffle=True,
                seed=1,
                epoch=4,
                rank=rank,
                world_size=64,
                drop_last=True,
            )
            first = plan.batch(0)
            took = time.perf_counter() - began
            middle = plan.batch(len(plan) // 2)
            last = plan.batch(len(plan) - 1)
            groups, _, _ = plan.group_spans(len(plan) - 3)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert plan.samples == 10**9 // 64 and len(first) == len(middle) == len(last) == 256
        assert 0 < len(groups) <= 8 + 2  # a window of groups, at a bucket's boundary
        assert peak < 50e6
        assert took < 2.0  # about 10 ms; the bound only catches work in N


def test_empty_dataset_and_bad_arguments():
    plan = plan_epoch(
        [], batch_size=4, shuffle=True, seed=0, epoch=0, rank=0, world_size=2, drop_last=False
    )
    assert len(plan) == 0 and plan.indices.tolist() == []
    assert [len(a) for a in plan.group_spans(0)] == [0, 0, 0]
    with pytest.raises(ValueError, match="rank 2"):
        plan_epoch(
            [3], batch_size=4, shuffle=True, seed=0, epoch=0, rank=2, world_size=2, drop_last=False
        )
    with pytest.raises(ValueError, match="batch_size"):
        plan_epoch(
            [3], batch_size=0, shuffle=True, seed=0, epoch=0, rank=0, world_size=1, drop_last=False
        )
    with pytest.raises(IndexError, match="batch 1"):
        plan_epoch(
            [3], batch_size=4, shuffle=True, seed=0, epoch=0, rank=0, world_size=1, drop_last=False
        ).batch(1)


def _cursor(sizes):
    """An EpochCursor over groups `sizes`, one rank, batches of 2."""
    order = Order(
        np.array(sizes),
        batch_size=2,
        shuffle=True,
        seed=0,
        drop_last=False,
        rank=0,
        world_size=1,
        shuffle_window=8,
    )
    return EpochCursor(order)


def test_a_state_of_the_old_order_is_refused():
    cursor = _cursor([5, 5])
    state = cursor.state_dict(10)
    assert state["version"] == 3
    with pytest.raises(StokerError, match="earlier stoker.*cannot be resumed exactly.*set_epoch"):
        cursor.load_state_dict({**state, "version": 1, "epoch": 3}, 10)
    with pytest.raises(StokerError, match="version 7 is not supported"):
        cursor.load_state_dict({**state, "version": 7}, 10)
    cursor.load_state_dict(state, 10)
    # Version 2 had the same order where no group is permuted lazily, as here.
    cursor.load_state_dict({**state, "version": 2}, 10)


def test_a_state_of_the_order_before_lazy_segments_is_refused_where_it_differs(lazy_segments):
    cursor = _cursor([5, 9])
    state = cursor.state_dict(14)
    cursor.load_state_dict(state, 14)
    with pytest.raises(StokerError, match="groups of more than 6 samples.*one of 9.*set_epoch"):
        cursor.load_state_dict({**state, "version": 2}, 14)


def test_random_permutation_is_numpys():
    """The C++ permutation makes numpy's default_rng(words).permutation(n), bit for bit:
    keys of no words, of several, of values past 32 bits (SeedSequence splits them); and
    a negative value is numpy's ValueError."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        words = [
            int(v)
            for v in rng.integers(
                0, 2 ** int(rng.choice([8, 32, 40, 64])), rng.integers(0, 7), np.uint64
            )
        ]
        n = int(rng.choice([0, 1, 2, 3, 100, int(rng.integers(0, 3000))]))
        got = sample_orders.random_permutation(n, *words)
        assert got.dtype == np.int64
        assert np.array_equal(got, np.random.default_rng(words).permutation(n))
    assert sample_orders.seed_words(0, 2**32, 2**64 + 3) == [0, 0, 1, 3, 0, 1]
    with pytest.raises(ValueError):
        sample_orders.random_permutation(5, 1, -2)
