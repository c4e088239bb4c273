"""Job configuration: what the aggregator needs to know about a job before its first packet.

A job is refused here, when it is configured, if its sums could overflow the result width
(g * n >= 2^width), if it has more than 32 workers (1,024 in a two-tier job: ``leaves``), or if a result
packet would not fit the path MTU.
A ``dar`` job (decompress-aggregate-recompress, software aggregator only) is refused if its codec is
unknown or homomorphic, or if its preallocated reassembly buffers would be unreasonably large.
The config file format (TOML) is documented in docs/aggregator.md.
"""

from __future__ import annotations

import functools
import logging
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from worker_lib.thc import LookupTable, solve_table
from worker_lib.thc.table import parse_fraction
from worker_lib.values import is_integer
from worker_lib.wire.layout import (
    DAR_PREFIX_BYTES,
    HEADER_BYTES,
    IP_UDP_OVERHEAD,
    MAX_MTU,
    MAX_WORKERS,
    RESULT_WIDTHS,
    PacketType,
)

log = logging.getLogger(__name__)

JobKind = Literal["thc", "uncompressed", "dar"]
JOB_KINDS: tuple[str, ...] = ("thc", "uncompressed", "dar")
#: Most bytes a dar job may preallocate (reassembly + retained results): a typo in max_message or
#: slots is refused instead of exhausting the aggregator's memory.
MAX_DAR_MEMORY = 2 << 30
#: Job fields that only a dar job may set.
_DAR_ONLY = ("codec", "length", "max_message", "seed")

#: The job ``thc-aggregator`` serves when no job is configured, and which ``thc-allreduce
#: --aggregator`` uses by default.
DEFAULT_JOB_ID = 1
DEFAULT_KEY = 0x54484321  # "THC!"


class JobConfigError(ValueError):
    """A job configuration that an aggregator must refuse."""


@dataclass(frozen=True)
class JobConfig:
    """One job: identity, secret, workers, completion threshold, codec and register geometry.

    ``threshold`` defaults to ``workers``; ``result_bits`` to the smallest of 8/16/32 that holds
    g * n; ``elems`` (K, indices per packet) to the largest multiple of 8 whose result packet fits
    ``mtu`` (1440 at 1500 bytes with 8-bit results: every datagram costs the worker, the kernel and
    the aggregator about the same whatever its size, so the fewer the better).

    ``kind="dar"`` (decompress-aggregate-recompress, software aggregator only): ``codec`` is a
    non-homomorphic codec name of ``worker_lib.codecs`` (``CodecKind.DAR``), ``length`` the tensor
    length d, ``max_message`` the largest codec message in bytes (uplink and downlink; it sizes the
    preallocated reassembly buffers), ``seed`` the base of the per-round seed of stochastic
    re-encoding; ``elems`` is the message bytes per fragment (default: what fits ``mtu``),
    ``result_bits`` is 8 and ``table_id`` 0. The THC table knobs are ignored.

    ``leaves`` (a two-tier job, docs/protocol.md "Two tiers"): the local worker count n_l of each leaf
    aggregator, in leaf order; ``workers`` is then their sum (at most 32 leaves of at most 32 workers),
    the job's worker w is local worker ``tier_of(w)`` of its leaf, ``threshold`` counts workers at the
    spine, and ``result_bits`` is the spine's width (what the workers decode). ``leaf(l)`` is the
    one-tier job leaf l serves; ``partial_bits(l)`` the width of its partial sums.
    """

    job: int = DEFAULT_JOB_ID
    key: int = field(default=DEFAULT_KEY, repr=False)  #: a shared secret: never logged or listed
    workers: int = 4
    threshold: int | None = None
    kind: JobKind = "thc"
    bits: int = 4
    granularity: int = 30
    p: float = 1 / 32
    table: tuple[int, ...] | None = None
    result_bits: int | None = None
    slots: int = 128
    elems: int | None = None
    mtu: int = 1500
    multicast: str | None = None  # IP multicast group for results (with thc-aggregator --multicast)
    codec: str | None = None  #: dar: codec name (worker_lib.codecs.CODEC_NAMES, kind DAR)
    length: int | None = None  #: dar: tensor length d
    max_message: int | None = None  #: dar: largest codec message, bytes (uplink and downlink)
    seed: int | None = None  #: dar: base seed of the per-round re-encoding seed (default 0)
    leaves: tuple[int, ...] | None = None  #: two-tier job: local workers of each leaf (docs/protocol.md)
    _lookup: LookupTable | None = field(default=None, init=False, repr=False, compare=False)
    _table_id: int = field(default=0, init=False, repr=False, compare=False)  # a hash: computed once

    def __post_init__(self) -> None:
        self._check_types()
        if not 0 <= self.job < 1 << 16:
            raise JobConfigError(f"job id must be in [0, 65536), got {self.job}")
        if not 0 <= self.key < 1 << 32:
            raise JobConfigError(f"key must be a 32-bit unsigned integer, got {self.key}")
        if self.leaves is not None:
            self._check_leaves()
        elif not 1 <= self.workers <= MAX_WORKERS:
            raise JobConfigError(f"job {self.job}: workers must be in 1..{MAX_WORKERS}, got {self.workers}")
        thr = self.workers if self.threshold is None else self.threshold
        if not 1 <= thr <= self.workers:
            raise JobConfigError(f"job {self.job}: threshold must be in 1..workers={self.workers}, got {thr}")
        object.__setattr__(self, "threshold", thr)
        if self.kind not in JOB_KINDS:
            raise JobConfigError(f"job {self.job}: kind must be one of {', '.join(JOB_KINDS)}, got {self.kind!r}")
        if self.multicast is not None:
            host, _, port = str(self.multicast).rpartition(":")
            try:
                first = int(host.split(".")[0])
                ok = len(host.split(".")) == 4 and 224 <= first <= 239 and 0 < int(port) < 65536
            except ValueError:
                ok = False
            if not ok:
                raise JobConfigError(f"job {self.job}: multicast must be GROUP:PORT with an IPv4 multicast group "
                                     f"(224.0.0.0/4), got {self.multicast!r}")
        if not 1 <= self.slots <= 1 << 16:
            raise JobConfigError(f"job {self.job}: slots must be in 1..65536, got {self.slots}")
        if not 68 <= self.mtu <= MAX_MTU:  # an aggregator's rows hold a jumbo frame's datagram, no more
            raise JobConfigError(f"job {self.job}: mtu must be in 68..{MAX_MTU} (IPv4's least to a jumbo frame), "
                                 f"got {self.mtu}")
        if self.kind == "dar":
            self._check_dar()
            return
        given = [k for k in _DAR_ONLY if getattr(self, k) is not None]
        if given:
            raise JobConfigError(f"job {self.job}: {', '.join(given)}: only for kind='dar' jobs, this job is "
                                 f"kind={self.kind!r}")
        if self.kind == "thc":
            try:
                if self.table is not None:
                    lookup = LookupTable(bits=self.bits, granularity=self.granularity, p=None,
                                         values=tuple(int(v) for v in self.table), objective=None)
                else:
                    lookup = solve_table(self.bits, self.granularity, self.p)
            except ValueError as exc:
                raise JobConfigError(f"job {self.job}: {exc}") from None
            object.__setattr__(self, "_lookup", lookup)
            object.__setattr__(self, "_table_id", lookup.table_id())
            top = self.granularity * self.workers
            if self.result_bits is None:
                fit = [w for w in RESULT_WIDTHS if top < 1 << w]
                object.__setattr__(self, "result_bits", fit[0])
        else:
            top = None
            if self.result_bits is None:
                object.__setattr__(self, "result_bits", 32)
            if self.result_bits != 32:
                raise JobConfigError(f"job {self.job}: uncompressed jobs sum int32, result_bits must be 32")
        if self.result_bits not in RESULT_WIDTHS:
            raise JobConfigError(f"job {self.job}: result_bits must be one of {RESULT_WIDTHS}, "
                                 f"got {self.result_bits}")
        if top is not None and top >= 1 << self.result_bits:
            raise JobConfigError(
                f"job {self.job}: g * n = {self.granularity} * {self.workers} = {top} does not fit "
                f"{self.result_bits}-bit results (max {(1 << self.result_bits) - 1}); use wider results, "
                f"fewer workers or a smaller granularity")
        room = self.mtu - IP_UDP_OVERHEAD - HEADER_BYTES
        per = self.result_bits // 8
        if self.elems is None:
            k = min(65528, (room // per) // 8 * 8)
            if k < 8:
                raise JobConfigError(f"job {self.job}: mtu {self.mtu} leaves no room for 8 results")
            object.__setattr__(self, "elems", k)
        k = self.elems
        if k < 8 or k % 8 or k >= 1 << 16:
            raise JobConfigError(f"job {self.job}: elems (K) must be a positive multiple of 8 below 65536, "
                                 f"got {k}")
        if k * per > room:
            total = HEADER_BYTES + IP_UDP_OVERHEAD + k * per
            raise JobConfigError(f"job {self.job}: a result of {k} x {self.result_bits}-bit sums "
                                 f"({total} bytes with headers) exceeds the mtu {self.mtu}")

    def _check_types(self) -> None:
        """Refuse a setting of the wrong type by name (``workers=4.5`` or ``slots="8"`` used to pass, or
        fail later in a comparison or a multiplication that named no field)."""
        for name in ("job", "key", "workers", "threshold", "bits", "granularity", "result_bits", "slots", "elems",
                     "mtu", "length", "max_message", "seed"):
            value = getattr(self, name)
            if value is not None and not is_integer(value):
                raise JobConfigError(f"job {self.job!r}: {name} must be an integer, got {value!r}")
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float, np.floating)):
            raise JobConfigError(f"job {self.job}: p must be a number, got {self.p!r} (a job file or spec "
                                 "also takes a fraction like '1/32')")
        for name in ("table", "leaves"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, (str, bytes)) or not hasattr(value, "__iter__")):
                raise JobConfigError(f"job {self.job}: {name} must be a sequence of integers, got {value!r}")

    def _check_leaves(self) -> None:
        """Validate a two-tier job's leaf layout (the widths are checked with the one-tier rules)."""
        leaves = tuple(self.leaves)
        object.__setattr__(self, "leaves", leaves)
        if not 1 <= len(leaves) <= MAX_WORKERS or any(isinstance(n, bool) or not isinstance(n, int) or
                                                      not 1 <= n <= MAX_WORKERS for n in leaves):
            raise JobConfigError(f"job {self.job}: leaves must list 1..{MAX_WORKERS} leaves of 1..{MAX_WORKERS} "
                                 f"workers each, got {list(leaves)}")
        if self.workers != sum(leaves):
            raise JobConfigError(f"job {self.job}: workers={self.workers} but the leaves hold {sum(leaves)} "
                                 f"({'+'.join(map(str, leaves))}); set workers={sum(leaves)}")
        if self.kind == "dar":
            raise JobConfigError(f"job {self.job}: dar jobs have one tier (the software aggregator); drop leaves=")
        if self.multicast is not None:
            raise JobConfigError(f"job {self.job}: a two-tier job's results travel by unicast; drop multicast=")

    @property
    def tiered(self) -> bool:
        """A two-tier job (``leaves`` set)."""
        return self.leaves is not None

    def check_one_tier(self) -> None:
        """Raise JobConfigError for a two-tier job: a one-tier aggregator serves ``leaf(l)`` of it at most."""
        if self.leaves is not None:
            raise JobConfigError(f"job {self.job} has two tiers (leaves={':'.join(map(str, self.leaves))}): "
                                 f"serve it with thc-aggregator --role leaf / --role spine")

    def tier_of(self, worker: int) -> tuple[int, int]:
        """Two-tier job: (leaf, local worker id) of the job's worker ``worker`` (numbered leaf by leaf)."""
        if self.leaves is None:
            raise ValueError(f"job {self.job} has one tier")
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is not in 0..{self.workers - 1}")
        for leaf, n in enumerate(self.leaves):
            if worker < n:
                return leaf, worker
            worker -= n
        raise AssertionError("unreachable")

    def partial_bits(self, leaf: int) -> int:
        """Two-tier job: the width of leaf ``leaf``'s partial sums (smallest of 8/16/32 holding g * n_l;
        32 for uncompressed jobs)."""
        n = self.leaves[leaf]
        if self.kind != "thc":
            return 32
        return next(w for w in RESULT_WIDTHS if self.granularity * n < 1 << w)

    def leaf(self, leaf: int) -> JobConfig:
        """Two-tier job: the one-tier job leaf ``leaf`` serves: its n_l local workers, all of them
        needed (a leaf forwards only full partials), the spine's result width and K."""
        if self.leaves is None:
            raise ValueError(f"job {self.job} has one tier")
        n = self.leaves[leaf]
        return replace(self, workers=n, threshold=n, leaves=None)

    def result_counts(self, contributors: np.ndarray, bitmap: np.ndarray) -> np.ndarray:
        """Workers summed in results with these ``contributors`` and ``bitmap`` fields: the contributors
        of a one-tier job; in a two-tier job, whose results count leaves, the workers of the leaves in
        the bitmap."""
        if self.leaves is None:
            return np.asarray(contributors, np.int64)
        bits = (np.asarray(bitmap, np.int64)[:, None] >> np.arange(len(self.leaves))) & 1
        return bits @ np.asarray(self.leaves, np.int64)

    def _check_dar(self) -> None:
        """Validate and complete a dar job (codec, d, message and fragment sizes, memory)."""
        from worker_lib.codecs import CODEC_NAMES

        dar_names = dar_codec_names()
        if self.codec is None:
            raise JobConfigError(f"job {self.job}: a dar job needs codec=NAME, one of {', '.join(dar_names)}")
        if self.codec not in CODEC_NAMES:
            raise JobConfigError(f"job {self.job}: unknown codec {self.codec!r}; dar codecs: {', '.join(dar_names)}")
        if self.codec not in dar_names:
            raise JobConfigError(f"job {self.job}: codec {self.codec!r} is homomorphic: the aggregator adds its "
                                 f"table values without decompressing (kind='thc'); dar codecs: "
                                 f"{', '.join(dar_names)}")
        for name in ("length", "max_message"):
            v = getattr(self, name)
            if v is None:
                raise JobConfigError(f"job {self.job}: a dar job needs {name}=N")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise JobConfigError(f"job {self.job}: {name} must be a positive integer, got {v!r}")
        seed = 0 if self.seed is None else self.seed
        if not 0 <= seed < 1 << 32:
            raise JobConfigError(f"job {self.job}: seed must be a 32-bit unsigned integer, got {seed}")
        if self.result_bits is None:
            object.__setattr__(self, "result_bits", 8)
        if self.result_bits != 8:
            raise JobConfigError(f"job {self.job}: dar fragments carry bytes: result_bits must be 8")
        room = self.mtu - IP_UDP_OVERHEAD - HEADER_BYTES - DAR_PREFIX_BYTES
        if self.elems is None:
            if room < 1:
                raise JobConfigError(f"job {self.job}: mtu {self.mtu} leaves no room for a dar fragment")
            object.__setattr__(self, "elems", min(room, self.max_message))
        if not 1 <= self.elems <= room:
            raise JobConfigError(f"job {self.job}: elems (message bytes per fragment) must be in 1..{room} "
                                 f"(mtu {self.mtu}), got {self.elems}")
        if self.max_message >= 1 << 29:
            raise JobConfigError(f"job {self.job}: max_message {self.max_message} exceeds the 32-bit bit count")
        memory = self.dar_memory
        if memory > MAX_DAR_MEMORY:
            raise JobConfigError(f"job {self.job}: the dar buffers would take {memory / 2**20:.0f} MiB "
                                 f"(workers x slots x 2 banks x max_message, plus results), over the "
                                 f"{MAX_DAR_MEMORY >> 20} MiB limit; use fewer slots or a smaller max_message")

    @property
    def max_fragments(self) -> int:
        """dar: fragments of the largest message (ceil(max_message / elems))."""
        if self.kind != "dar":
            raise ValueError(f"job {self.job} is not a dar job")
        return -(-self.max_message // self.elems)

    @property
    def dar_memory(self) -> int:
        """dar: bytes of the preallocated reassembly buffers and retained result packets."""
        frags = self.max_fragments
        per_bank = self.workers * frags * self.elems + frags * (HEADER_BYTES + DAR_PREFIX_BYTES + self.elems)
        return self.slots * 2 * per_bank

    @property
    def dar_seed(self) -> int:
        """dar: the base seed (0 when not configured)."""
        return 0 if self.seed is None else self.seed

    @property
    def lookup(self) -> LookupTable | None:
        """The THC table (None for uncompressed jobs)."""
        return self._lookup

    @property
    def table_id(self) -> int:
        """The table id packets must carry (0 for uncompressed jobs)."""
        return self._table_id

    @functools.cached_property
    def data_width(self) -> int:
        """Bits per element of a DATA payload: b, 32 for uncompressed jobs, 8 (bytes) for dar fragments."""
        return {"thc": self.bits, "dar": 8}.get(self.kind, 32)

    @functools.cached_property
    def data_bytes(self) -> int:
        return self.elems * self.data_width // 8

    @functools.cached_property
    def result_bytes(self) -> int:
        return self.elems * self.result_bits // 8

    def request_fields(self, typ: PacketType, **fields: Any) -> dict[str, Any]:
        """The header fields of a worker's request of this job (docs/protocol.md, "Validation"): type,
        job, key, table id, and the ``elems``/``width`` its kind must carry, plus ``fields`` (worker, slot,
        round, tensor, chunk: ints or, for ``serializer.build_batch``, arrays). ``Header(**...)`` makes one."""
        if typ == PacketType.NORM:
            elems, width = 1, 32
        else:
            elems, width = self.elems, self.data_width
        return {"type": int(typ), "job": self.job, "key": self.key, "table_id": self.table_id, "elems": elems,
                "width": width, **fields}

    def values(self) -> np.ndarray:
        """The table as int32 (THC jobs)."""
        if self._lookup is None:
            raise ValueError(f"job {self.job} is uncompressed: it has no table")
        return self._lookup.as_array()

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items() if v is not None}

    def spec(self) -> str:
        """The job as a ``--job`` spec (``parse_job_spec`` gives it back): for thc-aggregator, its control
        ``add`` command and workers. It holds the job's key: pass it only to those that may have it."""
        return ",".join(f"{k}={':'.join(map(str, v)) if isinstance(v, list) else v}"
                        for k, v in self.to_dict().items())


@functools.lru_cache(maxsize=1)
def dar_codec_names() -> tuple[str, ...]:
    """Registered codec names whose kind is DAR (imports torch, so only when a dar job is configured)."""
    from worker_lib.codecs import CODEC_NAMES, CodecKind, make_codec

    return tuple(n for n in CODEC_NAMES if make_codec(n, seed=0).kind == CodecKind.DAR)


_INT_KEYS = {"job", "key", "workers", "threshold", "bits", "granularity", "result_bits", "slots", "elems",
             "mtu", "length", "max_message", "seed"}


def job_from_mapping(raw: dict[str, Any], where: str = "job") -> JobConfig:
    """A JobConfig from a dict (config file table or CLI spec), with clear messages for bad keys.

    ``granularity = "auto"`` (and with it ``bits = "auto"``) chooses the widths from the workers and the
    result width (default 8 bits) so that the sums cannot overflow (``worker_lib.thc.widths``); the
    choice and its cost are logged."""
    names = {f.name for f in fields(JobConfig) if f.init}
    unknown = set(raw) - names
    if unknown:
        raise JobConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(names)}")
    auto = {k for k in ("granularity", "bits") if isinstance(raw.get(k), str) and raw[k].strip().lower() == "auto"}
    vals: dict[str, Any] = {}
    for k, v in raw.items():
        if k in auto:
            continue
        if k in _INT_KEYS and isinstance(v, str):
            try:
                v = int(v, 0)
            except ValueError:
                raise JobConfigError(f"{where}: {k} must be an integer, got {v!r}") from None
        elif k == "p" and isinstance(v, str):
            v = _parse_fraction(v, where)
        elif k in ("table", "leaves") and v is not None:
            v = _integers(v, f"{where}: {k}")
        vals[k] = v
    if vals.get("leaves") and "workers" not in vals:
        vals["workers"] = sum(vals["leaves"])  # a two-tier job's workers are its leaves'
    if auto:
        vals = _resolve_auto_widths(vals, auto, where)
    return JobConfig(**vals)


def _resolve_auto_widths(vals: dict[str, Any], auto: set[str], where: str) -> dict[str, Any]:
    """``vals`` (parsed) with the ``auto`` keys (granularity, and bits) set to the chosen b, g and result width."""
    if "granularity" not in auto:
        raise JobConfigError(f"{where}: bits=auto chooses b together with g: add granularity=auto")
    if vals.get("kind", "thc") != "thc":
        raise JobConfigError(f"{where}: granularity=auto is for THC jobs, not kind {vals['kind']!r}")
    if vals.get("table") is not None:
        raise JobConfigError(f"{where}: granularity=auto solves the table; drop table= or give granularity")
    from worker_lib.thc.widths import WidthError, choose_widths

    defaults = JobConfig.__dataclass_fields__
    workers = vals.get("workers", defaults["workers"].default)
    try:
        choice = choose_widths(workers, vals.get("result_bits"), None if "bits" in auto else
                               vals.get("bits", defaults["bits"].default), vals.get("p", defaults["p"].default))
    except WidthError as exc:
        raise JobConfigError(f"{where}: {exc}") from None
    log.info("%s: %s", where, choice.describe(workers))
    return {**vals, "bits": choice.bits, "granularity": choice.granularity, "result_bits": choice.result_bits}


def _parse_fraction(text: str, where: str) -> float:
    try:
        return parse_fraction(text)
    except ValueError:
        raise JobConfigError(f"{where}: p must be a number or a fraction like 1/32, got {text!r}") from None


def _integers(value: object, what: str) -> tuple[int, ...]:
    """A spec's ``N:N:...`` or a TOML array of integers as a tuple; anything else (a TOML 1.5, which int()
    would truncate to 1, or true) refused, naming ``what``."""
    items = value.split(":") if isinstance(value, str) else value
    try:
        out = tuple(int(x) if isinstance(x, str) else x for x in items)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        out = None
    if out is None or not all(is_integer(x) for x in out):
        raise JobConfigError(f"{what} must be integers (N:N:... in a spec, an array in a file), got {value!r}")
    return tuple(int(x) for x in out)


def parse_job_spec(spec: str) -> JobConfig:
    """``job=2,key=0x1234,workers=4,threshold=3,bits=4,granularity=30,p=1/32`` -> JobConfig."""
    raw: dict[str, Any] = {}
    if not spec.strip():
        raise JobConfigError("empty job spec: give key=value pairs, e.g. job=2,key=0x1234,workers=4")
    for part in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in part:
            raise JobConfigError(f"job spec {spec!r}: expected key=value, got {part!r}")
        k, v = (x.strip() for x in part.split("=", 1))
        if k in raw:  # the later one silently won: the job ran with a setting its user did not mean
            raise JobConfigError(f"job spec {spec!r}: {k} is given twice ({raw[k]!r} and {v!r})")
        raw[k] = v
    return job_from_mapping(raw, f"job spec {spec!r}")


def load_jobs(path: str | Path) -> list[JobConfig]:
    """Jobs from a TOML file: one ``[[job]]`` table per job (docs/aggregator.md)."""
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise JobConfigError(f"job config file {p} does not exist") from None
    except UnicodeDecodeError:
        raise JobConfigError(f"{p}: not a UTF-8 text file (a TOML job file is expected)") from None
    except OSError as exc:
        raise JobConfigError(f"job config file {p}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobConfigError(f"{p}: not valid TOML: {exc}") from None
    extra = set(doc) - {"job"}
    if extra:
        raise JobConfigError(f"{p}: unknown top-level keys {sorted(extra)}; jobs go in [[job]] tables")
    tables = doc.get("job", [])
    if not isinstance(tables, list):
        raise JobConfigError(f"{p}: 'job' must be an array of tables ([[job]])")
    try:
        jobs = [job_from_mapping(t, f"{p} job #{i}") for i, t in enumerate(tables)]
    except JobConfigError as exc:  # a setting out of range names its job, not always the file
        raise JobConfigError(str(exc) if str(exc).startswith(str(p)) else f"{p}: {exc}") from None
    return unique_jobs(jobs, str(p))


def unique_jobs(jobs: list[JobConfig], where: str) -> list[JobConfig]:
    """``jobs``, refused (JobConfigError naming ``where``) if two of them share an id: one would silently
    replace the other."""
    ids = [j.job for j in jobs]
    if len(set(ids)) != len(ids):
        raise JobConfigError(f"{where}: duplicate job ids {sorted({i for i in ids if ids.count(i) > 1})}")
    return jobs
