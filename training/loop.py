"""The training loop: ``train(cfg, run_dir)`` is everything `python train.py` does after the config is composed.

Read top to bottom: ``train`` sets the run up (training/run.py) and calls ``train_loop``, where each
step is, in order: learning rate, optimizer step, log, evaluate, checkpoint, stop. The helpers below
hold the details; the step itself is training/step.py.
"""
import contextlib
import signal
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from data.loader import TokenCacheChanged
from training import distributed
from training.checkpoint import list_checkpoints, rng_state
from training.config import TrainConfig
from training.errors import Interrupted, NonFiniteState, OutOfMemory, kept_text, memory_exhausted
from training.health import LossWatch
from training.metrics import StartupClock
from training.optim import lr_at, set_lr
from training.precision import resolve_device
from training.run import Run, add_run_info, setup_run
from training.run_folder import claim_run_folder, write_record
from training.signals import StopRequest, StopSignal
from training.step import evaluate, generate_sample


def train(cfg: TrainConfig, run_dir: Path, record: Optional[Dict[str, str]] = None) -> dict:
    """Train the model ``cfg`` describes; write metrics and checkpoints under ``run_dir``.

    The folder is held first (its lock); its record (config.yaml and ``record``: {path in the folder:
    text}, Hydra's .hydra/ files) is written once the run is set up and its checkpoint accepted, so a
    refused run changes nothing there. Returns a summary: {"step", "loss", "val_loss", "backend",
    "elapsed_s", "sample"}.
    """
    t = cfg.trainer
    device = resolve_device(t.device)
    clock = StartupClock(device)  # times the start: from the command in the process's first run
    ranks, device = distributed.setup(t.distributed, device, t.context_parallel)
    clock.phase("device")  # the process group and, on a GPU, the CUDA context (the clock's wait makes it)
    lock = None
    try:
        lock = claim_run_folder(Path(run_dir), ranks)  # one run per folder; rank 0 holds it
        run = setup_run(cfg, Path(run_dir), ranks, device, clock.phase)
        if run.start_step >= t.max_steps:
            print(f"{run.run_dir} holds a finished run (step {run.start_step} of {t.max_steps}): extend it with "
                  f"trainer.max_steps=N, start over with trainer.resume=none, or use another hydra.run.dir")
            return summary(run, run.start_step, None, None, 0.0, "")
        if ranks.is_main:
            write_record(run.run_dir, cfg, record)
        with contextlib.closing(run.logger):
            loss, val_loss, elapsed = train_loop(run, clock)
        result = summary(run, t.max_steps, loss, val_loss, elapsed, write_sample(run))
        distributed.barrier()  # the ranks tear the process group down together: gloo can abort a rank that leaves first
        return result
    finally:
        if lock is not None:
            lock.release()
        distributed.teardown()


def train_loop(run: Run, clock: Optional[StartupClock] = None) -> Tuple[float, Optional[float], float]:
    """Steps start_step + 1 .. max_steps. Returns (last loss, last val_loss, seconds taken).

    ``clock`` times the first steps from the process start; rank 0 adds its record to run.json."""
    t = run.cfg.trainer
    loss, val_loss, saved = float("nan"), None, None
    watch = LossWatch(run.device, t.max_bad_steps, run.start_step, run.run_dir, run.cfg.optim.lr)
    clock = clock or StartupClock(run.device)
    clock.loop_started()
    started = time.perf_counter()
    with StopRequest() as stop:
        for step in range(run.start_step + 1, t.max_steps + 1):
            lr = lr_at(step, run.cfg.optim, t.max_steps)
            set_lr(run.optimizer, lr)
            loss_t, grad_norm_t, good = take_step(run, step)
            watch.count(step, loss_t, good)
            note_startup(run, clock, step)

            stopping = distributed.any_rank(bool(stop.signum), run.ranks)
            log_due = step % t.log_interval == 0 or step == t.max_steps
            eval_due = step % t.eval_interval == 0 or step == t.max_steps
            ckpt_due = step % t.ckpt_interval == 0 or step == t.max_steps or stopping
            if not (log_due or eval_due or ckpt_due):
                continue  # nothing read from the device: the host runs ahead of the GPU
            loss, grad_norm = loss_t.item(), grad_norm_t.item()
            unsaveable = watch.check(step)  # why this step may not be saved; "" when it may

            if log_due:
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, **run.meter.report()}
                record["peak_vram_mb"] = distributed.maximum(record["peak_vram_mb"])
                run.logger.log({**record, "elapsed_s": time.perf_counter() - started})
            if eval_due:
                with clock.timed("evaluation"), run.meter.paused(), saved_if_the_cache_changes(run, step):
                    val_loss = evaluate(run.step_model, run.val_loader, t.eval_iters, run.device, run.dtype,
                                        run.shard, stop=lambda: distributed.any_rank(bool(stop.signum), run.ranks))
                if val_loss is None:  # a signal cut the evaluation short: save now, not after it
                    stopping = ckpt_due = True
                else:
                    run.logger.log({"step": step, "val_loss": val_loss, "elapsed_s": time.perf_counter() - started})
                    if not unsaveable:
                        with clock.timed("best checkpoint"), run.meter.paused():
                            run.checkpointer.save_if_best(step, val_loss, run.train_loader.state_dict())
            if ckpt_due and not unsaveable:
                with clock.timed("checkpoint"), run.meter.paused():
                    try:
                        saved = run.checkpointer.save(step, run.train_loader.state_dict())
                    except NonFiniteState as err:
                        raise watch.stopped(str(err)) from err
            elif ckpt_due:
                run.logger.message(f"step {step}: no checkpoint written: {unsaveable}")
            if stopping:
                raise interrupted(stop.signum, step, newest_checkpoint(run.run_dir) if unsaveable else saved)
    if run.ranks.is_main:
        add_run_info(run.run_dir, clock.record())  # with the time spent evaluating and saving
    return loss, val_loss, time.perf_counter() - started


def note_startup(run: Run, clock: StartupClock, step: int) -> None:
    """Time the run's first steps (training/metrics.py: StartupClock): rank 0 says when the first one
    ended and where the time went, and adds the times to run.json after the last one timed."""
    timed_all = clock.step_done()
    if not run.ranks.is_main:
        return
    if step == run.start_step + 1 and clock.record()["first_step_s"] is not None:
        run.logger.message(f"step {step} done {clock.record()['first_step_s']:.1f} s after the command started "
                           f"({clock.summary()})")
    if timed_all:
        add_run_info(run.run_dir, clock.record())


def take_step(run: Run, step: int):
    """One optimizer step: (loss, grad norm, good) on the device. Out of memory (GPU or CPU), or when the
    token cache shrank under the run, the step before is saved (with the loader position and random
    state it had) and the error raised, naming it."""
    loader_before, rng_before = run.train_loader.state_dict(), rng_state(run.device)
    run.profiler.before_step(step)
    try:
        outputs = run.step(run.train_loader)
    except (RuntimeError, MemoryError, TokenCacheChanged) as err:  # torch.OutOfMemoryError is a RuntimeError
        memory = memory_exhausted(err)
        if memory is None and not isinstance(err, TokenCacheChanged):
            raise
        run.optimizer.zero_grad(set_to_none=True)
        # A sharded save needs every rank, and the others may be waiting inside the failed step.
        can_save = step - 1 > run.start_step and not run.ranks.sharded
        saved = run.checkpointer.save(step - 1, loader_before, rng_before) if can_save else None
        if memory:
            raise OutOfMemory(step, saved, run.cfg.trainer.vram_budget_gb, memory, err) from err
        raise TokenCacheChanged(f"{err} at step {step}{kept_text(step, saved)}; {RESUME_ADVICE}") from err
    run.meter.tick(run.tokens_per_step)
    run.logger.advance()
    profiled = run.profiler.after_step(step)
    if profiled:
        run.logger.message(profiled)
    return outputs


RESUME_ADVICE = "start the same command again to resume (it checks the token cache and rebuilds it)"


@contextlib.contextmanager
def saved_if_the_cache_changes(run: Run, step: int):
    """Around an evaluation after ``step``: when the token cache shrinks under it, save ``step`` (trained
    already) and raise TokenCacheChanged naming the checkpoint."""
    try:
        yield
    except TokenCacheChanged as err:
        saved = None if run.ranks.sharded else run.checkpointer.save(step, run.train_loader.state_dict())
        kept = f"; step {step} is saved in {saved}" if saved else kept_text(step, None)
        raise TokenCacheChanged(f"{err} while evaluating after step {step}{kept}; {RESUME_ADVICE}") from err


def newest_checkpoint(run_dir: Path):
    newest = list_checkpoints(run_dir)
    return newest[-1] if newest else "no checkpoint"


def interrupted(signum: Optional[int], step: int, kept) -> Interrupted:
    """The stop after ``step`` that a signal asked for; a rank the signal did not reach stops as if by SIGTERM."""
    signum = signum or signal.SIGTERM
    return Interrupted(signum, f"{signal.Signals(signum).name}: stopped after step {step}; {kept} holds "
                               "the run (start the same command again to resume)")


def write_sample(run: Run) -> str:
    """Text generated at the end, printed and written to sample.txt by rank 0 (sharded weights are
    gathered collectively: every rank generates the same text). None under context parallelism, where
    the model's attention is a ring over the ranks of a sequence."""
    t = run.cfg.trainer
    if run.ranks.context_size > 1:
        if t.sample_tokens and run.ranks.is_main:
            print(f"no sample under trainer.context_parallel={run.ranks.context_size}; write one from a checkpoint: "
                  f"python -m scripts.sample {run.run_dir}")
        return ""
    generating = run.ranks.is_main or run.ranks.sharded
    try:
        sample = generate_sample(run.model, run.tokenizer, t.sample_tokens if generating else 0, run.device, run.dtype,
                                 t.seed)
    except (KeyboardInterrupt, StopSignal) as err:  # the run is done: say so, and how to sample later
        signum = getattr(err, "signum", signal.SIGINT)
        raise Interrupted(signum, f"{signal.Signals(signum).name}: stopped while sampling; the run is finished and "
                                  f"saved in {newest_checkpoint(run.run_dir)} (write a sample with python "
                                  f"-m scripts.sample {run.run_dir})") from err
    if not (sample and run.ranks.is_main):
        return ""
    (run.run_dir / "sample.txt").write_text(sample)
    print(f"--- sample after {t.max_steps} steps ---\n{sample}\n---")
    return sample


def summary(run: Run, step: int, loss, val_loss, elapsed_s: float, sample: str) -> dict:
    return {"step": step, "loss": loss, "val_loss": val_loss, "backend": run.backend, "elapsed_s": elapsed_s,
            "sample": sample}
