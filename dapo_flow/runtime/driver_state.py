"""What the driver saves in a checkpoint's driver.json and reads back on resume, typed: the
loop's position (step, sampler cursor, counters, policy version), the batches collected ahead,
the metrics not yet logged, and the graph the run was started with. Read once, here; a
checkpoint of an older dapo-flow version that lacks a field gets the value it implied."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class AheadRecord(BaseModel):
    """One step's rollout that a one_step_off or async run had collected before the checkpoint
    (its table is the checkpoint's ``ahead_N.arrow``)."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")  # a NaN metric reads back

    batch: bool  # False: a step that trains nothing (its table is absent)
    metrics: dict[str, float]
    policy_version: int  # the oldest weights its generation batches were queued under


class DriverState(BaseModel):
    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")  # a NaN metric reads back

    step: int  # the last step trained
    mlflow_run_id: str
    sampler: dict[str, Any]  # the prompt sampler's cursor (PromptSampler.state)
    trained_models: list[str]  # the models whose weights the checkpoint holds
    samples_generated: int = 0
    wall_seconds: float = 0.0
    keep_rate: float | None = None  # gen_prompts_per_batch: auto's running keep rate
    skipped_in_a_row: int = 0
    policy_version: int | None = None  # RL steps trained into the weights (None: older checkpoints)
    carry_version: int | None = None  # the carried groups' oldest version (None: no carry)
    ahead: list[AheadRecord] = []
    unlogged_metrics: list[tuple[int, dict[str, float]]] = []  # (step, metrics) not in MLflow yet
    graph: dict[str, Any] | None = None  # the spec, which --resume diffs a changed graph with

    @property
    def version(self) -> int:
        """The weights' policy version (a checkpoint written before versions were recorded: its
        step, one version per step)."""
        return self.step if self.policy_version is None else self.policy_version
