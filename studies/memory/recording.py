"""What an autograd graph keeps for backward: a saved-tensor recorder and a graph walk.

:class:`Recorder` sees every tensor packed for backward (as a saved-tensor pack hook) with the
module whose forward saved it; :func:`walk` then attaches to each recorded storage the autograd
nodes and slots that hold it. Storages are keyed by ``untyped_storage().data_ptr()`` and counted
whole (a view keeps its whole storage alive); parameters are left out, their casts are not.
"""

from __future__ import annotations

import torch


class Recorder:
    """Saved-tensor pack hook + module stack: storage pointer -> what and where.

    ``by_ptr[ptr]`` is ``{"module": name or "<top>", "bytes": storage bytes, "shape": tuple,
    "dtype": "bfloat16"/..., "nodes": set of "Node.slot"}``. Registers global module hooks until
    :meth:`close`."""

    def __init__(self, model):
        self.stack: list[str] = []
        self.names = {m: n for n, m in model.named_modules()}
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.by_ptr: dict[int, dict] = {}
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]

    def _pre(self, mod, args):
        self.stack.append(self.names.get(mod, type(mod).__name__))

    def _post(self, mod, args, out):
        self.stack.pop()

    def where(self) -> str:
        """The innermost module running now (its name in the model), or ``""`` outside any."""
        return self.stack[-1] if self.stack else ""

    def record(self, t, node=None):
        """Record ``t``'s storage (first sight wins the module), and ``node`` as a holder."""
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.params and ptr not in self.by_ptr:
            self.by_ptr[ptr] = {"module": self.stack[-1] if self.stack else "<top>",
                                "bytes": st.nbytes(), "shape": tuple(t.shape),
                                "dtype": str(t.dtype).replace("torch.", ""), "nodes": set()}
        if node is not None and ptr in self.by_ptr:
            self.by_ptr[ptr]["nodes"].add(node)

    def pack(self, t):
        """A pack hook that records ``t`` and keeps it as it is."""
        self.record(t)
        return t

    def close(self):
        """Remove the global module hooks."""
        for h in self.handles:
            h.remove()


def saved_of(node):
    """``[(slot name, tensor)]`` of what an autograd node keeps: a Python Function's
    ``saved_tensors`` (``saved[i]``) and a built-in node's ``_saved_*`` attributes."""
    out = []
    if hasattr(node, "saved_tensors"):  # Python Function nodes
        try:
            for i, t in enumerate(node.saved_tensors):
                if isinstance(t, torch.Tensor):
                    out.append((f"saved[{i}]", t))
        except RuntimeError:
            pass
    for a in dir(node):
        if not a.startswith("_saved_"):
            continue
        try:
            v = getattr(node, a)
        except Exception:  # noqa: BLE001, S112  (undefined saved variables: nothing kept)
            continue
        vs = v if isinstance(v, (list, tuple)) else [v]
        for j, t in enumerate(vs):
            if isinstance(t, torch.Tensor):
                out.append((a[len("_saved_"):] + (f"[{j}]" if len(vs) > 1 else ""), t))
    return out


def walk(roots, rec: Recorder) -> None:
    """Attach to each storage in ``rec`` the nodes (``"Node.slot"``) reachable from ``roots``
    (autograd nodes, ``None`` skipped) that hold it. A storage no node holds is not alive in the
    graph (freed, or only seen in passing)."""
    seen, todo = set(), [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        for slot, t in saved_of(node):
            ptr = t.untyped_storage().data_ptr()
            if ptr in rec.by_ptr:
                rec.by_ptr[ptr]["nodes"].add(f"{name}.{slot}")
        todo.extend(fn for fn, _ in node.next_functions if fn is not None)
