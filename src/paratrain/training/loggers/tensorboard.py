"""TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` event files in ``<run>/tensorboard``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FOLDER = "tensorboard"


class TensorBoardTracker:
    """Scalars by step, the job as text; a resumed run's ``purge_step`` drops the events a
    killed run wrote after its checkpoint."""

    def __init__(self, run_dir: Path, job: dict[str, Any], resume_after: float | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_after is None else int(resume_after) + 1
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / FOLDER), purge_step=purge)
        if resume_after is None:
            self.writer.add_text("job", "```\n" + json.dumps(job, indent=2) + "\n```", global_step=0)

    def held_through(self) -> float | None:
        return None  # purge_step drops what a killed session wrote after the resume point

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a killed run keeps its curve up to the kill (purged on resume)

    def close(self) -> None:
        self.writer.close()
