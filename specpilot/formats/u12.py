"""The lossless 12-bit weight format ("u12").

A bf16 weight is sign (1 bit), exponent (8) and mantissa (7). The exponent carries little
information in trained (or normally distributed) weights: 15 consecutive exponent values cover
nearly all of them. u12 stores each weight as

* ``sm``: one byte, ``sign << 7 | mantissa``;
* a 4-bit ``code``: ``c`` in 1..15 means exponent field ``base + c - 1``; ``c = 0`` is an escape;
  two codes per byte, the even column in the low nibble;

and every weight whose exponent falls outside the window ``[base, base + 14]`` goes to an exact
side table (flat index, bf16 bit pattern), its code and sign/mantissa byte set to 0. The base is per tensor, chosen to cover the most
weights, so the side table is as small as the data allows. Every bf16 bit pattern (±0,
subnormals, ±inf, NaN payloads) round-trips bit-exactly. Kernels read the table through two
views derived from it on the device, never stored: CSR row pointers (``esc_row_ptr``) and each
row's escapes in fixed lanes (``esc_lanes``), which the GEMVs load at addresses known up front.

Layout. The planes hold the weights row by row ("rows"), or, where N % 16 == 0 and K % 64 == 0,
in tiles ("tiles"): 16 rows by 16 words (64 weights) at a time, each row's 16 words (64 bytes of
``sm``, 32 of ``codes``) after the other's, tile after tile along K, then the next 16 rows. Word w
of row r (4 weights, the unit the kernels load) is then at word offset (r - r % 16) · K/4 + (w - w %
16) · 16 + (r % 16) · 16 + w % 16 (``tiled_word_offsets``). The tensor-core kernel reads a
warp's fragments from such a tile as contiguous runs (kernels/u12/hmma.py), and the other kernels
read 64-byte runs; one copy serves every kernel. The side table keeps row-major flat indices in
either layout, so the escapes do not depend on it.

Files are safetensors; the metadata holds each tensor's shape, base, layout and a sha256 over its
planes, checked on load.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WINDOW = 15  # exponent values a 4-bit code can name; code 0 is the escape
MAX_BASE = 255 - (WINDOW - 1)
FORMAT_VERSION = "1"
_PLANES = ("sm", "codes", "esc_idx", "esc_val")
MAX_LANES = 16  # escapes a row in U12Tensor.esc_lanes (N(0, 0.02) rows of 4096: 0.6 on average)
LAYOUTS = ("rows", "tiles")


def tiles_fit(shape: tuple[int, int]) -> bool:
    """Whether a weight of `shape` [N, K] can be tiled: N % 16 == 0 and K % 64 == 0."""
    return shape[0] % 16 == 0 and shape[1] % 64 == 0


def tiled_word_offsets(rows: torch.Tensor, words: torch.Tensor, k: int) -> torch.Tensor:
    """Word offsets of (row, word) pairs in tiled planes of K columns (K / 4 words a row)."""
    return (rows - rows % 16) * (k // 4) + (words - words % 16) * 16 + (rows % 16) * 16 + words % 16


@dataclass(frozen=True, eq=False)
class U12Tensor:
    """A 2-D bf16 tensor in u12 form.

    ``esc_idx`` holds the flat (row-major) indices of the escaped weights in ascending order
    (int32 when the tensor has fewer than 2**31 elements, else int64); ``esc_val`` their bf16
    bit patterns as int16. At escaped positions both ``codes`` and ``sm`` hold 0.
    """

    shape: tuple[int, int]
    base: int
    sm: torch.Tensor  # uint8 [N, K]
    codes: torch.Tensor  # uint8 [N, ceil(K / 2)]
    esc_idx: torch.Tensor  # int32 or int64 [E]
    esc_val: torch.Tensor  # int16 [E]
    layout: str = "rows"  # or "tiles" (the module docstring): the order of sm's and codes' words

    def __post_init__(self) -> None:
        n, k = self.shape
        expected = {
            "sm": (torch.uint8, (n, k)),
            "codes": (torch.uint8, (n, (k + 1) // 2)),
            "esc_val": (torch.int16, tuple(self.esc_idx.shape)),
        }
        for field, (dtype, shape) in expected.items():
            plane = getattr(self, field)
            if plane.dtype != dtype or tuple(plane.shape) != shape:
                raise ValueError(
                    f"U12Tensor.{field}: expected {dtype} {list(shape)}, "
                    f"got {plane.dtype} {list(plane.shape)}"
                )
        if self.esc_idx.dtype not in (torch.int32, torch.int64) or self.esc_idx.dim() != 1:
            raise ValueError(f"U12Tensor.esc_idx: expected 1-D int32/int64, got {self.esc_idx.dtype}")
        if not 0 <= self.base <= MAX_BASE:
            raise ValueError(f"U12Tensor.base: expected 0..{MAX_BASE}, got {self.base}")
        if self.layout not in LAYOUTS or (self.layout == "tiles" and not tiles_fit(self.shape)):
            raise ValueError(f"U12Tensor.layout: expected one of {LAYOUTS} ('tiles' needs N % 16 == 0 and "
                             f"K % 64 == 0), got {self.layout!r} at shape {list(self.shape)}")

    @property
    def device(self) -> torch.device:
        return self.sm.device

    @property
    def nbytes(self) -> int:
        """Bytes of the planes and the side table (what the weight costs to read and store)."""
        return sum(p.numel() * p.element_size() for p in (self.sm, self.codes, self.esc_idx, self.esc_val))

    @functools.cached_property
    def esc_row_ptr(self) -> torch.Tensor:
        """int32 [N + 1]: escapes of row n are ``esc_idx[ptr[n]:ptr[n + 1]]`` (CSR, derived, not stored).

        Kernels use it to find a row block's escapes without searching; computed once per tensor.
        """
        n, k = self.shape
        row_starts = torch.arange(n + 1, device=self.device, dtype=torch.int64) * k
        return torch.searchsorted(self.esc_idx.to(torch.int64), row_starts).to(torch.int32)

    @functools.cached_property
    def esc_lanes(self) -> torch.Tensor | None:
        """int32 [N, S]: row n's escapes in table order as ``column | bf16 bits << 16``, then empty
        lanes ``0xFFFF`` (column 65535, never < K); S the most escapes a row has, rounded up to a
        power of two (1 with none). None where a row has more than ``MAX_LANES`` or K > 65535: the
        kernels then walk the table (derived, not stored; one host sync, so first touch it outside
        a CUDA graph capture).

        A GEMV loads its rows' lanes at addresses it knows up front, in its accumulator's layout, so
        no load waits on another and the escapes fold into its own reduction (kernels/u12/escapes.py)."""
        n, k = self.shape
        counts = self.esc_row_ptr.diff()
        most = int(counts.max()) if n else 0
        if most > MAX_LANES or k > 0xFFFF:
            return None
        lanes = torch.full((n, 1 << max(0, most - 1).bit_length()), 0xFFFF, dtype=torch.int32, device=self.device)
        idx = self.esc_idx.to(torch.int64)
        rows = idx // k
        pos = torch.arange(idx.numel(), device=self.device) - self.esc_row_ptr.to(torch.int64)[rows]
        packed = (idx % k) | ((self.esc_val.to(torch.int64) & 0xFFFF) << 16)
        lanes[rows, pos] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        return lanes

    def with_layout(self, layout: str) -> U12Tensor:
        """This tensor with its planes in `layout` ("rows" or "tiles"; the same tensor where it is
        already): exact, the same base and side table; a new copy of the planes otherwise."""
        if layout == self.layout:
            return self
        if layout not in LAYOUTS or (layout == "tiles" and not tiles_fit(self.shape)):
            raise ValueError(f"U12Tensor.with_layout: expected one of {LAYOUTS} ('tiles' needs N % 16 == 0 and "
                             f"K % 64 == 0), got {layout!r} at shape {list(self.shape)}")
        n, k = self.shape
        # words of 4 weights (4 bytes of sm, 2 of codes) as [i, h, G, j] <-> [i, G, h, j]: i the 16-row
        # tile, h its row, G the 16-word group, j the word in the group
        tiled = (n // 16, k // 64, 16, 16)
        rows = (n // 16, 16, k // 64, 16)
        src, dst = (rows, tiled) if layout == "tiles" else (tiled, rows)

        def move(plane: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            words = plane.contiguous().view(dtype).view(src).permute(0, 2, 1, 3)
            return words.reshape(dst).contiguous().view(plane.dtype).view(plane.shape)

        return dataclasses.replace(self, sm=move(self.sm, torch.int32), codes=move(self.codes, torch.int16),
                                   layout=layout)

    def rows(self, start: int, stop: int) -> U12Tensor:
        """Rows [start, stop) as a U12Tensor whose planes view this one's (the escapes of those
        rows are re-indexed: a small new table). Exact: the same base and the same bits. Tiled, the
        rows of whole tiles are a view in the same layout; others a copy in rows."""
        n, k = self.shape
        if not 0 <= start <= stop <= n:
            raise ValueError(f"U12Tensor.rows: expected 0 <= start <= stop <= {n}, got {start}, {stop}")
        if self.layout == "tiles" and (start % 16 or stop % 16):  # not whole tiles: a row-planes copy
            return self.with_layout("rows").rows(start, stop)
        lo, hi = (int(v) for v in self.esc_row_ptr[[start, stop]])
        return U12Tensor((stop - start, k), self.base, self.sm[start:stop], self.codes[start:stop],
                         self.esc_idx[lo:hi] - start * k, self.esc_val[lo:hi], self.layout)

    def to(self, device: torch.device | str) -> U12Tensor:
        return dataclasses.replace(self, **{p: getattr(self, p).to(device) for p in _PLANES})


def _bf16_bits(w: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns of ``w`` as int32 in 0..65535."""
    return w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def best_base(exponents: torch.Tensor) -> int:
    """The base of the 15-exponent window holding the most of ``exponents`` (ties: the lowest)."""
    hist = torch.bincount(exponents.flatten().to(torch.int64), minlength=256)
    return int(hist.unfold(0, WINDOW, 1).sum(1).argmax())


def pack_u12(w: torch.Tensor, base: int | None = None, layout: str = "rows") -> U12Tensor:
    """Pack a 2-D bf16 tensor; ``base`` defaults to the window covering the most weights; ``layout``
    "tiles" where the shape allows it (``tiles_fit``), else rows."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"pack_u12: expected a 2-D bfloat16 tensor, got {w.dtype} {list(w.shape)}")
    n, k = w.shape
    bits = _bf16_bits(w)
    exponent = (bits >> 7) & 0xFF
    if base is None:
        base = best_base(exponent)
    code = exponent - (base - 1)
    in_window = (code >= 1) & (code <= WINDOW)
    code = torch.where(in_window, code, 0)

    # Escapes keep sign/mantissa 0 in the plane: with code 0 that decodes to +0.0 in the kernels.
    sm = torch.where(in_window, ((bits >> 8) & 0x80) | (bits & 0x7F), 0).to(torch.uint8)
    if k % 2:
        code = torch.nn.functional.pad(code, (0, 1))
    codes = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)

    index_dtype = torch.int32 if n * k < 2**31 else torch.int64
    esc_idx = torch.nonzero(~in_window.flatten()).flatten()
    esc_val = w.contiguous().view(torch.int16).flatten()[esc_idx]
    t = U12Tensor((n, k), base, sm, codes, esc_idx.to(index_dtype), esc_val)
    return t.with_layout(layout) if layout == "rows" or tiles_fit((n, k)) else t


def concat_u12(tensors: list[U12Tensor]) -> U12Tensor:
    """The tensors' rows stacked as one u12 tensor (same K), re-packed with the window that suits
    the whole: exact, like any packing; tiled where they all are (and the whole fits)."""
    widths = {t.shape[1] for t in tensors}
    if len(widths) != 1:
        raise ValueError(f"concat_u12: the tensors must share K, got {sorted(widths)}")
    layout = "tiles" if all(t.layout == "tiles" for t in tensors) else "rows"
    return pack_u12(torch.cat([unpack_u12(t) for t in tensors]), layout=layout)


def unpack_u12(t: U12Tensor) -> torch.Tensor:
    """The exact bf16 tensor that was packed."""
    t = t.with_layout("rows")
    n, k = t.shape
    sm = t.sm.to(torch.int32)
    codes = t.codes.to(torch.int32)
    code = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(n, 2 * codes.shape[1])[:, :k]
    bits = ((sm & 0x80) << 8) | ((code + (t.base - 1)) << 7) | (sm & 0x7F)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).flatten()
    bits[t.esc_idx.to(torch.int64)] = t.esc_val
    return bits.view(torch.bfloat16).reshape(n, k)


def u12_stats(w: torch.Tensor) -> dict[str, float | int]:
    """Cost and exponent statistics of ``w`` (2-D bf16) in u12 form.

    bits_per_weight counts the real bytes of both planes and the side table (what is stored);
    lanes is ``esc_lanes``' width (0: none, the GEMVs walk the table) and read_bits_per_weight what a
    GEMV reads: the planes and the lanes, or the table and its row pointers.
    """
    t = pack_u12(w)
    lanes = t.esc_lanes
    planes = t.sm.numel() + t.codes.numel()
    read = planes + (lanes.numel() * 4 if lanes is not None else t.nbytes - planes + t.esc_row_ptr.numel() * 4)
    exponent = (_bf16_bits(w) >> 7) & 0xFF
    hist = torch.bincount(exponent.flatten().to(torch.int64), minlength=256).double()
    p = hist[hist > 0] / hist.sum().clamp(min=1)
    numel = max(w.numel(), 1)
    return {
        "bits_per_weight": 8 * t.nbytes / numel,
        "lanes": 0 if lanes is None else lanes.shape[1],
        "read_bits_per_weight": 8 * read / numel,
        "escape_rate": t.esc_idx.numel() / numel,
        "escapes": t.esc_idx.numel(),
        "base": t.base,
        "distinct_exponents": int((hist > 0).sum()),
        "exponent_entropy_bits": float(-(p * p.log2()).sum()),
    }


def _checksum(t: U12Tensor) -> str:
    """sha256 over shape, base, layout (where not rows) and every plane's dtype and bytes."""
    tiled = {"layout": t.layout} if t.layout != "rows" else {}  # files written before layouts: rows
    h = hashlib.sha256(json.dumps({"shape": list(t.shape), "base": t.base, **tiled}).encode())
    for name in _PLANES:
        plane = getattr(t, name).detach().contiguous().cpu()
        h.update(f"{name}:{plane.dtype}:{plane.numel()}".encode())
        h.update(plane.view(torch.uint8).numpy().tobytes() if plane.numel() else b"")
    return h.hexdigest()


def save_u12(tensors: dict[str, U12Tensor], path: str | os.PathLike) -> None:
    """Write u12 tensors to one safetensors file, with shape, base and checksum in its metadata."""
    planes: dict[str, torch.Tensor] = {}
    meta: dict[str, dict] = {}
    for name, t in tensors.items():
        for plane in _PLANES:
            planes[f"{name}.{plane}"] = getattr(t, plane).detach().to("cpu", copy=True)  # views (rows) share storage
        meta[name] = {"shape": list(t.shape), "base": t.base, "layout": t.layout, "sha256": _checksum(t)}
    save_file(planes, os.fspath(path), metadata={"format": "u12", "version": FORMAT_VERSION, "u12": json.dumps(meta)})


def load_u12(path: str | os.PathLike, device: torch.device | str = "cpu") -> dict[str, U12Tensor]:
    """Read a file written by ``save_u12``; raises ValueError naming file and tensor on any mismatch."""
    path = os.fspath(path)
    with safe_open(path, framework="pt") as f:
        header = f.metadata() or {}
        if header.get("format") != "u12" or header.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: not a u12 file of version {FORMAT_VERSION} "
                f"(format={header.get('format')!r}, version={header.get('version')!r})"
            )
        meta = json.loads(header["u12"])
        out = {}
        for name, m in meta.items():
            try:
                planes = {p: f.get_tensor(f"{name}.{p}") for p in _PLANES}
                t = U12Tensor(tuple(m["shape"]), int(m["base"]), **planes, layout=m.get("layout", "rows"))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}: tensor {name!r}: malformed u12 entry: {e}") from e
            digest = _checksum(t)
            if digest != m["sha256"]:
                raise ValueError(
                    f"{path}: tensor {name!r}: checksum mismatch (stored {m['sha256'][:16]}…, "
                    f"computed {digest[:16]}…); the file is corrupt"
                )
            out[name] = t.to(device)
    return out
