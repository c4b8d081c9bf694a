"""The no-sync ELL training op (``sparse_ffn_train`` with ``backup_rows >= 0``) captured in one
CUDA graph, forward and backward together: a call is one graph launch instead of ~96 kernel
launches and the Python and dispatcher work that queues them. :func:`graphed_ell_forward` does
the same for the forward alone (``ell_ffn_forward``'s no-sync mode, inference).

Why: ``scripts/bench_real_layers.py --profile`` (one H200, N 16384, D 2048, H 5632) showed the
op host-bound: ``ell_nosync`` 4.98 ms wall a call against 2.55 ms of GPU busy time (49 % idle,
96 kernels), where dense PyTorch autograd is 4.74 / 4.72 ms. A replayed graph leaves the GPU's
time. In a whole-model step at large micro-batches the GPU is busy anyway (idle < 3 %): the
gain is for the op benchmark and small micro-batches.

What a capture freezes (the host's work at capture time is replayed as it was), and how each is
handled here:

1. Shapes. N, D, H, the ELL capacity KC and the dense-backup capacity R_cap = min(backup_rows,
   N - 1) size every buffer (ELL N x KC, the CSC order's N*KC, the backup's R_cap x H,
   ``nonzero_static``'s output); nothing in the no-sync op is sized by a tensor's values.
   Inputs of another shape or dtype are refused (ValueError): capture again.
2. The heavy-row decision. The no-sync op takes it on the device (the heavy rows fill the
   backup through ``nonzero_static``, no sync); rows beyond R_cap would be wrong (their ELL
   part is empty). The measuring mode (``backup_rows=-1``) reads R on the host (an event wait
   and a pinned copy) and may switch to its all-dense fallback (``dense_row_fraction``): not
   capturable, so refused here (ValueError). The guard: each call ORs ``heavy_rows > R_cap``
   into a device flag inside the graph (no sync); :meth:`GraphedStep.check` reads it (one
   sync) and raises :class:`CapacityOverflow`, as the build does when a warm-up call
   overflowed. On it the caller redoes the step eagerly with ``backup_rows=-1`` and captures
   again with ``backup_capacity_for`` of the new count (the trainer's rule for the no-sync op).
3. Launch shapes: ``twell.ops.launch.CONFIG`` (blocks, warps, the dW slice ``dw_launch`` picks
   from N and D) is read at launch, so at capture; ``kernel_config`` around a replay does
   nothing. Likewise the backend (``pick_backend``, ``TRITON_INTERPRET``), the policy's
   capacity and the autocast state of the capture.
4. First-call host work: Triton compiles and loads its kernels and cuBLAS initialises on the
   first calls, which the warm-up calls (eager, on a side stream) make before the capture. A
   host sync or other uncapturable call in the op fails the capture loudly (torch raises).
5. Memory: every intermediate lives in the graph's private pool while the object lives (one
   call's ELL state, backup and activations: the eager op's peak, kept). The outputs are
   static tensors that the next call overwrites: clone what must outlive it.
6. Inputs: x, dy and dl1 (dL/dl1, the L1 coefficient) are static buffers that a call refills
   (a tensor that already is the buffer is not copied); the L1 coefficient travels as the dl1
   buffer, since a ``full_like(l1, c)`` inside the graph would bake c in. The weights are read
   in place (their storage as passed): an in-place update (an optimizer step) reaches the next
   replay, a new weight tensor does not.

No RNG is used; no hot units (``ell_hot``) here.

The forward alone (:func:`graphed_ell_forward`) differs in one point: heavy rows past the
backup's capacity are computed by the overflow kernel inside the graph (``twell.ops.
overflow_rows``, whose row count is read on the device), so every call is exact whatever its
heavy rows, and there is no guard to read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from twell.ops.ffn_train import _backup_capacity, ell_ffn_forward, sparse_ffn_train
from twell.ops.train_backend import check_train_args, pick_backend, torch_backend
from twell.policy import FFNPolicy

# what a graphed FFN call returns, in this order: y, the gradients of sum(y dy) + dl1 * l1 wrt
# x, Wg, Wu, Wd, then the L1 term and the heavy-row count (scalars)
FFN_OUTPUTS = ("y", "dx", "dwg", "dwu", "dwd", "l1", "heavy_rows")


class CapacityOverflow(RuntimeError):
    """A graphed call had more heavy rows than its dense backup holds: the results of those rows
    were wrong (redo the step with ``backup_rows=-1`` and capture with a larger capacity)."""


class CudaGraphs:
    """The CUDA side of :class:`GraphedStep`: warm-up calls on a side stream, then one capture
    (``torch.cuda.graph``, a private memory pool). A test passes a stand-in with these two
    methods."""

    def warmup(self, fn: Callable[[], object], calls: int) -> None:
        """``calls`` eager calls of ``fn`` on a side stream (torch's recipe before a capture)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(calls):
                fn()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, fn: Callable[[], tuple]) -> tuple[Callable[[], None], tuple]:
        """Capture one call of ``fn``; returns (replay, its outputs: static tensors)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph.replay, out


class GraphedStep:
    """``step`` captured once in a CUDA graph after ``warmup`` eager calls; a call refills the
    named static inputs and replays (module docstring: what a capture freezes).

    Args:
        step: () -> (outputs, overflow): a tuple of tensors computed from the static inputs
            only, and a bool scalar tensor (or None) that is true when this call's results are
            wrong (the guard: ORed into a device flag, no host sync).
        inputs: name -> static tensor that ``step`` reads and a call may refill.
        warmup: eager calls before the capture (>= 1: Triton compiles, cuBLAS initialises).
        overflow_msg: the :class:`CapacityOverflow` message.
        graphs: the graph backend (default :class:`CudaGraphs`, which needs CUDA inputs).

    Raises:
        ValueError: ``warmup`` < 1 or no inputs.
        RuntimeError: CUDA graphs without CUDA inputs (default backend).
        CapacityOverflow: a warm-up call overflowed (nothing is captured).
    """

    def __init__(self, step: Callable[[], tuple], inputs: dict[str, torch.Tensor], *,
                 warmup: int = 2, overflow_msg: str = "overflow", graphs=None) -> None:
        if warmup < 1:
            raise ValueError(f"GraphedStep: warmup must be >= 1 (the first calls compile and "
                             f"initialise, which a capture cannot hold); got {warmup}")
        if not inputs:
            raise ValueError("GraphedStep: no static inputs")
        dev = next(iter(inputs.values())).device
        if graphs is None:
            if dev.type != "cuda":
                raise RuntimeError(f"GraphedStep: CUDA graphs need CUDA tensors; got {dev}")
            graphs = CudaGraphs()
        self.inputs = dict(inputs)
        self._msg = overflow_msg
        self._flag = torch.zeros((), dtype=torch.bool, device=dev)  # outside the graph's pool

        def body() -> tuple:
            out, overflow = step()
            if overflow is not None:
                self._flag.logical_or_(overflow)
            return tuple(out)

        graphs.warmup(body, warmup)
        self.check()  # before the capture: a capacity too small for these inputs stops here
        self._replay, self.outputs = graphs.capture(body)

    def __call__(self, **new: torch.Tensor | float) -> tuple:
        """Copy each given input into its static buffer (unless it is the buffer), replay, and
        return the static outputs (overwritten by the next call). No host sync. A Python number
        is taken for a 0-d buffer (the L1 coefficient ``dl1``).

        Raises:
            ValueError: an unknown input name, or a shape / dtype other than the capture's.
            TypeError: an input neither a tensor nor (for a 0-d buffer) a number.
        """
        for name, t in new.items():
            buf = self.inputs.get(name)
            if buf is None:
                raise ValueError(f"GraphedStep: unknown input {name!r}; known: "
                                 f"{sorted(self.inputs)}")
            if isinstance(t, (int, float)) and not isinstance(t, bool) and buf.dim() == 0:
                t = torch.full((), float(t), dtype=buf.dtype, device=buf.device)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"GraphedStep: input {name!r} is a {type(t).__name__}; give a "
                                 f"tensor of shape {tuple(buf.shape)} {buf.dtype}")
            if t.shape != buf.shape or t.dtype != buf.dtype:
                raise ValueError(f"GraphedStep: input {name!r} is {tuple(t.shape)} {t.dtype}, "
                                 f"captured as {tuple(buf.shape)} {buf.dtype}: capture again")
            if t.data_ptr() != buf.data_ptr():
                with torch.no_grad():  # the buffer may be a leaf that requires grad
                    buf.copy_(t)
        self._replay()
        return self.outputs

    def check(self) -> None:
        """Raise :class:`CapacityOverflow` if a call since the last check overflowed (one host
        sync; the flag is cleared)."""
        if bool(self._flag):
            self._flag.zero_()
            raise CapacityOverflow(self._msg)


def _check_capturable(x: torch.Tensor, graphs, name: str) -> None:
    """Refuse, before any warm-up, an input that a real capture cannot hold: the PyTorch
    backend (fp64, or no Triton) reads counts on the host (``nonzero``, ``.item()``). A stand-in
    ``graphs`` (tests) runs any backend."""
    if graphs is None and x.is_cuda and pick_backend(x, "auto") is torch_backend:
        raise ValueError(f"{name}: {x.device.type} {x.dtype} runs on the PyTorch backend, which "
                         "reads counts on the host: a CUDA graph cannot hold it (use bf16 / fp16 "
                         "/ fp32 CUDA inputs with Triton installed, or the eager op)")


def graphed_ffn_train(x_ND: torch.Tensor, w_gate_HD: torch.Tensor, w_up_HD: torch.Tensor,
                      w_down_DH: torch.Tensor, dy_ND: torch.Tensor, *, backup_rows: int,
                      l1_coeff: float = 0.0, policy: FFNPolicy | None = None, warmup: int = 2,
                      graphs=None) -> GraphedStep:
    """One forward + backward of the no-sync ``sparse_ffn_train`` (loss ``sum(y dy) + dl1 l1``)
    captured in a CUDA graph: a call returns :data:`FFN_OUTPUTS` (y (N, D), dx (N, D), dWg,
    dWu (H, D), dWd (D, H), l1 (fp32; fp64 for fp64 inputs) and heavy_rows
    (fp32) scalars), static tensors in the op's dtypes.

    Args:
        x_ND, dy_ND: (N, D) input and upstream gradient, copied into the static inputs ``x``
            and ``dy`` (a call may pass new ones: ``g(x=..., dy=...)``).
        w_gate_HD, w_up_HD, w_down_DH: (H, D), (H, D), (D, H) weights, read in place.
        backup_rows: the dense backup's capacity (>= 0; rows: ``min(backup_rows, N - 1)``), e.g.
            ``backup_capacity_for`` of a measured ``stats.heavy_rows``.
        l1_coeff: dL/dl1, the static input ``dl1`` (a scalar in l1's dtype: fp32, fp64 for
            fp64 inputs).
        policy: the op's policy (ELL capacity); warmup, graphs: :class:`GraphedStep`'s.

    Raises:
        ValueError: ``backup_rows`` < 0 (the measuring mode syncs), N = 0, dy not (N, D), an
            input on the PyTorch backend (fp64 CUDA, or Triton missing; default graphs), or
            what ``sparse_ffn_train`` refuses.
        RuntimeError: not CUDA (default backend). CapacityOverflow: a warm-up call had more
            heavy rows than the capacity.
    """
    check_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH, "auto", "graphed_ffn_train")
    _check_capacity(backup_rows, "graphed_ffn_train", "stats.heavy_rows")
    _check_capturable(x_ND, graphs, "graphed_ffn_train")
    n = x_ND.shape[0]
    if n == 0 or dy_ND.shape != x_ND.shape:
        raise ValueError(f"graphed_ffn_train: N >= 1 and dy of x's shape {tuple(x_ND.shape)}; "
                         f"got dy {tuple(dy_ND.shape)}")
    x = x_ND.detach().clone().requires_grad_()
    # the weights' own storage (detach shares it): an in-place update reaches the next replay
    ws = [w.detach().requires_grad_() for w in (w_gate_HD, w_up_HD, w_down_DH)]
    dy = dy_ND.detach().clone()
    # in the L1 term's dtype (fp32, fp64 for fp64 inputs): an fp32 buffer would round the
    # coefficient of an fp64 call (0.3 -> 0.30000001), unlike the eager op
    dl1 = torch.full((), float(l1_coeff), dtype=torch.promote_types(x.dtype, torch.float32),
                     device=x.device)
    cap = _backup_capacity(backup_rows, n)

    def step():
        y, st = sparse_ffn_train(x, *ws, policy=policy, backup_rows=backup_rows)
        grads = torch.autograd.grad([y, st.l1], [x, *ws], [dy, dl1])
        return (y.detach(), *grads, st.l1.detach(), st.heavy_rows), st.heavy_rows > cap

    msg = (f"graphed_ffn_train: more heavy rows than the dense backup's {cap} (backup_rows "
           f"{backup_rows}, N {n}): those rows' results are wrong; redo the step with "
           "backup_rows=-1 and capture again with backup_capacity_for(its heavy_rows)")
    return GraphedStep(step, {"x": x, "dy": dy, "dl1": dl1}, warmup=warmup, overflow_msg=msg,
                       graphs=graphs)


def _check_capacity(backup_rows: int, who: str, measured: str) -> None:
    """Refuse the measuring mode (``backup_rows`` < 0) in a graph builder: it syncs."""
    if backup_rows < 0:
        raise ValueError(f"{who}: backup_rows must be a capacity >= 0; -1 measures the heavy "
                         "rows with a host sync, which a graph cannot hold (pass "
                         f"backup_capacity_for({measured}) of a measuring call)")


def graphed_ell_forward(x_ND: torch.Tensor, w_gate_HD: torch.Tensor, w_up_HD: torch.Tensor,
                        w_down_DH: torch.Tensor, *, backup_rows: int,
                        policy: FFNPolicy | None = None, w_down_t_HD: torch.Tensor | None = None,
                        warmup: int = 2, graphs=None) -> GraphedStep:
    """One call of :func:`twell.ops.ffn_train.ell_ffn_forward`'s no-sync mode (no autograd)
    captured in a CUDA graph: a call returns ``(y, heavy)``, static tensors (y (N, D) in the
    compute dtype, heavy (1,) int32: the call's heavy-row count, what the next capture's
    capacity must hold to keep the overflow kernel idle), overwritten by the next call.

    Why: the eager forward may be host-bound where its GPU work is small (BENCHMARKS.md, second
    session of 2026-12-07: ``ell_nosync`` forward 1.5-1.6 ms a call on recorded layers, 1.05 on
    i.i.d. rows, whose host launches took 0.85-0.96 ms); a replay leaves the kernels' time.
    Exact on every input: heavy rows past the capacity go through the overflow kernel inside
    the graph (module docstring). Source: the hybrid ELL + dense-backup layout's forward (arXiv
    2603.23198); the graph capture and the overflow kernel are ours.

    Args:
        x_ND: (N, D) input, copied into the static input ``x`` (a call may pass a new one:
            ``g(x=...)``).
        w_gate_HD, w_up_HD, w_down_DH: (H, D), (H, D), (D, H) weights, read in place.
        backup_rows: the dense backup's capacity (>= 0; rows ``min(backup_rows, N - 1)``), e.g.
            ``backup_capacity_for`` of a measuring call's heavy rows.
        policy: the op's policy (ELL capacity). w_down_t_HD: as ``ell_ffn_forward``'s (a cached
            Wd^T, read in place). warmup, graphs: :class:`GraphedStep`'s.

    Raises:
        ValueError: ``backup_rows`` < 0 (the measuring mode syncs), N = 0, an input on the
            PyTorch backend (fp64 CUDA, or Triton missing: it reads counts on the host; with the
            default graphs), or what ``ell_ffn_forward`` refuses.
        RuntimeError: not CUDA (default backend).
    """
    check_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH, "auto", "graphed_ell_forward")
    _check_capacity(backup_rows, "graphed_ell_forward", "heavy")
    if x_ND.shape[0] == 0:
        raise ValueError("graphed_ell_forward: N >= 1 (an empty input has nothing to capture)")
    _check_capturable(x_ND, graphs, "graphed_ell_forward")
    # row-major whatever x_ND's strides: a strided buffer would cost a copy inside every replay
    x = x_ND.detach().clone(memory_format=torch.contiguous_format)
    ws = [w.detach() for w in (w_gate_HD, w_up_HD, w_down_DH)]

    def step():
        with torch.no_grad():
            y, heavy = ell_ffn_forward(x, *ws, backup_rows=backup_rows, policy=policy,
                                       w_down_t_HD=w_down_t_HD)
        return (y, heavy), None

    return GraphedStep(step, {"x": x}, warmup=warmup, graphs=graphs)


__all__ = ["FFN_OUTPUTS", "CapacityOverflow", "CudaGraphs", "GraphedStep", "graphed_ell_forward",
           "graphed_ffn_train"]
