"""Cross-rank consistency of the DCP decode ops: the ranks of a group agree on every call, or every rank fails.

A DCP call is correct only if every rank takes part in the SAME call: the same shapes (else the collective's
sizes differ: gloo aborts the process, NCCL hangs or reads garbage), the same GLOBAL seq_lens (else the ranks
merge attention states of different requests) and no rank leaving before the collective (else its NEXT call
pairs with its peers' current one). Three mechanisms, with no collective or host sync added to a steady
decode step:

1. The trailer. Each rank's chunk of the call's first all-gather (`mla::dcp_decode`: the packed (out, lse);
   `mla::tp_dcp_decode`: the packed q) ends with its seq_lens (int32 [B]) and a header (int32 [HEADER_WORDS]:
   message kind, then the call's signature: op, dcp_size, B, H, R, P, dtype, sm_scale, check_lens, S, the
   lengths' form), bit-cast into the payload's dtype: 4 * (B + 14) bytes per rank. With S query tokens per
   request H is the folded S * H head rows, so S has its own field: (S 2, H 16) and (S 1, H 32) gather the same
   bytes but are different calls. Per-query-token limits [B, S] travel as B * S words. After the gather every rank holds every rank's
   trailer and computes the same verdict from it. Where checks already read values (eager CPU; CUDA with
   MLA_COMPILE_CHECK_DATA=1) a disagreement is a ValueError on every rank, naming the argument; elsewhere
   (eager CUDA, torch.compile, CUDA graphs: no host sync) the requests whose lengths disagree come out NaN
   (out and lse), and every request does when the headers disagree.
2. The signature exchange (eager only). A rank whose call signature differs from the one its group last
   agreed on first all-gathers its signature. So that this can never pair with a peer's ordinary gather of
   a different size, every message a rank sends as a call's FIRST collective has the size of the agreed
   signature's first collective (its payload zeroed): the peers tell the kinds apart by the header.
   Shapes that changed together on every rank cost one extra gather at the change, never per step.
3. Rejection (eager only). A rank whose checks or local decode fail before the call's next collective still
   sends its part of it, as a REJECT message naming the failing argument, then raises: its peers raise a
   ValueError naming the same argument in the same call, and the next well-formed call pairs correctly.

Not covered: a rank that skips a call OUTSIDE these ops and then makes a call with identical lengths and
shapes (e.g. a different layer of the same step) pairs undetected; and torch.compile / CUDA graphs do no
exchange, so under them a shape mismatch that changes the gather's size still fails inside the backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import weakref

import torch

from . import _checks as C

MAGIC = 0x4D4C4100  # "MLA\0" + kind: a chunk whose header does not start with it is no message of ours
DATA, EXCHANGE, REJECT = 1, 2, 3
WILDCARD = -(2**31)  # a field unknown when tracing (a symbolic size): matches anything
OP_DCP, OP_TP, OP_DSA = 1, 2, 3
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# the signature's fields, in header order: (name, argument a disagreement is blamed on, what it is)
_FIELDS = (
    ("op", "group_name", "the DCP op (1: dcp_decode, 2: tp_dcp_decode, 3: dcp_indexer_topk)"),
    ("dcp_size", "dcp_size", "dcp_size"),
    ("batch", "q_nope", "the batch size (q_nope.shape[0])"),
    ("heads", "q_nope", "the query heads per rank (q_nope.shape[1])"),
    ("R", "q_nope", "kv_lora_rank (q_nope.shape[2])"),
    ("P", "q_pe", "the rope dim (q_pe.shape[2])"),
    ("dtype", "q_nope", "the query dtype"),
    ("scale_lo", "sm_scale", "sm_scale"),
    ("scale_hi", "sm_scale", "sm_scale"),
    ("check_lens", "check_lens", "check_lens"),
    ("tokens", "q_nope", "the query tokens per request S"),
    ("limits", "seq_lens", "the seq_lens form (0: lengths [B], 1: per-query-token limits [B, S])"),
)
# the same words of a `dsa::dcp_indexer_topk` call (q [B, Hi, Di], topk in P's place)
_INDEXER_FIELDS = {"batch": ("q", "the batch size (q.shape[0])"), "heads": ("q", "the index heads (q.shape[1])"),
                   "R": ("q", "the index head dim (q.shape[2])"), "P": ("topk", "topk"), "dtype": ("q", "q's dtype")}
HEADER_WORDS = 2 + len(_FIELDS)  # kind, rejected argument, fields
ARG_NAMES = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_table", "seq_lens", "sm_scale", "dcp_size",
             "dcp_rank", "group_name", "check_lens", "q", "weights", "k_cache", "topk")


# ------------------------------------------------------------------------------------------------ signature
@dataclasses.dataclass(frozen=True)
class Signature:
    """What every rank of a call must agree on (sizes may be SymInts when traced)."""

    op: int
    dcp_size: int
    batch: int
    heads: int
    R: int
    P: int
    dtype: torch.dtype
    sm_scale: float
    check_lens: bool
    tokens: int = 1  # query tokens per request S (heads is then the folded S * H rows)
    limits: bool = False  # seq_lens are per-query-token limits [B, S] (B * S trailer words), else lengths [B]

    @classmethod
    def of(cls, op: int, q_nope, q_pe, sm_scale, dcp_size: int, check_lens: bool, tokens: int = 1,
           limits: bool = False) -> "Signature":
        B, H, R = q_nope.shape
        return cls(op, dcp_size, B, H, R, q_pe.shape[2], q_nope.dtype, float(sm_scale), check_lens, tokens, limits)

    def fields(self) -> list[int]:
        lo, hi = struct.unpack("<ii", struct.pack("<d", self.sm_scale))
        code = _DTYPES.index(self.dtype) + 1 if self.dtype in _DTYPES else 0
        vals = (self.op, self.dcp_size, self.batch, self.heads, self.R, self.P, code, lo, hi, int(self.check_lens),
                self.tokens, int(self.limits))
        return [v if isinstance(v, int) else WILDCARD for v in vals]

    @property
    def lens_words(self):
        """int32 words of seq_lens in the trailer: B, or B * S for per-query-token limits."""
        return self.batch * self.tokens if self.limits else self.batch

    def payload_dtype(self) -> torch.dtype:
        """The dtype of this call's first collective (the indexer's candidate keys travel as int32 words)."""
        return torch.int32 if self.op == OP_DSA else self.dtype

    def payload_numel(self) -> int:
        """Elements (of `dtype`) in this call's first collective before the trailer."""
        if self.op == OP_DCP:  # (out, lse) packed: R + k columns per head, k = 4 / element size
            return self.batch * self.heads * (self.R + 4 // self.dtype.itemsize)
        if self.op == OP_DSA:  # dsa::dcp_indexer_topk: topk int64 candidate keys per request, as int32 pairs
            return self.batch * 2 * self.P
        return self.batch * self.heads * (self.R + self.P)  # q_nope and q_pe packed


def _header(kind: int, fields: list[int], argcode: int = 0) -> list[int]:
    return [MAGIC + kind, argcode, *fields]


_HEADERS: dict = {}  # (words, device) -> int32 tensor: made once, outside any CUDA graph capture


def data_header(sig: Signature, like: torch.Tensor) -> torch.Tensor:
    """The DATA header (int32 [HEADER_WORDS]) of a call with signature `sig`, on like's device.

    Real tensors are cached: a header made during a CUDA graph capture would be a host-to-device copy there,
    so the eager warm-up every capture needs makes it."""
    words = tuple(_header(DATA, sig.fields()))
    if C.is_fake(like):
        return torch.tensor(words, dtype=torch.int32, device=like.device)
    key = (words, like.device)
    if key not in _HEADERS:
        _HEADERS[key] = torch.tensor(words, dtype=torch.int32, device=like.device)
    return _HEADERS[key]


def trailer(seq_lens: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
    """int32 [W + HEADER_WORDS]: this rank's GLOBAL lengths (W = B) or per-query-token limits (W = B * S,
    row-major), then the header."""
    return torch.cat([seq_lens.reshape(-1).to(torch.int32), header])


# ------------------------------------------------------------------------------------------------ the gather
def pack_chunk(payload: torch.Tensor, trail: torch.Tensor) -> torch.Tensor:
    """One rank's chunk of the gather: payload flattened, then the int32 trail bit-cast into payload's dtype."""
    return torch.cat([payload.reshape(-1), trail.view(payload.dtype)])


def unpack_chunks(gathered: torch.Tensor, payload_shape, trail_words: int):
    """Every rank's chunk ([n, N] in the payload's dtype) -> (payloads [n, *payload_shape], trails int32
    [n, trail_words]); both views of `gathered` when the trail starts 4-byte aligned (no copy kernel)."""
    k = 4 // gathered.dtype.itemsize  # elements per int32 word
    X = gathered.shape[1] - trail_words * k
    tail = gathered[:, X:]
    trails = (tail if X % k == 0 else tail.contiguous()).view(torch.int32)
    return gathered[:, :X].view(gathered.shape[0], *payload_shape), trails


def gather_with_trailer(payload: torch.Tensor, trail: torch.Tensor, dcp_size: int, group_name: str):
    """ONE all-gather of (payload, int32 trail [W]) per rank -> (payloads [n, *payload.shape], trails int32
    [n, W]), rank order."""
    chunk = pack_chunk(payload, trail)
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(chunk, dcp_size, group_name)
    gathered = torch.ops._c10d_functional.wait_tensor(gathered).view(dcp_size, chunk.shape[0])
    return unpack_chunks(gathered, payload.shape, trail.shape[0])


def rows_ok(trails: torch.Tensor, header: torch.Tensor, batch: int, check_lens: bool,
            lens_words: int | None = None) -> torch.Tensor:
    """bool [B], the same on every rank: request b may be merged (every rank sent DATA with the same
    signature and, with check_lens, the same seq_lens[b]: all its words, B * S of them for per-query-token
    limits). Device ops only: no host sync."""
    words = batch if lens_words is None else lens_words
    lens, headers = trails[:, :words], trails[:, words:]
    same = ((headers == header) | (headers == WILDCARD) | (header == WILDCARD)).all()
    if not check_lens:
        return same.expand(batch)
    agree = (lens == lens[:1]).all(0)
    return agree.view(batch, -1).all(1) & same


def poison(out: torch.Tensor, lse: torch.Tensor, ok: torch.Tensor | None):
    """NaN out and lse in the rows of requests that may not be merged (`rows_ok` False); ok None: as they are."""
    if ok is None:
        return out, lse
    bad = ~ok
    return out.masked_fill(bad[:, None, None], float("nan")), lse.masked_fill(bad[:, None], float("nan"))


# ------------------------------------------------------------------------------------------------ verdicts
_SCALE = [f[0] for f in _FIELDS].index("scale_lo")  # sm_scale's float64 bits: words _SCALE (low), _SCALE + 1


def _field_text(i: int, value: int, header: list[int]) -> str:
    name = _FIELDS[i][0]
    if name == "dtype":
        return str(_DTYPES[value - 1]) if 1 <= value <= len(_DTYPES) else "?"
    if name.startswith("scale"):
        return repr(struct.unpack("<d", struct.pack("<ii", header[2 + _SCALE], header[3 + _SCALE]))[0])
    if name == "check_lens":
        return str(bool(value))
    return str(value)


def check_headers(headers: list[list[int]], group_name: str) -> None:
    """Raise the same error on every rank unless every rank sent the same kind of message with the same
    signature (headers: every rank's header, rank order, as host ints)."""
    n = len(headers)
    for r, h in enumerate(headers):
        if h[0] - MAGIC not in (DATA, EXCHANGE, REJECT):
            raise ValueError(
                f"group_name: dcp rank {r} of group {group_name!r} sent something that is not a DCP decode message: "
                f"the ranks' collectives on this group are out of step (a rank skipped or added a collective)")
    rejected = [r for r, h in enumerate(headers) if h[0] - MAGIC == REJECT]
    if rejected:
        r, code = rejected[0], headers[rejected[0]][1]
        arg = ARG_NAMES[code - 1] if 1 <= code <= len(ARG_NAMES) else None
        what = f"its check of {arg} failed" if arg else "it failed before its collective"
        msg = (f"dcp rank {r} of {n} (group {group_name!r}) rejected this call ({what}; that rank raised the "
               f"details), so every rank fails it")
        raise ValueError(f"{arg}: {msg}") if arg else RuntimeError(msg)
    indexer = headers[0][2] == OP_DSA
    for i, (name, arg, what) in enumerate(_FIELDS):
        if indexer and name in _INDEXER_FIELDS:  # dsa::dcp_indexer_topk's fields hold its own arguments
            arg, what = _INDEXER_FIELDS[name]
        values = [h[2 + i] for h in headers]
        if len({v for v in values if v != WILDCARD}) > 1:
            per_rank = ", ".join(f"rank {r}: {_field_text(i, v, headers[r])}" for r, v in enumerate(values))
            raise ValueError(f"{arg}: the ranks of dcp group {group_name!r} disagree on {what} ({per_rank}); "
                             f"every rank must make the same call")
    if len({h[0] for h in headers}) > 1:
        raise ValueError(f"group_name: the ranks of dcp group {group_name!r} are out of step (some exchange a "
                         f"new signature, some gather data, with the same signature)")


def check_lens(lens: list[list[int]], group_name: str) -> None:
    """Raise the same ValueError on every rank unless every rank passed the same GLOBAL seq_lens."""
    bad = [b for b in range(len(lens[0])) if len({row[b] for row in lens}) > 1]
    if bad:
        shown = bad[:8]
        per_rank = "; ".join(f"rank {r}: {[row[b] for b in shown]}" for r, row in enumerate(lens))
        raise ValueError(
            f"seq_lens: the ranks of dcp group {group_name!r} disagree on the GLOBAL lengths of request(s) "
            f"{shown}{' ...' if len(bad) > len(shown) else ''} ({per_rank}); every rank must pass the same global "
            f"seq_lens (merging them would mix different requests)")


# ------------------------------------------------------------------------------------------------ eager calls
@dataclasses.dataclass
class _Group:
    # weak: a strong reference here kept a destroyed group's gloo threads alive until interpreter teardown, where
    # destroying them aborted the process ('terminate called without an active exception')
    pg: weakref.ref
    agreed: Signature | None = None  # the signature the group's last agreed eager call had


_GROUPS: dict[str, _Group] = {}


def _eager(t: torch.Tensor) -> bool:
    """A call that can talk to its peers from Python now (not traced, not inside a CUDA graph capture)."""
    if torch.compiler.is_compiling() or C.is_fake(t):
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


class EagerCall:
    """One eager call's side of the protocol on its group (see the module docstring)."""

    def __init__(self, group: _Group, pg, group_name: str, device: torch.device):
        self.group, self.group_name, self.device = group, group_name, device
        self.n = pg.size()
        self.pending = True  # this rank still owes its peers the call's next collective
        self.raises = C.data_checks_enabled(device)  # host verdicts where checks already read values

    @classmethod
    def begin(cls, group_name, dcp_size, *args) -> "EagerCall | None":
        """The protocol of an eager call with dcp_size > 1 on a group this process can resolve, else None
        (traced or captured calls; a group that cannot be named fails its checks on this rank alone)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not (isinstance(dcp_size, int) and dcp_size > 1 and isinstance(group_name, str) and group_name
                and tensors and _eager(tensors[0])):
            return None
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            pg = _resolve_process_group(group_name)
        except Exception:  # noqa: BLE001 - the checks raise the group_name error
            return None
        group = _GROUPS.get(group_name)
        if group is None or group.pg() is not pg:  # a new group under a reused name starts afresh
            group = _GROUPS[group_name] = _Group(weakref.ref(pg))
        return cls(group, pg, group_name, tensors[0].device)

    def _send(self, kind: int, fields: list[int], argcode: int = 0) -> list[list[int]]:
        """A first-collective message of this call sized like the agreed signature's; every rank's header."""
        self.pending = False
        agreed = self.group.agreed
        words = _header(kind, fields, argcode)
        if agreed is None:  # the group's first eager call: header-only messages on every rank
            payload, batch = torch.empty(0, dtype=torch.int32, device=self.device), 0
        else:
            payload = torch.zeros(agreed.payload_numel(), dtype=agreed.payload_dtype(), device=self.device)
            batch = agreed.lens_words
        trail = torch.tensor([0] * batch + words, dtype=torch.int32, device=self.device)
        _, trails = gather_with_trailer(payload, trail, self.n, self.group_name)
        return [row[batch:] for row in trails.cpu().tolist()]

    def agree(self, sig: Signature) -> None:
        """Exchange `sig` with the peers unless it is the one the group agreed on last (no collective)."""
        if sig == self.group.agreed:
            return
        check_headers(self._send(EXCHANGE, sig.fields()), self.group_name)
        self.group.agreed = sig
        self.pending = True  # the call's data collective is next

    def reject(self, error: BaseException) -> None:
        """Send REJECT (naming error's argument) as this rank's part of the call's next collective."""
        name = str(error).split(":", 1)[0] if isinstance(error, ValueError) else ""
        code = ARG_NAMES.index(name) + 1 if name in ARG_NAMES else 0
        self._send(REJECT, [0] * len(_FIELDS), code)

    def check(self, trails: torch.Tensor, sig: Signature) -> None:
        """Host verdict on the call's data gather: the same ValueError on every rank, or nothing."""
        rows = trails.cpu().tolist()
        W, per = sig.lens_words, sig.lens_words // max(sig.batch, 1)
        check_headers([row[W:] for row in rows], self.group_name)
        if sig.check_lens:  # per request: its length, or its S limits
            check_lens([[tuple(row[b * per:(b + 1) * per]) if per > 1 else row[b] for b in range(sig.batch)]
                        for row in rows], self.group_name)


def signature(call: EagerCall | None, op: int, q_nope, q_pe, sm_scale, dcp_size: int, check_lens: bool,
              tokens: int = 1, lens: torch.Tensor | None = None) -> Signature:
    """The call's signature, agreed with the peers first when the call is eager (`EagerCall.agree`). q_nope /
    q_pe are [B, rows, *] (S query tokens folded into the rows: `tokens` = S); lens: the call's seq_lens (2-D:
    per-query-token limits)."""
    limits = lens is not None and lens.dim() == 2
    sig = Signature.of(op, q_nope, q_pe, sm_scale, dcp_size, check_lens, tokens, limits)
    if call is not None:
        call.agree(sig)
    return sig


def verdict(call: EagerCall | None, trails: torch.Tensor, header: torch.Tensor, sig: Signature):
    """After the call's first gather: the host verdict where it may sync (raises the same ValueError on every
    rank, else None), otherwise the device one (`rows_ok`, for `poison`)."""
    if call is not None and call.raises:
        call.check(trails, sig)
        return None
    return rows_ok(trails, header, sig.batch, sig.check_lens, sig.lens_words)


@contextlib.contextmanager
def dcp_call(group_name, dcp_size, *tensors):
    """`with dcp_call(...) as call:` around a call's work before its collective: call is its `EagerCall`
    (None when traced, captured or dcp_size 1); on an exception inside, the peers are told (REJECT) and the
    exception goes on."""
    call = EagerCall.begin(group_name, dcp_size, *tensors)
    if call is None:
        yield None
        return
    try:
        yield call
    except Exception as e:
        if call.pending:
            try:
                call.reject(e)
            except Exception as told:  # noqa: BLE001 - the group is gone: the original error is the one to see
                e.add_note(f"(telling the other dcp ranks failed too: {told})")
        raise
