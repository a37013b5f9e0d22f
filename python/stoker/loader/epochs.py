"""Where a Loader is: which epoch, how many of its batches were handed out, and the state
that resumes it exactly (also with another world size)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker.errors import StokerError
from stoker.loader import sample_orders
from stoker.loader.mixing import MixSpec
from stoker.loader.sampler import EpochPlan, batch_count, plan_epoch, rank_stretch

#: 3: segments of more than sample_orders.LAZY_SEGMENT samples permuted by a
#: KeyedPermutation; 2: the lazy per-rank order (order version 2 of the sampler), which is
#: the same where no group is that large; 1 had another order.
STATE_VERSION = 3


def epoch_batches(samples: int, world_size: int, drop_last: bool, batch_size: int) -> int:
    """Batches each rank reads in a whole epoch of `samples` split over `world_size`."""
    begin, end = rank_stretch(samples, 0, world_size, drop_last)
    return batch_count(end - begin, batch_size, drop_last)


@dataclass(frozen=True)
class Order:
    """What decides a loader's order: a pure function of these and the epoch."""

    #: The sampler's groups, in sample order: each shard, except that an array source's
    #: rows are cut into runs of whole chunks (MemberTable.group_sizes).
    group_sizes: np.ndarray
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    rank: int
    world_size: int
    shuffle_window: int
    mix: MixSpec | None = None  # a Mix's sources and weights

    @property
    def samples(self) -> int:
        """Samples in an epoch."""
        if self.mix is not None:
            return self.mix.epoch_samples
        return int(self.group_sizes.sum())

    @property
    def groups_digest(self) -> int:
        """A fingerprint of the grouping: a state saved under another one would resume
        into another order."""
        digest = zlib.crc32(np.ascontiguousarray(self.group_sizes, np.int64).tobytes())
        if self.mix is not None:  # the sources, their weights and the epoch's length
            digest = zlib.crc32(repr(self.mix).encode(), digest)
        return digest


class EpochCursor:
    """The epoch, the batches of it handed out, and how the next iterator starts.

    Every new iterator starts its epoch over (as a DataLoader's does) unless a state was
    just loaded, or every batch of the epoch has been handed out: then it begins the next
    epoch, whether or not the last iterator went on to StopIteration. Only the newest
    iterator moves the position (``generation``).
    """

    def __init__(self, order: Order) -> None:
        self.order = order
        self.epoch = 0
        self.position = 0  # batches of the epoch handed out
        self.done = False  # every batch of the epoch handed out
        self.resume_at: int | None = None  # where the next iterator starts, after a load
        self.pinned = False  # set_epoch named a loaded state's epoch: the next iterator stays
        self.generation = 0
        # Set by loading a state saved with another world size: (epoch, what the old ranks
        # had read), so that epoch's rest is shared out over this loader's ranks.
        self.elastic: tuple[int, tuple[int, bool, int]] | None = None
        self._plans: dict[int, EpochPlan] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_plans"] = {}  # made again on the other side, cheaply
        return state

    def __len__(self) -> int:
        """Batches in a whole epoch on this rank (also while resuming mid-epoch)."""
        o = self.order
        return epoch_batches(o.samples, o.world_size, o.drop_last, o.batch_size)

    def plan(self, epoch: int) -> EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:
            o, elastic = self.order, self.elastic
            plan = plan_epoch(
                o.group_sizes,
                batch_size=o.batch_size,
                shuffle=o.shuffle,
                seed=o.seed,
                epoch=epoch,
                rank=o.rank,
                world_size=o.world_size,
                drop_last=o.drop_last,
                shuffle_window=o.shuffle_window,
                consumed=elastic[1] if elastic is not None and elastic[0] == epoch else None,
                mix=o.mix,
            )
            self._plans = {epoch: plan}  # one epoch's order at a time
        return plan

    # -- moving -----------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        epoch = int(epoch)
        self.generation += 1  # iterators still alive no longer move the position
        if epoch == self.epoch and self.resume_at is not None:
            self.pinned = True  # the usual top of a resumed loop: keep the loaded position
            return
        self._start(epoch)

    def _start(self, epoch: int) -> None:
        self.epoch, self.position, self.resume_at = epoch, 0, None
        self.done = self.pinned = False
        self.elastic = None
        self._plans = {}

    def begin(self) -> tuple[int, EpochPlan, int]:
        """A new iterator: its generation, its epoch's plan and the batch it starts at."""
        self.generation += 1
        if self.done and not self.pinned:
            self._start(self.epoch + 1)
        if self.resume_at is not None:
            self.position = self.resume_at
        elif not self.done:
            self.position = 0
        self.resume_at = None
        self.pinned = False
        return self.generation, self.plan(self.epoch), self.position

    def handed_out(self, generation: int, batches: int) -> None:
        """The iterator of `generation` handed out its next batch of an epoch plan of
        `batches`."""
        if generation == self.generation:
            self.position += 1
            self.done = self.position >= batches

    def ended(self, generation: int) -> None:
        """The iterator of `generation` reached StopIteration (an epoch of no batches
        ends here)."""
        if generation == self.generation:
            self.done = True

    # -- state ------------------------------------------------------------------------

    def state_dict(self, samples: int) -> dict[str, Any]:
        o = self.order
        position = self.position
        if self.done:  # every batch done, however this epoch's rest was shared out
            position = len(self)
        elif self.elastic is not None and self.elastic[0] == self.epoch:
            raise StokerError(
                "this epoch was itself resumed with another world size; save the state "
                "again after it ends"
            )
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_done": position,
            "seed": o.seed,
            "shuffle": o.shuffle,
            "batch_size": o.batch_size,
            "drop_last": o.drop_last,
            "rank": o.rank,
            "world_size": o.world_size,
            "samples": samples,
            "shuffle_window": o.shuffle_window,
            "groups": o.groups_digest,
        }

    def load_state_dict(self, state: Mapping[str, Any], samples: int) -> None:
        version = state.get("version")
        largest = int(np.max(self.order.group_sizes, initial=0))
        if version == 2 and largest <= sample_orders.LAZY_SEGMENT:
            version = STATE_VERSION  # (no group is permuted otherwise now: the same order)
        if version in (1, 2):
            epoch = state.get("epoch", 0)
            raise StokerError(
                "this loader state was saved by an earlier stoker, whose epoch order differs "
                "from this one's"
                + (
                    f" for groups of more than {sample_orders.LAZY_SEGMENT:,} samples (this "
                    f"dataset has one of {largest:,})"
                    if version == 2
                    else ""
                )
                + ", so it cannot be resumed exactly: start the epoch over "
                f"instead (load nothing, or call set_epoch({epoch}) to read epoch {epoch} "
                "again from its first batch)"
            )
        if version != STATE_VERSION:
            raise StokerError(f"loader state version {version} is not supported")
        o = self.order
        # Ranks move in lockstep, so any rank's state serves every rank.
        mine = {
            "seed": o.seed,
            "shuffle": o.shuffle,
            "batch_size": o.batch_size,
            "samples": samples,
            "shuffle_window": o.shuffle_window,
        }
        if "groups" in state:  # (states saved before groups were recorded have none)
            mine["groups"] = o.groups_digest
        for key, value in mine.items():
            if state[key] != value:
                raise StokerError(
                    f"cannot resume: the state has {key}={state[key]!r} but this loader has "
                    f"{value!r}"
                )
        self._plans = {}
        self.epoch = int(state["epoch"])
        old_world, old_drop_last = int(state["world_size"]), bool(state["drop_last"])
        batches_done = int(state["batches_done"])
        same_split = old_world == o.world_size and old_drop_last == o.drop_last
        # An epoch whose every batch was handed out is over in any split: what its ranks
        # dropped (drop_last) stays dropped, and the next iteration begins the next epoch.
        finished = batches_done >= epoch_batches(o.samples, old_world, old_drop_last, o.batch_size)
        self.elastic = None
        if finished:
            self.position = len(self)
        elif same_split or batches_done == 0:  # nothing read: nothing to share out
            self.position = batches_done if same_split else 0
        else:  # elastic: what the old ranks read is known; share out the rest of the epoch
            self.elastic = (self.epoch, (old_world, old_drop_last, batches_done * o.batch_size))
            self.position = 0
        self.resume_at = self.position
        self.done = finished or self.position >= len(self.plan(self.epoch))
        self.pinned = False
        self.generation += 1
