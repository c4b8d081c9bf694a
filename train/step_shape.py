"""The shape of one optimizer step on one rank: how many sequences it takes, in how many
micro-batches of which sizes, and how much of each decoder layer the backward recomputes.

One owner (:class:`StepShape`, held by the trainer): the memory planner sets it
(``Trainer.set_step_shape``), and the data draw (the micro-batch sizes), the FFN plan (rows per
FFN call) and the recomputation are set from it in that one call.
"""

from __future__ import annotations

from dataclasses import dataclass


def micro_batch_sizes(batch_per_rank: int, micro_batch: int) -> list[int]:
    """The micro-batches (sequences each) of one optimizer step on one rank, in order:
    ``ceil(batch_per_rank / micro_batch)`` of them, sizes differing by at most one (larger
    first), none above ``micro_batch``, summing to ``batch_per_rank``. ``[micro_batch] * (P //
    micro_batch)`` when ``micro_batch`` divides ``P``. E.g. ``(512, 24)``: 6 x 24 + 16 x 23.

    Raises:
        ValueError: a size < 1, or micro_batch > batch_per_rank."""
    if batch_per_rank < 1 or not 1 <= micro_batch <= batch_per_rank:
        raise ValueError(f"need 1 <= micro_batch <= batch_per_rank; got micro_batch "
                         f"{micro_batch}, batch_per_rank {batch_per_rank}")
    accum = -(-batch_per_rank // micro_batch)
    q, r = divmod(batch_per_rank, accum)
    return [q + 1] * r + [q] * (accum - r)


@dataclass(frozen=True)
class StepShape:
    """One optimizer step on one rank.

    Attributes:
        batch_per_rank: sequences one rank takes per step (``global_batch / world size``).
        micro_batch: the largest micro-batch (sequences per forward).
        accum: micro-batches per step (gradient accumulation count).
        seq_len: tokens per sequence (T).
        recompute: what of each decoder layer the backward recomputes
            (:data:`train.recompute.RECOMPUTE_MODES`), or None: as the model was set up
            (``trainer.grad_checkpointing`` / ``checkpoint_ffn``).
    """

    batch_per_rank: int
    micro_batch: int
    accum: int
    seq_len: int
    recompute: str | None = None

    @property
    def rows_per_call(self) -> int:
        """Token rows of one FFN call: ``micro_batch * seq_len``."""
        return self.micro_batch * self.seq_len

    def sizes(self) -> list[int] | None:
        """The step's micro-batch sizes when they are uneven (:func:`micro_batch_sizes`), None
        when every micro-batch has ``micro_batch`` sequences (or the accumulation is not the
        balanced split's: a driver's own)."""
        if self.micro_batch > self.batch_per_rank:
            return None
        sizes = micro_batch_sizes(self.batch_per_rank, self.micro_batch)
        if len(sizes) != self.accum or sizes[-1] == self.micro_batch:
            return None
        return sizes
