"""The attention rewrite's safety checks: what must hold for a matched site to be replaced by its emission.

- `check_private`: every intermediate of the site dies with it (no user outside the site);
- `check_output`: the emission gives the attention output's shape and dtype;
- `check_reads`: the emission reads its inputs at the attention where HF read them earlier; no write in between
  reaches their memory (through views, slices, reshapes, aliased inputs: `_fx.first_write`).
What a mask means (a hard mask: its valid tokens, what an empty row gives) is proven by `attention_mask.prove_mask`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from ._fx import Builder, NoMatch, first_write, same, val

if TYPE_CHECKING:
    from .attention_emit import Memo
    from .attention_match import LatentSource, Site


def check_private(out: fx.Node, nodes: set) -> None:
    """Every node of the site but its output `out` is read only inside the site (it dies with the rewrite)."""
    for n in nodes:
        if n is out:
            continue
        extra = [u for u in n.users if u not in nodes]
        if extra:
            raise NoMatch(f"intermediate {n.name} is also used by {', '.join(u.name for u in extra)}")


def check_output(site: Site, out: fx.Node) -> None:
    """The emitted `out` has the attention output's shape [B, H, S, v] and dtype."""
    ov, nv = val(site.out), val(out)
    if (not same(tuple(ov.shape), (val(site.q).shape[0], site.heads, site.tokens, site.v_dim))
            or not same(tuple(nv.shape), tuple(ov.shape)) or ov.dtype != nv.dtype):
        raise NoMatch(f"rewritten output {tuple(nv.shape)} differs from attention's {tuple(ov.shape)}")


def check_reads(graph: fx.Graph, b: Builder, site: Site, src: LatentSource, memo: Memo) -> None:
    """The rewrite reads its inputs at the attention; HF read them earlier (kv_b_proj reads the latent and its
    weight, the K assembly the rope latent, the mask expression its inputs, a reused entry where it was emitted).
    No write in between may reach memory any of them lives in."""
    created = set(b.created)
    consumers = set(site.nodes) | (site.proof.nodes if site.proof is not None else set()) | {site.q}
    if site.sparse is not None:
        consumers |= site.sparse.nodes
    if src.kind != "tensor":
        consumers.add(site.latent.args[0])  # the cache's gather reads the pages and the block table
    order = {n: i for i, n in enumerate(graph.nodes)}
    reads = {}
    for r in {a for n in b.created for a in n.all_input_nodes if a not in created}:
        seen = [u for u in r.users if u in consumers]
        reads[r] = min(seen, key=order.__getitem__) if seen else r
    for key in b.memo_hits:
        anchor, entry_reads = memo.reads_of(key)
        if anchor is None:  # emitted by this site (reused within it): its reads are this site's own
            continue
        for r in entry_reads:
            if r not in reads or order[anchor] < order[reads[r]]:
                reads[r] = anchor
    hit = first_write(graph, reads, b.created[0])
    if hit is not None:
        writer, r = hit
        raise NoMatch(f"{writer.name} writes memory that {r.name} lives in after HF read it and before the "
                      f"attention (what the rewrite would read there differs)")
