"""The fields= fast path: the Loader's field decoders turned, once, into a C++ BatchPlan
that lays out and reads each whole batch in one call; Python only wraps the finished
buffer in tensor views."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

import stoker._core as _core
from stoker.dataset import Dataset
from stoker.errors import ShardFormatError, StokerError, UsageError, quoted
from stoker.fields import Bytes, FieldSpec, Image, Int, Npy, Raw, Row

_KINDS = {
    Raw: _core.FieldKind.RAW,
    Int: _core.FieldKind.INT,
    Npy: _core.FieldKind.NPY,
    Row: _core.FieldKind.NPY,
    Image: _core.FieldKind.IMAGE,
}
_DECODERS = (Raw, Int, Npy, Row, Bytes, Image)
_BYTES = _core.FieldKind.BYTES


def check_fields_argument(fields: object) -> dict[str, FieldSpec] | None:
    """`fields` as a dict of field name (or ``"a;b"`` alternatives) to decoder, or a
    UsageError that says what to pass."""
    if fields is None:
        return None
    if not isinstance(fields, Mapping):
        names = [fields] if isinstance(fields, str) else fields
        if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names):
            example = ", ".join(f"{n!r}: stoker.{_likely_decoder(n)}()" for n in names[:3])
        else:
            example = "'raw': stoker.Raw((3, 64, 64), 'uint8'), 'cls': stoker.Int()"
        raise UsageError(
            f"fields= maps each field to its decoder, not a {type(fields).__name__} "
            f"({quoted(fields, 80)}): pass a dict such as {{{example}}}, with the decoder "
            "each field needs: stoker.Raw(shape, dtype), Int(), Npy(), Row(), Bytes() or Image()"
        )
    wrong = [key for key in fields if not isinstance(key, str)]
    if wrong:
        raise UsageError(
            f"fields= keys are field names (str), not {type(wrong[0]).__name__}: {wrong[0]!r}"
        )
    return dict(fields)


def _likely_decoder(name: str) -> str:
    """The decoder a field of this name usually needs, for an example in a message."""
    lower = name.lower()
    if lower in ("cls", "label", "target", "index"):
        return "Int"
    return "Image" if lower in ("jpg", "jpeg", "png", "image", "img") else "Bytes"


def _some(names: list[str], most: int = 20) -> str:
    """Field names for a message: all of a few, the first `most` of many."""
    shown = ", ".join(quoted(n, 60) for n in names[:most])
    return shown + (f" and {len(names) - most:,} more" if len(names) > most else "")


class FieldsPlan:
    """A Loader's fields=: checked against the dataset once, then per batch one prepare
    (C++) and one wrap of the read buffer."""

    def __init__(self, ds: Dataset, fields: Mapping[str, FieldSpec]) -> None:
        self.ds = ds
        have = set(ds.fields)
        self.entries: list[tuple[str, FieldSpec]] = []  # (batch entry, decoder)
        specs: list[tuple] = []  # BatchPlan's fields, less the ids _plan looks up
        self._widen: dict[str, np.dtype] = {}  # Int() of a table's integers: read as they are
        # Fields whose table values must be sized first: a Bytes value is handed out where
        # its read leaves it (see PreparedBatch.values), so it need not be.
        self._size_names: list[str] = []
        self._bytes_names: list[str] = []  # Bytes fields' alternatives (see name_null)
        self._lists: dict[str, np.dtype] = {}  # Bytes() of a table's lists: their elements' type
        read: set[str] = set()
        for key, spec in fields.items():
            name, alternatives = self._check(key, spec, have)
            read.update(alternatives)
            if not isinstance(spec, (Image, Int, Bytes)):
                self._size_names += alternatives
            if isinstance(spec, Bytes):
                self._bytes_names += alternatives
                # A table's lists of numbers are handed out as arrays of their type.
                listed = ds.table_dtype(alternatives[0], listed=True)
                if listed is not None:
                    self._lists[name] = listed
            typed = ds.table_dtype(alternatives[0]) if isinstance(spec, Int) else None
            if typed is not None and typed.kind in "biu":
                self._widen[name] = typed
                spec = Raw((), typed.str)
            self.entries.append((name, spec))
            if alternatives[0] in ds.columns:
                column = ds.columns[alternatives[0]]
                specs.append((name, int(_core.FieldKind.COLUMN), 0, "", [], [], column, None))
                continue
            kind = next((k for cls, k in _KINDS.items() if isinstance(spec, cls)), _BYTES)
            nbytes = spec.nbytes if isinstance(spec, Raw) else 0
            what = f"{spec.shape} {np.dtype(spec.dtype)}" if isinstance(spec, Raw) else ""
            target = spec.target if isinstance(spec, Image) else None
            specs.append((name, int(kind), nbytes, what, list(alternatives), [], None, target))
        self._specs = specs
        #: The dataset's fields these read: of a remote Parquet file, what is fetched.
        self.columns = frozenset(read)
        self._field_names = -1  # the dataset's field names when the plan's ids were looked up
        self._plan()
        self._layouts: dict[tuple, tuple[np.dtype, tuple[int, ...], int]] = {}
        self._fixed = all(isinstance(spec, (Raw, Int, Image)) for _, spec in self.entries)
        self.has_images = any(isinstance(spec, Image) for _, spec in self.entries)
        self._blanked_keys: set[str] = set()
        self._recipes: dict[int, list[tuple]] = {}

    def _check(self, key: str, spec: FieldSpec, have: set[str]) -> tuple[str, tuple[str, ...]]:
        """A fields= entry's batch entry name and the alternatives it reads (lower-cased,
        as field names are), or a clear error."""
        alternatives = tuple(a.strip() for a in key.split(";"))
        name = alternatives[0]
        if not all(alternatives):
            raise UsageError(
                f"fields= key {key!r} has an empty name; alternatives are written 'jpg;jpeg;png'"
            )
        if isinstance(spec, type) and spec in _DECODERS:
            call = "Raw(shape, dtype)" if spec is Raw else f"{spec.__name__}()"
            raise UsageError(
                f"fields={{{key!r}: stoker.{spec.__name__}}}: that is the decoder's class; "
                f"call it: stoker.{call}"
            )
        if not isinstance(spec, _DECODERS):
            raise UsageError(
                f"fields={{{key!r}: {quoted(spec, 80)}}}: the value is not a stoker field "
                "decoder; use stoker.Raw(shape, dtype), stoker.Int(), stoker.Npy(), "
                "stoker.Bytes() or stoker.Image()"
            )
        if any(entry == name for entry, _ in self.entries):
            raise UsageError(f"fields= names the batch entry {name!r} twice")
        # A struct of bytes and a path (the Hugging Face Image and Audio features) is
        # named by its own name as well as by its bytes' ("image" finds "image.bytes").
        lookup = tuple(
            f"{a.lower()}.bytes"
            if a.lower() not in have and f"{a.lower()}.bytes" in have
            else a.lower()
            for a in alternatives
        )
        unusable = [self.ds.unusable_field(a) for a in lookup if a not in have]
        if unusable and unusable[0] is not None:
            raise StokerError(unusable[0])
        extras = [a for a in lookup if a in self.ds.columns]
        if extras and len(lookup) > 1:
            raise UsageError(
                f"fields= key {key!r}: {extras[0]!r} is an integer column of the dataset, "
                "which every sample has; name it alone"
            )
        if extras and not isinstance(spec, Int):
            raise UsageError(f"field {name!r} is an integer column: use stoker.Int()")
        if len(self.ds) and self.ds.fields_known and not any(a in have for a in lookup):
            what = (
                f"field {name!r} is in no sample"
                if len(lookup) == 1
                else f"no sample has any of the fields {key!r}"
            )
            raise StokerError(f"{what}; the dataset has {_some(sorted(have))}")
        return name, lookup

    # -- per batch -------------------------------------------------------------------

    def prepare(self, indices: np.ndarray, reader: Any, augment_seed: int = 0) -> Any:
        """The batch of samples `indices` laid out: a _core.PreparedBatch to submit with
        `reader`. Images' random crops are seeded by `augment_seed` (the loader's seed and
        epoch) and each sample's index."""
        with self.ds.indexed(indices):
            if len(self.ds.fields) != self._field_names:  # a shard named a field anew
                self._plan()
            if self._size_ids:
                self.ds.size_values(indices, self._size_ids, reader)
            return self.plan.prepare(indices, self.ds.plan_columns(), self.ds.key, augment_seed)

    def _plan(self) -> None:
        """The C++ plan, with the dataset's ids of each field's alternatives (a field no
        shard indexed so far has is -1, and looked up again once one does)."""
        specs = [
            (*spec[:5], self.ds.field_ids(spec[4]) if spec[6] is None else [-1], *spec[6:])
            for spec in self._specs
        ]
        self.plan = _core.BatchPlan(specs)
        self._field_names = len(self.ds.fields)
        self._size_ids = [f for f in self.ds.field_ids(self._size_names) if f >= 0]
        self._bytes_ids = [f for f in self.ds.field_ids(self._bytes_names) if f >= 0]

    def blanked(self, prepared: Any, requests: np.ndarray) -> list[str]:
        """The keys of the samples whose images the reader blanked (`requests`, its request
        numbers) not reported before: each bad member is logged once, not every epoch."""
        members, _ = prepared.pieces()
        keys = []
        for r in requests.tolist():
            found = self.ds.describe(int(members[r]))
            keys.append(self.ds.key(found[2]) if found is not None else f"member {r}")
        new = [k for k in dict.fromkeys(keys) if k not in self._blanked_keys]
        self._blanked_keys.update(new)
        return new

    def assemble(
        self,
        prepared: Any,
        pending: Any,
        buffer: np.ndarray,
        indices: np.ndarray,
        torch: Any,
        copy: bool,
    ) -> dict[str, Any]:
        """The batch's tensors viewing `buffer` (what `pending`, the read of `prepared`,
        returned); `copy`: Bytes fields are copied out (the buffer is a pinned slot the ring
        needs back). Bytes values the reader left in decoded pages view those, read-only."""
        n = len(indices)
        # Fixed-size fields only (Raw, Int, integer columns): every batch of n samples has
        # the same layout, so the views' recipe is worked out once per n.
        recipe = self._recipes.get(n)
        if recipe is None:
            recipe = self._recipe(prepared, n)
            if self._fixed:
                self._recipes[n] = recipe
        if not self._fixed:
            prepared.check(buffer)  # .npy members' headers against the batch's first
        batch: dict[str, Any] = {}
        for name, start, end, dtype, shape, field in recipe:
            if field is not None:  # Bytes
                batch[name] = prepared.values(field, buffer, pending, copy, self._lists.get(name))
                continue
            try:
                values = buffer[start:end].view(dtype).reshape(shape)
                if name in self._widen:  # Int() of a table's integers of another width
                    values = values.astype(np.int64)
                batch[name] = torch.from_numpy(values)
            except TypeError as e:  # a dtype torch has no tensor for (big-endian, strings)
                raise StokerError(
                    f"field {name!r}: torch has no tensor type for {dtype} ({e}); read it "
                    "with stoker.Bytes() and convert it in your own code"
                ) from e
        batch["__key__"] = self.ds.keys(indices)
        return batch

    def _recipe(self, prepared: Any, n: int) -> list[tuple]:
        """(name, start, end, dtype, shape, field) of each field of the batch `prepared`
        lays out: a view of buffer[start:end], or a Bytes field's number (`field`)."""
        recipe: list[tuple] = []
        for field, ((name, spec), (offset, decoder, npy, _)) in enumerate(
            zip(self.entries, prepared.layout())
        ):
            if isinstance(spec, Bytes):
                recipe.append((name, 0, 0, None, None, field))
                continue
            dtype, shape, nbytes = self._layout_of(spec, decoder, npy)
            recipe.append((name, offset, offset + n * nbytes, dtype, (n, *shape), None))
        return recipe

    def _layout_of(
        self, spec: FieldSpec, decoder: int, npy: tuple | None
    ) -> tuple[np.dtype, tuple[int, ...], int]:
        """dtype, shape and bytes of one sample of a fixed-size field, remembered (a batch
        does not pay for working them out again)."""
        key = (id(spec), decoder, npy)
        found = self._layouts.get(key)
        if found is None:
            if npy is not None:  # .npy members: the batch's first header says
                dtype, shape = np.dtype(npy[0]), tuple(npy[1])
            elif decoder:  # rows of .npy shards
                typed = self.ds.decoder(decoder)
                assert typed is not None  # only decoder 0, bytes, has no type
                dtype, shape = typed
            elif isinstance(spec, Raw):
                dtype, shape = np.dtype(spec.dtype), spec.shape
            elif isinstance(spec, Image):
                dtype, shape = np.dtype(np.uint8), spec.shape
            else:  # Int, and integer columns
                dtype, shape = np.dtype(np.int64), ()
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            found = self._layouts[key] = (dtype, shape, nbytes)
        return found

    def name_null(
        self, error: ShardFormatError, indices: np.ndarray, reader: Any
    ) -> ShardFormatError | None:
        """For `error`, a table value of a Bytes field that its read found null (the reader
        knows the file, row group and row, not the sample): the error sizing the batch's
        values raises, which names the sample too. None for any other error."""
        null = "is null, and a batch asks"  # the reader's words for it, and the sizing's
        if not self._bytes_ids or null not in str(error):
            return None
        try:
            with self.ds.indexed(indices):
                self.ds.size_values(indices, self._bytes_ids, reader)
        except ShardFormatError as named:
            return named if null in str(named) else None
        except Exception:  # noqa: BLE001 - the reader's own error is raised instead
            return None
        return None

    def name_member(self, error: ShardFormatError, prepared: Any) -> ShardFormatError:
        """`error` from the reader, said of the field and sample whose bytes it is about."""
        members, offsets = prepared.pieces()
        return self.ds.explain(error, members, offsets)
