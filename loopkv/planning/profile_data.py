"""The Profile: per cell and option, the damage of applying that option to that cell alone.

Paper §3.1. For every non-final cell ``c = (t, l)``, ``t < T-1``, and every profiled
option ``o``, ``damage[(t*L + l, o)] = KL(p_exact || p_{c<-o})`` in nats per token (>= 0), every other
cell exact. ``bf16`` costs nothing by definition and is never stored. The final loop's cells (the
sources of shared cells) are profiled the same way at ``final_options`` (``int4`` and ``int2``), one
value per layer, and a plan's predicted damage counts them (the paper's "sum of single-cell damages
plus source", Table 12). ``kl_share`` is the unit of damage: the KL of letting loop T-2 read loop T-1's
BF16 history, every layer at once (paper §2.3).

Profiles made before the final loop's INT4 was profiled (``final_options`` ``["int2"]`` or ``[]``) still
load. They cannot count the final loop's INT4 damage: :meth:`Profile.damage_of` gives 0 for it and
:meth:`Profile.uncounted` names it, and the planner records and prints that a plan's prediction leaves it
out (``predicted["uncounted"]``). Re-profile with this loopkv to count it.

``share`` damages are measured with the final loop's cell at ``share_source`` (``int4`` unless the
profile's ``provenance["settings"]["share_source"]`` says otherwise, :attr:`Profile.share_source`).

A profile may be *partial*: the profiler starts from :meth:`Profile.partial`, adds measurements with
:meth:`Profile.with_damage` / :meth:`Profile.with_kl_share`, saves with :meth:`Profile.to_json` after
each, and resumes from the file: :meth:`Profile.missing` lists the (cell, option) pairs still to
measure, :meth:`Profile.setup_differences` tells whether a saved partial file belongs to the same run.

JSON (versioned, readable, editable)::

    {"_type": "loopkv.Profile", "_version": 1, "_data": {
       "loops": 4, "layers": 24, "kv_heads": 16, "head_dim": 128,
       "family": "huginn",                 # only for a family other than Ouro (loopkv.families)
       "options": ["int4", "int2", "share"], "final_options": ["int4", "int2"],
       "damage": {"int4": [[d(0,0), ..., d(0,L-1)], ..., [d(T-2,0), ...]], ...},   # null = not measured
       "final": {"int4": [d(T-1,0), ..., d(T-1,L-1)], "int2": [...]},
       "kl_share": 1.2e-4,                 # null = not measured
       "provenance": {...},
       "per_document": {"int4": [[[kl per document] or null, ...], ...], ...}       # optional
       "final_per_document": {...}, "kl_share_per_document": [...] or null}}       # optional
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from loopkv.cells import Cell, CellLayout
from loopkv.families import family_of, known_family, layout_of
from loopkv.planning.plan import DEFAULT_FAMILY  # profiles without "family", like plans, were made for Ouro

PROFILE_TYPE = "loopkv.Profile"
PROFILE_VERSION = 1
# Options a non-final cell can be profiled at; bf16 is exact (damage 0) and never profiled.
PROFILE_OPTIONS = ("int4", "int2", "share")
# Options the final loop can be profiled at (it cannot share: it is the source).
FINAL_PROFILE_OPTIONS = ("int4", "int2")
# What a share cell reads when the profile does not record it (the profiler's default).
DEFAULT_SHARE_SOURCE = "int4"
# Provenance keys the profiler records; free-form values, JSON-serializable.
PROVENANCE_KEYS = ("model_fingerprint", "documents_hash", "loopkv_version", "torch_version", "device", "date")
# Provenance keys that must agree for a partial file to be resumed (the rest are environment).
SETUP_KEYS = ("model_fingerprint", "documents_hash")

DamageKey = tuple[int, str]  # (flat cell index t*L + l, option)


def config_shape(config: Any) -> tuple[int, int, int, int]:
    """``(loops, layers, kv_heads, head_dim)`` of a model config.

    Accepts a transformers config (``total_ut_steps``, ``num_hidden_layers``, ``num_key_value_heads``,
    ``head_dim`` or ``hidden_size // num_attention_heads``), a mapping with the same keys, or a mapping /
    object with ``loops``, ``layers``, ``kv_heads``, ``head_dim``.
    """
    get = (lambda k: config.get(k)) if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
    if get("loops") is not None:
        names = ("loops", "layers", "kv_heads", "head_dim")
        vals = [get(k) for k in names]
    else:
        head_dim = get("head_dim")
        if head_dim is None and get("hidden_size") is not None and get("num_attention_heads"):
            head_dim = get("hidden_size") // get("num_attention_heads")
        kv_heads = get("num_key_value_heads") or get("num_attention_heads")
        names = ("total_ut_steps", "num_hidden_layers", "num_key_value_heads", "head_dim")
        loops, layers = get("total_ut_steps"), get("num_hidden_layers")
        if layers is not None and known_family(config):  # the family's planned cells (Ouro: T x L)
            layout = layout_of(config)
            loops, layers = layout.loops, layout.layers
        vals = [loops, layers, kv_heads, head_dim]
    missing = [n for n, v in zip(names, vals, strict=True) if v is None]
    if missing:
        raise ValueError(
            f"config lacks {missing}; pass a looped-model config (e.g. OuroConfig with total_ut_steps) "
            "or a mapping with loops, layers, kv_heads and head_dim"
        )
    return tuple(int(v) for v in vals)  # type: ignore[return-value]


def _family(config: Any) -> str | None:
    """The model family of ``config``: a shape's ``family`` (ModelShape), a known family's config, else None."""
    if isinstance(getattr(config, "family", None), str):
        return config.family
    if isinstance(config, Mapping):
        return config.get("family") if isinstance(config.get("family"), str) else None
    return family_of(config) if known_family(config) else None


def _is_int(value: Any) -> bool:
    """An integer, numpy's included, but not a bool (JSON ``true`` loads as True, which equals 1)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


def _check_value(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(
            f"{name} must be a finite KL >= 0 (nats/token), got {value}; clamp tiny negative round-off to 0"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Single-cell damages of one model (see the module docstring for the layout and JSON).

    Fields:
        loops, layers: T and L; kv_heads, head_dim: the KV shape (for the byte model).
        family: the model family (:mod:`loopkv.families`) whose planned cells these are; ``"ouro"`` unless the
            file says otherwise. A plan solved from the profile records it.
        options: options profiled for every non-final cell, a subset of ("int4", "int2", "share").
        final_options: options profiled for the final loop's cells, a subset of ("int4", "int2").
        damage: ``{(t*L + l, option): KL}`` for measured pairs; final-loop keys hold ``final_options``.
        kl_share: the damage unit (KL of loop T-2 reading loop T-1's BF16 history); None until measured.
        provenance: model fingerprint, documents hash, loopkv/torch versions, device, date, ...
        per_document: optional ``{(t*L + l, option): (KL of document 0, 1, ...)}``.
        kl_share_per_document: optional per-document values of ``kl_share``.
    """

    loops: int
    layers: int
    kv_heads: int
    head_dim: int
    options: tuple[str, ...] = PROFILE_OPTIONS
    final_options: tuple[str, ...] = FINAL_PROFILE_OPTIONS
    damage: Mapping[DamageKey, float] = field(default_factory=dict)
    kl_share: float | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)
    per_document: Mapping[DamageKey, tuple[float, ...]] = field(default_factory=dict)
    kl_share_per_document: tuple[float, ...] | None = None
    family: str = DEFAULT_FAMILY

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(f"Profile.family must be a model family name (e.g. 'ouro', 'huginn'), got {self.family!r}")
        for name in ("loops", "layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"Profile.{name} must be an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.loops < 2:
            raise ValueError(f"loops must be >= 2 (a final loop plus at least one planned loop), got {self.loops}")
        options, final_options = tuple(self.options), tuple(self.final_options)
        for name, opts, allowed in (
            ("options", options, PROFILE_OPTIONS),
            ("final_options", final_options, FINAL_PROFILE_OPTIONS),
        ):
            bad = [o for o in opts if o not in allowed]
            if bad or len(set(opts)) != len(opts):
                raise ValueError(f"{name}={opts} must be distinct values from {allowed}")
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "final_options", final_options)
        expected = self._expected_keys()
        damage = {}
        for key, value in dict(self.damage).items():
            key = (int(key[0]), str(key[1]))
            if key not in expected:
                raise ValueError(f"damage key {key} is not a profiled (cell index, option) pair of this profile")
            damage[key] = _check_value(f"damage[{key}]", value)
        per_doc = {}
        for key, values in dict(self.per_document).items():
            key = (int(key[0]), str(key[1]))
            if key not in expected:
                raise ValueError(f"per_document key {key} is not a profiled (cell index, option) pair")
            per_doc[key] = tuple(_check_value(f"per_document[{key}]", v) for v in values)
        object.__setattr__(self, "damage", MappingProxyType(dict(sorted(damage.items()))))
        object.__setattr__(self, "per_document", MappingProxyType(dict(sorted(per_doc.items()))))
        if self.kl_share is not None:
            kl = _check_value("kl_share", self.kl_share)
            if kl == 0.0:
                raise ValueError("kl_share must be > 0: it is the unit damages are expressed in")
            object.__setattr__(self, "kl_share", kl)
        if self.kl_share_per_document is not None:
            vals = tuple(_check_value("kl_share_per_document", v) for v in self.kl_share_per_document)
            object.__setattr__(self, "kl_share_per_document", vals)
        object.__setattr__(self, "provenance", MappingProxyType(dict(self.provenance)))

    # ------------------------------------------------------------------ construction
    @classmethod
    def partial(
        cls,
        *,
        loops: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        options: Iterable[str] = PROFILE_OPTIONS,
        final_options: Iterable[str] = FINAL_PROFILE_OPTIONS,
        provenance: Mapping[str, Any] | None = None,
        family: str = DEFAULT_FAMILY,
    ) -> Profile:
        """An empty profile to fill: nothing measured yet (``missing()`` lists everything)."""
        return cls(
            loops=loops,
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            options=tuple(options),
            final_options=tuple(final_options),
            provenance=dict(provenance or {}),
            family=family,
        )

    @classmethod
    def from_arrays(
        cls,
        *,
        loops: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        damage: Mapping[str, Any],
        final_int2: Iterable[float] | None = None,
        kl_share: float | None = None,
        provenance: Mapping[str, Any] | None = None,
        final: Mapping[str, Iterable[float]] | None = None,
    ) -> Profile:
        """A profile from grids: ``damage[option]`` is array-like ``[T-1, L]`` (loop-major); ``final[option]``
        array-like ``[L]``, the final loop's damages per layer (``final_int2`` is ``final["int2"]``); an
        option left out of ``final`` was not profiled in the final loop."""
        table: dict[DamageKey, float] = {}
        for option, grid in damage.items():
            rows = [list(map(float, row)) for row in grid]
            if len(rows) != loops - 1 or any(len(r) != layers for r in rows):
                raise ValueError(f"damage[{option!r}] must have shape [loops-1, layers] = [{loops - 1}, {layers}]")
            for t, row in enumerate(rows):
                for layer, v in enumerate(row):
                    table[(t * layers + layer, option)] = v
        finals = dict(final or {})
        if final_int2 is not None:
            if "int2" in finals:
                raise ValueError("pass the final loop's INT2 damages once: final_int2= or final={'int2': ...}")
            finals["int2"] = final_int2
        final_options = tuple(o for o in FINAL_PROFILE_OPTIONS if o in finals)
        unknown = sorted(set(finals) - set(FINAL_PROFILE_OPTIONS))
        if unknown:
            raise ValueError(f"final has option(s) {unknown}; the final loop is profiled at {FINAL_PROFILE_OPTIONS}")
        for option in final_options:
            vals = list(map(float, finals[option]))
            if len(vals) != layers:
                raise ValueError(f"final[{option!r}] must have {layers} values (one per layer), got {len(vals)}")
            for layer, v in enumerate(vals):
                table[((loops - 1) * layers + layer, option)] = v
        return cls(
            loops=loops,
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            options=tuple(damage),
            final_options=final_options,
            damage=table,
            kl_share=kl_share,
            provenance=dict(provenance or {}),
        )

    def with_damage(
        self, cell: Cell, option: str, value: float, *, per_document: Iterable[float] | None = None
    ) -> Profile:
        """A copy with ``(cell, option)`` measured (a final-loop cell takes a ``final_options`` option)."""
        key = (self.layout.flat_index(cell), option)
        damage = dict(self.damage)
        damage[key] = value
        per_doc = dict(self.per_document)
        if per_document is not None:
            per_doc[key] = tuple(per_document)
        return replace(self, damage=damage, per_document=per_doc)

    def with_kl_share(self, value: float, *, per_document: Iterable[float] | None = None) -> Profile:
        """A copy with the damage unit measured."""
        docs = tuple(per_document) if per_document is not None else self.kl_share_per_document
        return replace(self, kl_share=value, kl_share_per_document=docs)

    # ------------------------------------------------------------------ queries
    @property
    def layout(self) -> CellLayout:
        return CellLayout(self.loops, self.layers)

    @property
    def final_int2(self) -> tuple[float, ...] | None:
        """The final loop's INT2 damage per layer, or None if not (fully) profiled."""
        return self.final_damages("int2")

    @property
    def final_int4(self) -> tuple[float, ...] | None:
        """The final loop's INT4 damage per layer, or None if not (fully) profiled (a profile made before
        the final loop's INT4 was profiled)."""
        return self.final_damages("int4")

    def final_damages(self, option: str) -> tuple[float, ...] | None:
        """The final loop's damage per layer at ``option``, or None if not (fully) profiled."""
        keys = [((self.loops - 1) * self.layers + layer, option) for layer in range(self.layers)]
        if option not in self.final_options or any(k not in self.damage for k in keys):
            return None
        return tuple(self.damage[k] for k in keys)

    @property
    def share_source(self) -> str:
        """The final loop's option the ``share`` damages were measured with (``int4`` by default)."""
        settings = self.provenance.get("settings")
        source = settings.get("share_source") if isinstance(settings, Mapping) else None
        return source or DEFAULT_SHARE_SOURCE

    def is_counted(self, cell: Cell, option: str) -> bool:
        """Whether :meth:`damage_of` gives a measured damage (or bf16's exact 0) for ``(cell, option)``:
        False only for INT4 in the final loop of a profile that did not profile it (then counted as 0)."""
        final = cell.loop == self.loops - 1
        return not (final and option == "int4" and (self.layout.flat_index(cell), option) not in self.damage)

    def uncounted(self) -> tuple[str, ...]:
        """What a plan's predicted damage from this profile leaves out, one sentence each: empty for a
        profile that measured the final loop at INT4."""
        missing = [layer for layer in range(self.layers) if not self.is_counted(Cell(self.loops - 1, layer), "int4")]
        if not missing:
            return ()
        where = "every layer" if len(missing) == self.layers else f"layers {missing}"
        return (
            f"the final loop's own INT4 damage (loop {self.loops - 1}, {where}): not in this profile, counted as 0; "
            "re-profile with this loopkv (final options int4,int2) to count it",
        )

    def damage_of(self, cell: Cell, option: str) -> float:
        """The damage of ``option`` at ``cell``: 0 for bf16 anywhere. INT4 in the final loop of a profile
        that did not measure it also gives 0; :meth:`is_counted` and :meth:`uncounted` say so."""
        final = cell.loop == self.loops - 1
        if option == "bf16" or (final and option == "int4" and not self.is_counted(cell, option)):
            self.layout.flat_index(cell)
            return 0.0
        key = (self.layout.flat_index(cell), option)
        if key not in self.damage:
            raise ValueError(
                f"{option!r} at {cell} is not in this profile (measured options: {self._options_at(final)})"
            )
        return self.damage[key]

    def missing(self) -> list[tuple[Cell, str]]:
        """The (cell, option) pairs still to measure, in profiling order (cell-major, then option).

        ``is_complete`` additionally needs ``kl_share``."""
        return [(self.layout.cell(i), o) for i, o in self._ordered_keys() if (i, o) not in self.damage]

    @property
    def is_complete(self) -> bool:
        return self.kl_share is not None and len(self.damage) == len(self._expected_keys())

    def validate_for(self, config: Any) -> None:
        """Raise ValueError when this profile was not made for ``config``'s shape (T, L, KV heads,
        head_dim) or for another model family; ``config`` as :func:`config_shape` takes it."""
        family = _family(config)
        if family is not None and family != self.family:
            raise ValueError(
                f"this profile was made for the {self.family} family and the model is of the {family} family: their "
                "cells are different layers. Profile this model (loopkv profile MODEL) and plan from that")
        loops, layers, kv_heads, head_dim = config_shape(config)
        diffs = [
            f"{name}: profile {mine}, model {theirs}"
            for name, mine, theirs in (
                ("loops (total_ut_steps)", self.loops, loops),
                ("layers (num_hidden_layers)", self.layers, layers),
                ("kv_heads (num_key_value_heads)", self.kv_heads, kv_heads),
                ("head_dim", self.head_dim, head_dim),
            )
            if mine != theirs
        ]
        if diffs:
            raise ValueError(
                "this profile does not match the model config (" + "; ".join(diffs) + "); "
                "profile this model with loopkv.planning.profile, or load the profile made for it"
            )

    def setup_differences(self, other: Profile) -> list[str]:
        """What differs between two profiles' setups (shape, options, model and documents): empty when
        ``other`` (e.g. a saved partial file) can be resumed into this run."""
        diffs = []
        for name in ("family", "loops", "layers", "kv_heads", "head_dim", "options", "final_options"):
            if getattr(self, name) != getattr(other, name):
                diffs.append(f"{name}: {getattr(self, name)} vs {getattr(other, name)}")
        for key in SETUP_KEYS:
            if self.provenance.get(key) != other.provenance.get(key):
                diffs.append(f"provenance[{key!r}]: {self.provenance.get(key)!r} vs {other.provenance.get(key)!r}")
        return diffs

    def content_hash(self) -> str:
        """sha256 (hex) of the canonical JSON of the data: identifies the profile a plan was solved from."""
        text = json.dumps(self.to_dict()["_data"], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON object (see the module docstring)."""
        nonfinal = self.loops - 1
        data: dict[str, Any] = {
            "loops": self.loops,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "options": list(self.options),
            "final_options": list(self.final_options),
            "damage": {o: self._grid(self.damage, o, range(nonfinal)) for o in self.options},
            "final": {o: self._grid(self.damage, o, [nonfinal])[0] for o in self.final_options},
            "kl_share": self.kl_share,
            "provenance": dict(self.provenance),
        }
        if self.family != DEFAULT_FAMILY:
            data["family"] = self.family
        if self.per_document:
            data["per_document"] = {
                o: self._grid(self.per_document, o, range(nonfinal), seq=True) for o in self.options
            }
            data["final_per_document"] = {
                o: self._grid(self.per_document, o, [nonfinal], seq=True)[0] for o in self.final_options
            }
        if self.kl_share_per_document is not None:
            data["kl_share_per_document"] = list(self.kl_share_per_document)
        return {"_type": PROFILE_TYPE, "_version": PROFILE_VERSION, "_data": data}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Profile:
        if not isinstance(obj, Mapping) or obj.get("_type") != PROFILE_TYPE:
            got = obj.get("_type") if isinstance(obj, Mapping) else type(obj).__name__
            raise ValueError(f"not a loopkv profile: _type is {got!r}, expected {PROFILE_TYPE!r}")
        if not _is_int(obj.get("_version")) or obj.get("_version") != PROFILE_VERSION:  # JSON true equals 1
            raise ValueError(
                f"profile _version {obj.get('_version')!r} is not supported (this loopkv reads version "
                f"{PROFILE_VERSION}); re-profile, or upgrade loopkv"
            )
        d = obj.get("_data")
        if not isinstance(d, Mapping):
            raise ValueError("profile file has no '_data' object")
        for name in ("loops", "layers", "kv_heads", "head_dim"):
            if name in d and (not _is_int(d[name]) or d[name] < 1):
                raise ValueError(
                    f"profile file '{name}' must be an integer >= 1 (a JSON number, not a string or true), "
                    f"got {d[name]!r}; fix the file or re-profile"
                )
        try:
            return cls._from_data(d)
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"profile file _data is malformed ({type(err).__name__}: {err}); see the "
                "format in loopkv.planning.profile_data"
            ) from err

    @classmethod
    def _from_data(cls, d: Mapping[str, Any]) -> Profile:
        loops, layers = d["loops"], d["layers"]
        options, final_options = tuple(d["options"]), tuple(d.get("final_options", ()))
        damage: dict[DamageKey, float] = {}
        per_doc: dict[DamageKey, tuple[float, ...]] = {}
        for o in options:
            cls._ungrid(d["damage"][o], o, 0, layers, loops - 1, damage)
            if "per_document" in d:
                cls._ungrid(d["per_document"][o], o, 0, layers, loops - 1, per_doc, seq=True)
        for o in final_options:
            cls._ungrid([d["final"][o]], o, loops - 1, layers, 1, damage)
            if "final_per_document" in d:
                cls._ungrid([d["final_per_document"][o]], o, loops - 1, layers, 1, per_doc, seq=True)
        kl_docs = d.get("kl_share_per_document")
        return cls(
            loops=loops,
            layers=layers,
            kv_heads=d["kv_heads"],
            head_dim=d["head_dim"],
            options=options,
            final_options=final_options,
            damage=damage,
            kl_share=d.get("kl_share"),
            provenance=d.get("provenance", {}),
            per_document=per_doc,
            kl_share_per_document=None if kl_docs is None else tuple(kl_docs),
            family=d.get("family", DEFAULT_FAMILY),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def loads(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the profile (complete or partial) atomically: a resumable profiler may be killed
        mid-write."""
        path = os.fspath(path)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(self.dumps())
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Profile:
        with open(path) as f:
            return cls.loads(f.read())

    # ------------------------------------------------------------------ internals
    def _options_at(self, final: bool) -> tuple[str, ...]:
        return self.final_options if final else self.options

    def _ordered_keys(self) -> list[DamageKey]:
        keys = []
        for cell in self.layout:
            i = self.layout.flat_index(cell)
            keys.extend((i, o) for o in self._options_at(cell.loop == self.loops - 1))
        return keys

    def _expected_keys(self) -> set[DamageKey]:
        return set(self._ordered_keys())

    def _grid(self, table: Mapping[DamageKey, Any], option: str, loops: Iterable[int], *, seq: bool = False) -> list:
        conv = (lambda v: list(v)) if seq else (lambda v: v)
        return [
            [
                conv(table[key]) if (key := (t * self.layers + layer, option)) in table else None
                for layer in range(self.layers)
            ]
            for t in loops
        ]

    @staticmethod
    def _ungrid(
        grid: Any, option: str, first_loop: int, layers: int, nloops: int, out: dict, *, seq: bool = False
    ) -> None:
        if (
            not isinstance(grid, list)
            or len(grid) != nloops
            or any(not isinstance(row, list) or len(row) != layers for row in grid)
        ):
            raise ValueError(
                f"profile grid for {option!r} must be {nloops} rows of {layers} values (null = not measured)"
            )
        for dt, row in enumerate(grid):
            for layer, v in enumerate(row):
                if v is not None:
                    out[((first_loop + dt) * layers + layer, option)] = tuple(v) if seq else v
