"""Where metrics go: a progress bar with ETA, <run dir>/metrics.jsonl, and optionally wandb.

One record per log step: {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu",
"peak_vram_mb", "elapsed_s"}; eval records carry "val_loss". wandb is imported only when
``logger=wandb``.
"""
import json
import math
from pathlib import Path
from typing import List, Optional, Tuple

from tqdm import tqdm

from errors import UserError
from training.config import LoggerConfig


def read_records(path: Path) -> Tuple[List[dict], int]:
    """The records of a metrics.jsonl and how many lines were skipped: cut short by a kill (a
    SIGKILL in the middle of a write leaves half a line). Blank lines are ignored."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if _step_of(line) is not None]
    return records, len(lines) - len(records)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records logged after ``last_step`` (work lost since the checkpoint a run resumes from)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if (step := _step_of(line)) is not None and step <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)  # a kill here leaves the old file, never half of it
    finally:
        tmp.unlink(missing_ok=True)  # gone already once renamed


def _step_of(line: str) -> Optional[int]:
    """The step of a metrics line; None for a blank line or one cut short by a kill."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def _clean(value):
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        cfg: LoggerConfig,
        max_steps: int,
        start_step: int,
        run_name: str,
        config: dict,
        wandb_id: Optional[str] = None,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        truncate_metrics(self.path, start_step)
        self.file = open(self.path, "a")
        self.bar = tqdm(total=max_steps, initial=start_step, unit="step", dynamic_ncols=True, disable=not cfg.progress)
        self.wandb_run = _start_wandb(cfg, run_dir, run_name, config, wandb_id) if cfg.name == "wandb" else None

    @property
    def wandb_id(self) -> Optional[str]:
        return None if self.wandb_run is None else self.wandb_run.id

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def log(self, record: dict) -> None:
        val_loss = record.get("val_loss")  # NaN is written as null but shown as it is
        record = {k: _clean(v) for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        shown = {k: record[k] for k in ("loss", "val_loss", "tokens_per_s", "mfu") if record.get(k) is not None}
        self.bar.set_postfix({k: f"{v:.4g}" if k != "tokens_per_s" else f"{v:,.0f}" for k, v in shown.items()}, refresh=False)
        if "val_loss" in record:
            self.message(f"step {record['step']}: val_loss {val_loss:.4f}")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def message(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _start_wandb(cfg: LoggerConfig, run_dir: Path, run_name: str, config: dict, wandb_id: Optional[str]):
    try:
        import wandb
    except ImportError as err:
        raise UserError("logger=wandb needs the wandb package: `pip install wandb`, or use logger=default") from err
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=run_name,
        id=wandb_id,
        resume="allow",
        dir=str(run_dir),
        config=config,
        mode=cfg.mode,
    )


class QuietLogger:
    """The logger of ranks other than 0: they compute, rank 0 reports."""

    wandb_id = None

    def advance(self, steps: int = 1) -> None:
        pass

    def log(self, record: dict) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

