"""Training: what turns a loss into optimizer steps, apart from the operators that define losses.

A training operator (`update`, `critic-update`) reads its Arrow columns and says what one
micro-batch's loss is (:class:`MicroLoss`); a :class:`Trainer` owns everything around it: the
optimizer and its schedule, mini- and micro-batches (by rows or a token budget), the training
group's collectives, gradient clipping, non-finite steps and the counters that stop a run that
trains nothing, and their state in checkpoints. How a group splits the work is a
:class:`~dapo_flow.training.parallel.Parallelism` (one worker, DDP, FSDP2) the trainer is built
with, not a subclass of it.
"""

from dapo_flow.training.params import OptimizerParams
from dapo_flow.training.parallel import Parallelism, parallelism_of
from dapo_flow.training.trainer import MicroLoss, StepRows, Trainer, make_trainer

__all__ = ["MicroLoss", "OptimizerParams", "Parallelism", "StepRows", "Trainer", "make_trainer", "parallelism_of"]
