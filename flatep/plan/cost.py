"""The cost model of one MoE layer step: predicted time of every rank for a candidate allocation.

A :class:`CostProfile` holds measured constants of a device and its link (``flatep calibrate``).
:meth:`CostProfile.constants` turns them, for one :class:`~flatep.EPConfig`, into integer
femtosecond constants (:class:`CostConstants`) on the host; :func:`predict` evaluates the model with
int64 tensor arithmetic only, so it gives the same integers on the CPU and on the GPU, never reads
a device tensor on the host, and can be captured in a CUDA graph. ``docs/cost-model.md`` states the
formula; in short, for rank ``d`` and a candidate ``alloc [E, R]`` (rows of expert ``e`` on rank
``d``):

* GEMM: every non-empty group ``g`` (an expert with ``n_g > 0`` rows on ``d``) costs
  ``group + max(weight, ceil(n_g / tile) * tile * row)``: a fixed overhead, then the larger of
  reading the expert's weights from HBM and computing its rows in whole tiles;
* push: ``max(sent, received) * expert_bytes * link`` (a donor pays what it sends, a receiver
  what it receives), plus ``push`` on every rank if the candidate moves any expert;
* dispatch and combine: the entries that cross the link, ``max(out, in)`` per rank, times the
  bytes of a dispatched row (``H`` activations and a route weight) plus a combined row.

The layer is as slow as its busiest rank.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from flatep.config import EPConfig, rows_per_expert

_FS_PER_US = 10**9
_FS_PER_S = 10**15
_PPM = 10**6
# Every link term is kept below 2**60 fs so that a few of them plus the GEMM terms fit int64.
_LINK_FS_LIMIT = 2**60
_PROFILES = Path(__file__).resolve().parent.parent / "bench" / "profiles"
_SHIPPED: dict[str, "CostProfile"] = {}


@dataclass(frozen=True)
class CostProfile:
    """Measured constants of one device and its expert-parallel link.

    Attributes:
        link_gbps: bandwidth of the link between EP ranks, per rank and direction, in GB/s
            (``1e9`` bytes per second).
        hbm_gbps: HBM read bandwidth of a grouped GEMM's weight reads, in GB/s.
        gemm_tflops: grouped-GEMM throughput at many rows per group, in TFLOP/s (``1e12`` per second).
        group_us: fixed time of every non-empty expert group of a grouped GEMM, in microseconds
            (tile scheduling, prologue and epilogue; the GEMM of one group of ``tile_rows`` rows
            costs about ``group_us + max(weight read, compute)``).
        push_us: fixed time of a step that moves any expert's weights (push launches and the
            barrier after them), in microseconds, charged to every rank.
        tile_rows: rows of one GEMM tile: a group's rows are computed in whole tiles.
        name: a label (the device it was measured on).
        decode_gemm_tflops, decode_group_us, decode_tile_rows: ``gemm_tflops``, ``group_us`` and
            ``tile_rows`` of steps whose experts hold at most
            :data:`flatep.kernels.decode_gemm.DECODE_ROWS_PER_GROUP` rows on average
            (``ceil(T*K/E)``), where the layer runs its decode kernels (small tiles, weights
            streamed once) instead of ``torch._grouped_mm``; None: the same as the others.
        expert_bytes: bytes of one expert's weights as the pool stores and pushes them (values and
            scales), or None for bf16 (:meth:`flatep.EPConfig.expert_bytes`). Not a device constant:
            :func:`flatep.ep_moe` fills it from a packed (fp8, mxfp4) pool; planning on its own
            takes it from :meth:`with_expert_bytes`.
        row_bytes: link bytes one entry costs in dispatch plus combine, or None for rows in bf16
            both ways plus the fp32 route weight (``2*H*2 + 4``). Not a device constant either:
            :func:`flatep.ep_moe` fills it for fp8 dispatch (:meth:`with_row_bytes`).
        margins: ``((rows_per_expert, fraction), ...)``: how far the model's per-rank times are
            off, measured by ``flatep calibrate`` at steps of that many rows per expert on
            average (``ceil(T*K/E)``). ``auto`` moves weights only when the model puts the moving
            candidate faster than classic by more than the fraction of the measured step nearest
            (in log rows, within the step's regime: :meth:`margin`) to the step at hand: a saving
            smaller than the model's error is not taken. None or empty: no margin. Each fraction
            is in ``[0, 1)``.
    """

    link_gbps: float
    hbm_gbps: float
    gemm_tflops: float
    group_us: float
    push_us: float
    tile_rows: int
    name: str = "custom"
    expert_bytes: int | None = None
    decode_gemm_tflops: float | None = None
    decode_group_us: float | None = None
    decode_tile_rows: int | None = None
    row_bytes: int | None = None
    margins: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "margins":
                object.__setattr__(self, "margins", _checked_margins(value))
            elif field.name in ("expert_bytes", "row_bytes"):
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"CostProfile.{field.name} must be None or a positive integer, got {value!r}")
            elif field.name == "name":
                if not isinstance(value, str):
                    raise ValueError(f"CostProfile.name must be a string, got {value!r}")
            elif field.name in ("tile_rows", "decode_tile_rows"):
                if (value is not None or field.name == "tile_rows") and (
                        isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"CostProfile.{field.name} must be a positive integer, got {value!r}")
            elif value is None and field.name in ("decode_gemm_tflops", "decode_group_us"):
                continue
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"CostProfile.{field.name} must be a finite number > 0, got {value!r}")

    @classmethod
    def from_dict(cls, values: dict) -> "CostProfile":
        """A profile from a mapping of its fields; a missing or unknown field raises ``ValueError``."""
        if not isinstance(values, dict):
            raise ValueError(f"a cost profile must be a mapping of its fields, got {type(values).__name__}")
        names = [field.name for field in dataclasses.fields(cls)]
        required = [field.name for field in dataclasses.fields(cls) if field.default is dataclasses.MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"cost profile is missing field(s) {missing} (fields: {names})")
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"cost profile has unknown field(s) {unknown} (fields: {names})")
        return cls(**values)

    def to_dict(self) -> dict:
        """The fields as a JSON-ready mapping."""
        values = dataclasses.asdict(self)
        values["margins"] = None if self.margins is None else [list(pair) for pair in self.margins]
        return values

    def margin(self, config: EPConfig, total_tokens: int | None) -> float:
        """The decision margin of a step of ``T`` tokens: the fraction of :attr:`margins` measured
        nearest (in log rows per expert) to the step's ``ceil(T*K/E)``, among the sizes of the
        step's regime (the decode kernels' few rows per expert, or more: see
        :func:`few_rows_per_expert`); 0 without margins of that regime or without ``T``."""
        if not self.margins or total_tokens is None:
            return 0.0
        from flatep.kernels.decode_gemm import DECODE_ROWS_PER_GROUP

        few = few_rows_per_expert(config, total_tokens)
        same_regime = [pair for pair in self.margins if (pair[0] <= DECODE_ROWS_PER_GROUP) == few]
        if not same_regime:
            return 0.0
        rows = math.log(max(1, rows_per_expert(total_tokens, config.top_k, config.experts)))
        return min(same_regime, key=lambda pair: abs(math.log(pair[0]) - rows))[1]

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        """Read a profile written by :meth:`save` (or ``flatep calibrate --out``)."""
        try:
            values = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"cost profile {path} is not valid JSON: {error}") from None
        return cls.from_dict(values)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def preset(cls, name: str) -> "CostProfile":
        """A shipped profile: ``generic`` or ``h200`` (files in ``flatep/bench/profiles``)."""
        # Planning under auto asks for the default every step: read each file once.
        if name not in _SHIPPED:
            shipped = sorted(path.stem for path in _PROFILES.glob("*.json"))
            if name not in shipped:
                raise ValueError(f"cost profile preset must be one of {shipped}, got {name!r}")
            _SHIPPED[name] = cls.load(_PROFILES / f"{name}.json")
        return _SHIPPED[name]

    @classmethod
    def named(cls, name_or_path: str) -> "CostProfile":
        """A preset by name (``generic``, ``h200``) or a profile file (a ``.json`` path or any existing file)."""
        if not isinstance(name_or_path, str):
            raise ValueError(f"cost must be a preset name or the path of a JSON profile, got {name_or_path!r}")
        path = Path(name_or_path)
        if path.suffix == ".json" or path.exists():
            if not path.is_file():
                raise ValueError(f"profile file {name_or_path!r} does not exist")
            try:
                return cls.load(path)
            except ValueError as error:
                raise ValueError(f"{name_or_path}: {error}") from None
        try:
            return cls.preset(name_or_path)
        except ValueError as error:
            raise ValueError(f"{error}, or the path of a JSON profile (flatep calibrate --out)") from None

    @classmethod
    def default(cls) -> "CostProfile":
        """The generic shipped profile (``preset("generic")``)."""
        return cls.preset("generic")

    def with_expert_bytes(self, expert_bytes: int | None) -> "CostProfile":
        """This profile for experts stored in ``expert_bytes`` bytes each (None: bf16)."""
        return dataclasses.replace(self, expert_bytes=expert_bytes)

    def with_row_bytes(self, row_bytes: int | None) -> "CostProfile":
        """This profile for entries that cost ``row_bytes`` link bytes in dispatch plus combine (None: bf16 rows)."""
        return dataclasses.replace(self, row_bytes=row_bytes)

    def constants(
        self, config: EPConfig, weight_bytes: int | None = None, row_bytes: int | None = None, *,
        total_tokens: int | None = None,
    ) -> "CostConstants":
        """The model's integer constants for ``config``.

        Args:
            config: the group's sizes.
            total_tokens: the step's ``T`` (all ranks' tokens): where its experts hold at most
                :data:`~flatep.kernels.decode_gemm.DECODE_ROWS_PER_GROUP` rows on average, the
                decode fields apply (``decode_gemm_tflops``, ``decode_group_us``, ``decode_tile_rows``,
                where set). None:
                the others.
            weight_bytes: bytes of one expert's weights as stored and pushed (default: the profile's
                ``expert_bytes``, else bf16: :meth:`~flatep.EPConfig.expert_bytes`).
            row_bytes: link bytes one entry costs in dispatch plus combine (default: the profile's
                ``row_bytes``, else bf16 rows both ways plus the fp32 route weight: ``2*H*2 + 4``).
        """
        if weight_bytes is None:
            weight_bytes = config.expert_bytes() if self.expert_bytes is None else self.expert_bytes
        if row_bytes is None:
            row_bytes = 2 * config.token_bytes() + 4 if self.row_bytes is None else self.row_bytes
        for name, value in (("weight_bytes", weight_bytes), ("row_bytes", row_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        flops_per_row = 2 * 3 * config.hidden * config.intermediate
        tflops, group_us, tile_rows = self.gemm_tflops, self.group_us, self.tile_rows
        if total_tokens is not None and few_rows_per_expert(config, total_tokens):
            tflops = tflops if self.decode_gemm_tflops is None else self.decode_gemm_tflops
            group_us = group_us if self.decode_group_us is None else self.decode_group_us
            tile_rows = tile_rows if self.decode_tile_rows is None else self.decode_tile_rows
        # The most link bytes one rank can see in a step: a donor lends at most epn experts to
        # each other rank, and at most every entry of the group crosses.
        link_bytes = (config.ranks - 1) * config.experts_per_rank * weight_bytes
        link_bytes = max(link_bytes, config.ranks * config.capacity * config.top_k * row_bytes)
        return CostConstants(
            row_fs=round(flops_per_row * _FS_PER_S / (tflops * 1e12)),
            tile_rows=tile_rows,
            weight_fs=round(weight_bytes * _FS_PER_S / (self.hbm_gbps * 1e9)),
            group_fs=round(group_us * _FS_PER_US),
            push_fs=round(self.push_us * _FS_PER_US),
            byte_fs=min(round(_FS_PER_S / (self.link_gbps * 1e9)), _LINK_FS_LIMIT // link_bytes),
            weight_bytes=weight_bytes,
            row_bytes=row_bytes,
            # A fraction just below 1 must not round to a whole classic time (choose takes < 10**6).
            margin_ppm=min(round(self.margin(config, total_tokens) * _PPM), _PPM - 1),
        )


def _checked_margins(value) -> tuple[tuple[float, float], ...] | None:
    """``margins`` as a tuple of ``(rows_per_expert, fraction)`` pairs; ``ValueError`` naming the field otherwise."""
    if value is None:
        return None
    expected = "CostProfile.margins must be None or a list of [rows_per_expert > 0, fraction in [0, 1)] pairs"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{expected}, got {value!r}")
    pairs = []
    for pair in value:
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2 or any(
                isinstance(item, bool) or not isinstance(item, (int, float)) for item in pair):
            raise ValueError(f"{expected}, got {value!r}")
        rows, fraction = pair
        if not 0 < rows < math.inf or not 0 <= fraction < 1:
            raise ValueError(f"{expected}, got {value!r}")
        pairs.append((float(rows), float(fraction)))
    return tuple(pairs)


def few_rows_per_expert(config: EPConfig, total_tokens: int) -> bool:
    """Whether a step of ``T`` tokens runs the decode kernels' regime: its experts hold at most
    :data:`flatep.kernels.decode_gemm.DECODE_ROWS_PER_GROUP` rows on average (``ceil(T*K/E)``,
    the rule :func:`flatep.experts.grouped.grouped_swiglu` follows for bf16 weights)."""
    from flatep.kernels.decode_gemm import DECODE_ROWS_PER_GROUP

    return rows_per_expert(total_tokens, config.top_k, config.experts) <= DECODE_ROWS_PER_GROUP


@dataclass(frozen=True)
class CostConstants:
    """Integer constants of the model for one config, in femtoseconds (host integers).

    Attributes:
        row_fs: compute time of one row of one expert (gate/up and down GEMMs).
        tile_rows: rows of a GEMM tile.
        weight_fs: time to read one expert's weights from HBM.
        group_fs: fixed time of a non-empty group.
        push_fs: fixed time of a step that moves weights.
        byte_fs: link time of one byte (clamped so that no link term exceeds ``2**60``).
        weight_bytes: bytes of one expert's weights.
        row_bytes: link bytes of one entry (dispatch plus combine).
        margin_ppm: the step's decision margin (:meth:`CostProfile.margin`) in parts per million.
    """

    row_fs: int
    tile_rows: int
    weight_fs: int
    group_fs: int
    push_fs: int
    byte_fs: int
    weight_bytes: int
    row_bytes: int
    margin_ppm: int = 0


@dataclass
class Prediction:
    """What the model predicts for each candidate (int64 tensors on the histogram's device).

    Attributes:
        rank_fs: ``[C, R]`` predicted layer time of each rank, in femtoseconds.
        layer_fs: ``[C]`` the busiest rank's time.
        experts_moved: ``[C]`` (expert, receiver) pairs whose weights move.
        bytes_moved: ``[C]`` weight bytes pushed over the link in all.
    """

    rank_fs: torch.Tensor
    layer_fs: torch.Tensor
    experts_moved: torch.Tensor
    bytes_moved: torch.Tensor


def local_entries(tokens_per_expert: torch.Tensor, alloc: torch.Tensor) -> torch.Tensor:
    """``[C, R] int64``: entries each rank both sends and computes (they cross no link).

    Entries of expert ``e`` are ordered by source rank (``tokens_per_expert[r, e]`` from rank ``r``)
    and cut into chunks by destination rank (``alloc[c, e, d]``), as the planners place them; the
    local ones of rank ``d`` are the overlap of its source interval with its chunk.

    Args:
        tokens_per_expert: ``[R, E]`` integer histogram.
        alloc: ``[C, E, R]`` integer allocation of each candidate.
    """
    counts = tokens_per_expert.long()
    source_end = counts.cumsum(0)  # [R, E]
    source_start = source_end - counts
    chunk_end = alloc.long().cumsum(2).transpose(1, 2)  # [C, R, E]
    chunk_start = chunk_end - alloc.long().transpose(1, 2)
    overlap = torch.minimum(source_end, chunk_end) - torch.maximum(source_start, chunk_start)
    return overlap.clamp_min(0).sum(2)


def predict(tokens_per_expert: torch.Tensor, alloc: torch.Tensor, constants: CostConstants) -> Prediction:
    """Evaluate the model for ``C`` candidate allocations of one step.

    Args:
        tokens_per_expert: ``[R, E]`` int32/int64 gathered histogram (row ``r`` = rank ``r``'s ids).
        alloc: ``[C, E, R]`` int32/int64 rows of expert ``e`` computed on rank ``d`` per candidate
            (home rank of ``e`` = ``e // (E/R)``), on the same device.
        constants: from :meth:`CostProfile.constants`.

    Returns:
        The :class:`Prediction`; integer arithmetic only, no host synchronisation.
    """
    if alloc.dim() != 3 or tokens_per_expert.dim() != 2 or tuple(alloc.shape[1:]) != tuple(tokens_per_expert.shape[::-1]):
        raise ValueError(
            f"alloc must be [C, E, R] and tokens_per_expert [R, E] of the same E and R, got "
            f"{list(alloc.shape)} and {list(tokens_per_expert.shape)}"
        )
    ranks, experts = tokens_per_expert.shape
    epn = experts // ranks
    rows = alloc.long()  # [C, E, R]
    tiles = (rows + constants.tile_rows - 1) // constants.tile_rows
    compute = torch.clamp_min(tiles * (constants.tile_rows * constants.row_fs), constants.weight_fs)
    gemm = torch.where(rows > 0, compute + constants.group_fs, 0).sum(1)  # [C, R]

    home = torch.arange(experts, device=rows.device) // epn
    foreign = (rows > 0) & (home.view(1, -1, 1) != torch.arange(ranks, device=rows.device).view(1, 1, -1))
    received = foreign.sum(1)  # [C, R] experts borrowed by each rank
    lent = foreign.sum(2).view(-1, ranks, epn).sum(2)  # [C, R] (expert, receiver) pairs each donor sends
    moved = received.sum(1)
    push = torch.maximum(received, lent) * constants.weight_bytes * constants.byte_fs
    push = push + torch.where(moved > 0, constants.push_fs, 0).unsqueeze(1)

    local = local_entries(tokens_per_expert, rows)
    sent = tokens_per_expert.long().sum(1).unsqueeze(0) - local  # [C, R]
    arrived = rows.sum(1) - local
    rows_link = torch.maximum(sent, arrived) * constants.row_bytes * constants.byte_fs

    rank_fs = gemm + push + rows_link
    return Prediction(
        rank_fs=rank_fs,
        layer_fs=rank_fs.max(1).values,
        experts_moved=moved,
        bytes_moved=moved * constants.weight_bytes,
    )


def check_cost(policy: str, cost: CostProfile | None) -> None:
    """Raise ``ValueError`` unless ``cost`` is None or a :class:`CostProfile` passed with policy ``auto``."""
    if cost is None:
        return
    if not isinstance(cost, CostProfile):
        raise ValueError(f"cost must be a flatep.CostProfile or None, got {type(cost).__name__}")
    if policy != "auto":
        raise ValueError(f"cost is used by policy='auto' only, got policy={policy!r}")

