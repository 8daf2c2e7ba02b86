"""User-facing DCP helpers: set up a decode-context-parallel process group and a sharded paged latent cache.

    from mla_compile.distributed import init_dcp, DCPCache
    grp = init_dcp()                                   # under torchrun: NCCL on CUDA, gloo on CPU
    cache = DCPCache.allocate(grp, batch_size=8, max_len=131072, dtype=torch.bfloat16)
    cache.write_prefill(b, ckv_b, kpe_b)               # every rank passes the same tokens; owners write
    cache.write_decode(ckv_new, kpe_new)               # one new token per request (CUDA-graph safe)
    out, lse = cache.decode(q_nope, q_pe, sm_scale)    # mla::dcp_decode: same result on every rank

Token t of a request lives on rank t % n at local position t // n (`mla_compile.layout`); a rank holds
ceil(max_len / n) tokens per request, so KV capacity grows n-fold.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from . import layout, ops  # noqa: F401  (registers torch.ops.mla.*)
from .ops import dcp as _dcp

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


@dataclasses.dataclass(frozen=True)
class DCPGroup:
    """This process's place in a DCP group: what `mla::dcp_decode` needs (size, rank, group_name)."""

    size: int
    rank: int
    group_name: str
    device: torch.device
    # TP x DCP (`init_dcp(tp_size=...)`): attention heads split over tp_size * size ranks, this DCP group being one
    # TP rank's block of them; heads_sharded False: pure DCP (every rank computes every head)
    tp_size: int = 1
    tp_rank: int = 0
    heads_sharded: bool = False
    head_group_name: str = ""  # the tp_size * size ranks whose heads o_proj's partial sums add up

    # The process groups are looked up by name, not held: a reference held here kept a destroyed group (and its
    # gloo threads) alive until interpreter teardown, where destroying it could abort the process.
    @property
    def group(self):
        """The DCP group's torch.distributed ProcessGroup (None for a single-process "group")."""
        return _lookup(self.group_name)

    @property
    def head_group(self):
        """TP x DCP: the head group's ProcessGroup (None without one)."""
        return _lookup(self.head_group_name)

    @property
    def head_shards(self) -> int:
        """How many ranks split the attention heads (1: replicated heads)."""
        return self.tp_size * self.size if self.heads_sharded else 1

    @property
    def head_rank(self) -> int:
        """This rank's head block: heads [head_rank * H / head_shards, (head_rank + 1) * H / head_shards)."""
        return self.tp_rank * self.size + self.rank if self.heads_sharded else 0

    @classmethod
    def single(cls, device="cpu") -> "DCPGroup":
        """dcp_size 1: no process group at all (`dcp_decode` is then plain `decode`)."""
        return cls(1, 0, "", torch.device(device))


def _lookup(group_name: str):
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)  # raises naming the group once it is destroyed


def init_dcp(backend: str | None = None, timeout: datetime.timedelta | float | None = None,
             dcp_size: int | None = None, device: str | torch.device | None = None,
             tp_size: int | None = None) -> DCPGroup:
    """Join (or reuse) torch.distributed and return this rank's DCP group.

    Without an initialized default group it calls `init_process_group` from torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): `backend` defaults to "nccl" when CUDA is available
    (device cuda:LOCAL_RANK, set as current) and "gloo" otherwise. `timeout` (timedelta or seconds; default
    DEFAULT_TIMEOUT) bounds every collective of the DCP group: a dead or failing peer turns into an error on
    every rank instead of a hang. With a default group already initialized, timeout=None reuses it (with
    its own timeout), while a given timeout gets a DCP group of its own with that timeout (a process group's
    timeout cannot be read back to compare, and changing the default group's would change the caller's
    other collectives). `dcp_size` (default: the world) splits the world into consecutive groups of that
    many ranks. Making a group is collective over all ranks: every rank must call this with the same
    dcp_size and timeout. Single process without torchrun: a size-1 group.

    TP x DCP: `tp_size` (None: pure DCP, heads replicated) splits the attention heads over tp_size * dcp_size
    ranks: consecutive blocks of that many ranks (the world by default) form a head group, whose consecutive
    dcp_size ranks form the DCP groups. World rank g of a block is TP rank g // dcp_size and DCP rank
    g % dcp_size and owns head block g (of tp_size * dcp_size). Each DCP group holds the KV cache once
    (token-cyclic) for its TP rank's heads, which `mla::tp_dcp_decode` splits further over the DCP ranks; o_proj's
    partial sums add up over the head group. tp_size 1 is heads split over the DCP group alone (vLLM's tp == dcp).
    Shard the model with `mla_compile.integrations.tp.shard_mla_heads(model, group)`.
    """
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout is not None and not timeout.total_seconds() > 0:
        raise ValueError(f"timeout: must be positive, got {timeout}")
    own_default = False  # we made the default group here, with the caller's timeout
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            if dcp_size not in (None, 1) or tp_size not in (None, 1):
                raise ValueError(f"dcp_size: {dcp_size} x tp_size {tp_size} needs torch.distributed (launch with "
                                 f"torchrun)")
            one = DCPGroup.single(device or "cpu")
            return one if tp_size is None else dataclasses.replace(one, heads_sharded=True)  # TP 1 x DCP 1
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        kwargs = {}
        if backend == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)  # eager NCCL communicator init
        dist.init_process_group(backend, init_method="env://", timeout=timeout or DEFAULT_TIMEOUT, **kwargs)
        own_default = True
    world = dist.get_world_size()
    if tp_size is not None:
        return _init_tp_dcp(world, tp_size, dcp_size, timeout, own_default, device)
    device = _default_device(device)
    n = world if dcp_size is None else dcp_size
    if not (isinstance(n, int) and n >= 1 and world % n == 0):
        raise ValueError(f"dcp_size: must be a positive divisor of the world size {world}, got {dcp_size!r}")
    if n == world and (own_default or timeout is None):
        group = dist.group.WORLD
    elif n == world:
        group = dist.new_group(ranks=list(range(world)), timeout=timeout)
    else:
        group, _ = dist.new_subgroups(group_size=n, timeout=timeout or DEFAULT_TIMEOUT)
    return DCPGroup(n, dist.get_rank(group), group.group_name, device)


def _default_device(device):
    if device is not None:
        return torch.device(device)
    be = dist.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(be) else torch.device("cpu")


def _init_tp_dcp(world: int, tp_size, dcp_size, timeout, own_default: bool, device) -> DCPGroup:
    """The head group (tp_size * dcp_size ranks) and the DCP group inside it (`init_dcp`'s docstring)."""
    d = world if dcp_size is None else dcp_size
    if not (isinstance(tp_size, int) and not isinstance(tp_size, bool) and tp_size >= 1):
        raise ValueError(f"tp_size: must be an int >= 1, got {tp_size!r}")
    if not (isinstance(d, int) and not isinstance(d, bool) and d >= 1 and world % (tp_size * d) == 0):
        raise ValueError(f"dcp_size: tp_size {tp_size} x dcp_size {dcp_size!r} must divide the world size {world}")
    device = _default_device(device)
    heads = tp_size * d

    def sub(size):
        if size == world and (own_default or timeout is None):
            return dist.group.WORLD
        if size == world:
            return dist.new_group(ranks=list(range(world)), timeout=timeout)
        return dist.new_subgroups(group_size=size, timeout=timeout or DEFAULT_TIMEOUT)[0]

    head_group = sub(heads)
    group = sub(d)
    g = dist.get_rank(head_group)
    return DCPGroup(d, dist.get_rank(group), group.group_name, device, tp_size=tp_size, tp_rank=g // d,
                    heads_sharded=True, head_group_name=head_group.group_name)


@dataclasses.dataclass
class DCPCache:
    """This rank's shard of a paged latent cache for `batch_size` requests of up to `max_len` tokens.

    Each request gets ceil(ceil(max_len / n) / page_size) private pages (block_table row b). `seq_lens` are
    the GLOBAL lengths (int32, on the cache's device), kept identical on every rank by the write methods;
    `lens` is a host mirror (no device sync needed to plan a prefill).
    """

    ckv_cache: torch.Tensor  # [NP, PS, R]
    kpe_cache: torch.Tensor  # [NP, PS, P]
    block_table: torch.Tensor  # int32 [B, MP], this rank's pages
    seq_lens: torch.Tensor  # int32 [B], GLOBAL lengths
    max_len: int
    dcp_size: int = 1
    dcp_rank: int = 0
    group_name: str = ""
    lens: list = dataclasses.field(default_factory=list)

    @classmethod
    def allocate(cls, group: DCPGroup | None, batch_size: int, max_len: int, kv_lora_rank: int = 512,
                 rope_dim: int = 64, page_size: int = 64, dtype: torch.dtype = torch.bfloat16, device=None,
                 fill: float = 0.0) -> "DCPCache":
        group = group or DCPGroup.single(device or "cpu")
        device = torch.device(device) if device is not None else group.device
        for name, v in dict(batch_size=batch_size, max_len=max_len, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                            page_size=page_size).items():
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"{name}: must be a positive int, got {v!r}")
        per_rank = layout.local_capacity(max_len, group.size)  # ceil(max_len / n) tokens per request
        pages = max(1, -(-per_rank // page_size))
        block_table = torch.arange(batch_size * pages, dtype=torch.int32, device=device).view(batch_size, pages)
        ckv = torch.full((batch_size * pages, page_size, kv_lora_rank), fill, dtype=dtype, device=device)
        kpe = torch.full((batch_size * pages, page_size, rope_dim), fill, dtype=dtype, device=device)
        seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        return cls(ckv, kpe, block_table, seq_lens, max_len, group.size, group.rank, group.group_name,
                   [0] * batch_size)

    @property
    def page_size(self) -> int:
        return self.ckv_cache.shape[1]

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    def write_prefill(self, req: int, ckv: torch.Tensor, kpe: torch.Tensor) -> None:
        """Append a prefill chunk (ckv [T,R], kpe [T,P], the same on every rank) to request `req`: tokens
        go to global positions lens[req] .. lens[req]+T-1; each rank writes only the ones it owns."""
        if not (isinstance(req, int) and 0 <= req < self.batch_size):
            raise ValueError(f"req: must be an int in [0, {self.batch_size}), got {req!r}")
        T, start = ckv.shape[0], self.lens[req]
        if start + T > self.max_len:
            raise ValueError(f"ckv: {T} tokens after {start} exceed max_len {self.max_len} of request {req}")
        slots = _dcp.prefill_write_slots(self.block_table, req, start, T, self.page_size, self.dcp_size,
                                         self.dcp_rank)
        torch.ops.mla.cache_write(self.ckv_cache, self.kpe_cache, ckv, kpe, slots)
        self.seq_lens[req] += T
        self.lens[req] += T

    def write_decode(self, ckv: torch.Tensor, kpe: torch.Tensor) -> None:
        """A decode step's new token of every request (ckv [B,R], kpe [B,P], the same on every rank): goes to
        global position seq_lens[b], owned by rank seq_lens[b] % n; then seq_lens += 1. No host sync: can be
        captured in a CUDA graph together with `decode` (the host mirror `lens` is advanced by Python)."""
        if any(n + 1 > self.max_len for n in self.lens):
            raise ValueError(f"ckv: a request is already at max_len {self.max_len}")
        slots = _dcp.decode_write_slots(self.block_table, self.seq_lens, self.page_size, self.dcp_size,
                                        self.dcp_rank)
        torch.ops.mla.cache_write(self.ckv_cache, self.kpe_cache, ckv, kpe, slots)
        self.seq_lens.add_(1)
        self.lens = [n + 1 for n in self.lens]

    def local_lens(self) -> torch.Tensor:
        """Tokens of each request held by this rank (int32 [B])."""
        return layout.local_lens(self.seq_lens, self.dcp_size, self.dcp_rank)

    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, sm_scale: float):
        """`mla::dcp_decode` over the whole (all ranks') cache: (out [B,H,R], lse float32 [B,H])."""
        return torch.ops.mla.dcp_decode(q_nope, q_pe, self.ckv_cache, self.kpe_cache, self.block_table,
                                        self.seq_lens, sm_scale, self.dcp_size, self.dcp_rank, self.group_name)
