"""FX node helpers shared by the passes: argument lookup, example values, shapes (static, or with a symbolic
batch), node predicates (`is_fn`, `is_call`, `is_op`), writes and aliasing (`written_by`, `is_pure`,
`first_write`), dead-code removal (`erase_dead`), the "no match" errors, the `Builder` that inserts nodes with
their example values (`b.call`, or eager ATen code through `b.aten`), and the end of an edit (`finish_edits`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, guard_int, statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

# An additive mask value at or below this gives exactly zero probability in a softmax next to any finite score far
# below 1e30 in magnitude (exp(-1e30) underflows in every float dtype), and such a score added to it rounds back to
# it (|s| below half its ulp: 3.8e22 in float32, 7e13 in float64), so a row masked everywhere by one value is flat.
BIG_NEGATIVE = -1e30


class NoMatch(Exception):
    """A site that looks like the pattern but cannot be rewritten; the message says why."""


class DynamicShape(NoMatch):
    """A site left alone because a dimension other than the batch is symbolic (Dynamo's dynamic shapes)."""


def arg(node: fx.Node, i: int, name: str, default=None):
    """Argument `i` (positional) or `name` (keyword) of a call node."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def meta_val(node):
    """The example value Dynamo recorded for a node (None if it has none); non-nodes are returned as they are."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def as_int(d):
    """A size as an int where it is one: an int, or a SymInt the shape environment has specialized to a constant
    (`specialize_site`); any other SymInt as it is."""
    if isinstance(d, torch.SymInt):
        value = d.node.maybe_as_int()
        return d if value is None else value
    return d


def static_shape(node, error: type[Exception] = NoMatch) -> tuple:
    """The node's tensor shape as ints; raises `error` for a non-tensor or a symbolic shape."""
    v = meta_val(node)
    name = getattr(node, "name", node)
    if not isinstance(v, torch.Tensor):
        raise error(f"node {name} is not a tensor")
    shape = tuple(map(as_int, v.shape))
    if not all(isinstance(s, int) for s in shape):
        raise error(f"node {name} has symbolic shape {shape} (dynamic shapes are not rewritten)")
    return shape


def batch_shape(node, error: type[Exception] = NoMatch) -> tuple:
    """The node's tensor shape: ints, except that dim 0 (the batch, or a page pool sized by it) may be a SymInt.
    Raises `error` for a non-tensor and `DynamicShape` for any other symbolic dim."""
    v = meta_val(node)
    name = getattr(node, "name", node)
    if not isinstance(v, torch.Tensor):
        raise error(f"node {name} is not a tensor")
    shape = tuple(map(as_int, v.shape))
    if not all(isinstance(s, int) for s in shape[1:]):
        raise DynamicShape(f"node {name} has symbolic shape {shape}: only a symbolic batch (dim 0) is rewritten")
    return shape


_CATS = {torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default}


def specialize_site(node: fx.Node, max_query_tokens: int) -> list:
    """Make the sizes of an attention site's inputs static, other than its batch, where that is what a decode step
    wants: Dynamo's automatic dynamic shapes turn a size that changed between calls into a symbol (a new static
    cache of another length; another number of query tokens), and the rewrite takes only a symbolic batch. Each such
    symbol is specialized to the size of this call (a guard: later calls of other sizes compile their own graph, as
    under dynamic=False), unless the site is no decode step: more than `max_query_tokens` query tokens (a prefill,
    left to HF attention), or a key length that grows by concatenation (HF's DynamicCache: the past length plus the
    new tokens, a new size every step: specializing it would compile a graph per step). Returns the symbols
    specialized (none: the site is left as it is)."""
    out = meta_val(node)
    if not (isinstance(out, torch.Tensor) and out.dim() == 4):
        return []
    tokens = as_int(out.shape[2])
    if isinstance(tokens, torch.SymInt) and not (tokens.node.has_hint() and tokens.node.hint <= max_query_tokens):
        return []
    batch = _free_symbols(out.shape[0])
    sizes, seen, todo = {}, set(), [node]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            todo.append(a)
            v = meta_val(a)
            if not isinstance(v, torch.Tensor):
                continue
            for d in v.shape[1:]:
                d = as_int(d)
                if not isinstance(d, torch.SymInt):
                    continue
                if free_unbacked_symbols(d) or (is_fn(a, _CATS) and not d.node.expr.is_Symbol):
                    return []
                for sym in _free_symbols(d) - batch:
                    sizes.setdefault(sym, d)
    for sym, d in sizes.items():
        env = d.node.shape_env
        values = getattr(env, "backed_var_to_val", None) or env.var_to_val  # (the newer name from torch 2.13)
        # the guard sym == its size in this call, and the shape environment's replacement of sym by that size
        guard_int(env.create_symintnode(sym, hint=int(values[sym])))
    if sizes:
        _fold_constant_sizes(node.graph)
    return sorted(map(str, sizes))


def _fold_constant_sizes(graph: fx.Graph) -> None:
    """Every use of a size node (sym_size, arithmetic on sizes) whose value is now a constant takes the int: the graph
    then reads like the one Dynamo traces with static sizes (what the matchers know). The nodes stay, unused (a
    placeholder stays a graph input)."""
    for n in graph.nodes:
        v = meta_val(n)
        value = as_int(v) if isinstance(v, torch.SymInt) else None
        if not isinstance(value, int):
            continue
        for user in list(n.users):
            user.args = fx.node.map_arg(user.args, lambda a: value if a is n else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a: value if a is n else a)


def _free_symbols(d) -> set:
    return set(d.node.expr.free_symbols) if isinstance(d, torch.SymInt) else set()


def same(a, b) -> bool:
    """a == b for ints / SymInts (or tuples of them), True only when provably equal: never adds a guard."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return statically_known_true(a == b)
    return a == b


def check_same_result(out: fx.Node, node: fx.Node, what: str) -> None:
    """NoMatch unless the rewrite's `out` gives the dtype and shape `node` (what it replaces: `what`) gives."""
    got, want = meta_val(out), meta_val(node)
    if not (isinstance(want, torch.Tensor) and got.dtype == want.dtype and same(tuple(got.shape), tuple(want.shape))):
        raise NoMatch(f"the rewrite would give {got.dtype} {tuple(got.shape)} where {what} gives "
                      f"{getattr(want, 'dtype', None)} {tuple(getattr(want, 'shape', ()))}")


# ------------------------------------------------------------------------------------------ node predicates
def is_fn(node, targets) -> bool:
    """A call_function node whose target is one of `targets`."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_call(node, fns=(), methods=()) -> bool:
    """A call_function of one of `fns`, or a call_method named one of `methods`."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in fns
    if node.op == "call_method":
        return node.target in methods
    return False


def is_op(node, *names) -> bool:
    """call_function / call_method of a Tensor op by name (torch.X, Tensor.X, aten.X)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target in names
    if node.op == "call_function":
        return _target_name(node.target) in names
    return False


def _target_name(target) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", None)


def is_big_negative(x) -> bool:
    """A Python number at or below BIG_NEGATIVE (-inf included)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x <= BIG_NEGATIVE


# -------------------------------------------------------------------------------------- writes and aliasing
_OPERATOR_INPLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                     operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                     operator.irshift, operator.imatmul, operator.setitem, operator.delitem}
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__",
                    "__delitem__"}


def _inplace_name(name) -> bool:
    """Tensor.add_ / torch.relu_ / aten.copy_ style names, and the augmented-assignment / item dunders."""
    return isinstance(name, str) and (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")))


@functools.lru_cache(maxsize=None)
def _schema_writes(target) -> tuple:
    """(index, name) of the arguments an op's schema marks written (`Tensor(a!)`), over all its overloads."""
    if isinstance(target, torch._ops.OpOverload):
        schemas = [target._schema]
    else:
        schemas = [getattr(target, o)._schema for o in target.overloads()]
    return tuple(sorted({(i, a.name) for s in schemas for i, a in enumerate(s.arguments)
                         if a.alias_info is not None and a.alias_info.is_write}))


@functools.lru_cache(maxsize=None)
def _inplace_position(target) -> int | None:
    """Position of a Python function's `inplace` parameter (F.relu(x, True)), if it has one."""
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def _nodes_in(x) -> list:
    return [a for a in torch.utils._pytree.tree_leaves(x) if isinstance(a, fx.Node)]


def written_by(n: fx.Node) -> list:
    """The nodes whose storage `n` writes: in-place methods / functions (`x.copy_`, `torch.relu_`, `x += y`),
    item assignment (`x[i] = v`), `out=`, `inplace=True`, ops whose schema marks an argument written (`aten.copy_`,
    `mla.cache_write`, ...). A call_module may write anything it is handed."""
    if n.op == "call_module":
        return list(n.all_input_nodes)
    if n.op not in ("call_function", "call_method"):
        return []
    t = n.target
    written = []
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        for i, name in _schema_writes(t):
            written += _nodes_in(n.args[i] if i < len(n.args) else n.kwargs.get(name))
    elif n.op == "call_function" and getattr(t, "__module__", None) == "_operator":
        if t in _OPERATOR_INPLACE:  # operator.and_ / or_ / not_ are pure despite their names
            written += _nodes_in(n.args[:1])
    elif _inplace_name(t if n.op == "call_method" else getattr(t, "__name__", None)):
        written += _nodes_in(n.args[:1])
    if "out" in n.kwargs:
        written += _nodes_in(n.kwargs["out"])
    inplace = n.kwargs.get("inplace", False)
    if n.op == "call_function" and not inplace and callable(t):
        pos = _inplace_position(t)
        inplace = pos is not None and len(n.args) > pos and n.args[pos] is True
    if inplace is True:
        written += _nodes_in(n.args[:1])
    return written


def is_pure(n: fx.Node) -> bool:
    """A call that writes nothing and has no other side effect: removable once nothing reads it."""
    if n.op not in ("call_function", "call_method") or written_by(n):
        return False
    return n.op == "call_method" or not n.is_impure()


def storages(node) -> set | None:
    """The storages of a node's tensor value(s) (views share their base's: fake tensors keep that); None when the
    node has no recorded value (then nothing can be ruled out)."""
    v = meta_val(node)
    if v is None:
        return None
    return {StorageWeakRef(t.untyped_storage()) for t in _flatten(v)}


def first_write(graph: fx.Graph, reads: dict, hi: fx.Node):
    """The first node that writes memory one of `reads` lives in (through any alias: views, slices, reshapes,
    aliased graph inputs) strictly between where it was read and `hi`. `reads` maps a node to the node where its
    value was read (the window's start). A write whose target or read has no recorded value counts as a write.
    Returns (writer, read node) or None."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    end = order[hi]
    watched = [(order[lo], r, storages(r)) for r, lo in reads.items()]
    start = min((lo for lo, _, _ in watched), default=end)
    for n in graph.nodes:
        i = order[n]
        if i <= start or i >= end:
            continue
        targets = written_by(n)
        if not targets:
            continue
        hit = [storages(w) for w in targets]
        for lo, r, keys in watched:
            if lo < i and any(k is None or keys is None or k & keys for k in hit):
                return n, r
    return None


def erase_dead(graph: fx.Graph, roots: list) -> int:
    """Erase `roots` and then their inputs, as long as nothing reads them and they are pure; returns the count."""
    work, erased = list(roots), 0
    while work:
        n = work.pop()
        if getattr(n, "_erased", False) or n.users or not is_pure(n):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased += 1
        work.extend(inputs)
    return erased


def val(node):
    """meta_val that must exist."""
    v = meta_val(node)
    if v is None:
        raise NoMatch(f"node {node.name} has no example_value metadata")
    return v


class Builder:
    """Inserts call_function nodes before an anchor and fills their `example_value` under the graph's fake
    mode (Inductor's pre-grad passes and our own matcher read it)."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_mode, meta_from: fx.Node):
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode
        self.created: list[fx.Node] = []
        self.memo_hits: list = []  # keys of memoized nodes (emitted for an earlier site) this builder reused
        self.meta = {k: meta_from.meta[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack")
                     if k in meta_from.meta}

    def call(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, tuple(args), dict(kwargs))
        self.created.append(node)
        node.meta.update(self.meta)

        def fake(a):
            return val(a) if isinstance(a, fx.Node) else a

        fargs = fx.node.map_aggregate(args, fake)
        fkwargs = fx.node.map_aggregate(kwargs, fake)
        modes = [t.fake_mode for t in _flatten(fargs) + _flatten(fkwargs) if hasattr(t, "fake_mode")]
        mode = modes[0] if modes else self.fake_mode
        with mode:
            node.meta["example_value"] = target(*fargs, **fkwargs)
        return node

    def item(self, node, i) -> fx.Node:
        return self.call(operator.getitem, node, i)

    @property
    def aten(self) -> "_EmittingOps":
        """A `torch.ops.aten` whose op overloads insert nodes here: code written against `aten.X.overload(...)`
        with an `aten=` parameter (e.g. `layout.page_slots`) runs eagerly on tensors, or emits itself into the
        graph on nodes (`aten=b.aten`), so the graph and the eager reference share one text."""
        return _EmittingOps(self)

    @contextlib.contextmanager
    def all_or_nothing(self):
        """A rewrite's emission: the nodes inserted inside stay only if the block ends normally; any exception erases
        every one of them (`rollback`: the site exactly as it was) and goes on up."""
        try:
            yield self
        except BaseException:
            self.rollback()
            raise

    def rollback(self) -> None:
        """Erase every node this builder inserted (the site is then exactly as before)."""
        for n in reversed(self.created):
            if not getattr(n, "_erased", False):
                self.graph.erase_node(n)
        self.created.clear()


class _EmittingOps:
    def __init__(self, b: Builder):
        self._b = b

    def __getattr__(self, op: str):
        return _EmittingPacket(self._b, getattr(torch.ops.aten, op))


class _EmittingPacket:
    def __init__(self, b: Builder, packet):
        self._b, self._packet = b, packet

    def __getattr__(self, overload: str):
        return functools.partial(self._b.call, getattr(self._packet, overload))


def _flatten(x) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def graph_of(gm: fx.GraphModule | fx.Graph) -> fx.Graph:
    return gm if isinstance(gm, fx.Graph) else gm.graph


def finish_edits(graph: fx.Graph) -> None:
    """After a pass changed `graph`: check it, and regenerate its module's code (when it has one)."""
    graph.lint()
    if graph.owning_module is not None:
        graph.owning_module.recompile()


def replace_each(gm, rewrite, counter: str) -> int:
    """Node-local rewrites: for every node, `rewrite(graph, node)` inserts a replacement before it and returns it
    (None: the node stays); the node's uses move to the replacement and the node goes. Counted in
    `counters["mla_compile"][counter]`; returns the count."""
    graph = graph_of(gm)
    rewritten = 0
    for node in list(graph.nodes):
        new = rewrite(graph, node)
        if new is None:
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        torch._dynamo.utils.counters["mla_compile"][counter] += rewritten
        finish_edits(graph)
    return rewritten


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's `example_value`s (Dynamo's; not necessarily the ambient one)."""
    for n in graph.nodes:
        v = n.meta.get("example_value")
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
