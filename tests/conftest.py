"""Shared fixtures: a token cache prepared once per session, and tiny training configs."""
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is defined: set it before any test module imports kernels/.
    os.environ["TRITON_INTERPRET"] = "1"

from data.config import DataConfig
from model.config import AttentionConfig, ModelConfig
from training.config import LoggerConfig, OptimConfig, TrainConfig, TrainerConfig

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """A cache folder shared by the tests that train on Tiny Shakespeare."""
    return str(tmp_path_factory.mktemp("token-cache"))


def tiny_config(cache_dir: str, **trainer) -> TrainConfig:
    """A model small enough to take a few steps per second on 2 CPU cores, char-level data."""
    t = dict(device="cpu", dtype="fp32", max_steps=20, batch_size=4, eval_interval=10, eval_iters=2,
             log_interval=5, ckpt_interval=10, keep_checkpoints=5, sample_tokens=0, run_name="test")
    t.update(trainer)
    return TrainConfig(
        model=ModelConfig(name="test", n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.1),
        attention=AttentionConfig(name="sdpa"),
        data=DataConfig(name="shakespeare_char", tokenizer="char", cache_dir=cache_dir),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5),
        trainer=TrainerConfig(**t),
        logger=LoggerConfig(progress=False),
    )


# Every model switch of the small-GPT recipe (docs/RECIPE.md), on, for a model of at least 2 layers.
RECIPE = dict(qk_norm=True, mlp="relu2", zero_init=True, logit_softcap=15.0, tie_embeddings=False, value_embeds=1,
              skips="unet", pos="rope", norm="rmsnorm")


def device_for(backend: str) -> str:
    """Where a test runs ``backend``: on the CPU when its row lists it, else on the GPU when there is
    one, else on the CPU emulated (flash under Triton's interpreter)."""
    from model.attention import BACKENDS

    devices = BACKENDS[backend].devices
    return "cpu" if devices is None or "cpu" in devices or not torch.cuda.is_available() else "cuda"


def emulated(backend: str) -> bool:
    """Whether ``backend`` runs here on a device its row does not list (Triton's interpreter): slow,
    so tests keep such runs short or leave them to the backend's own test files."""
    from model.attention import BACKENDS

    devices = BACKENDS[backend].devices
    return devices is not None and device_for(backend) not in devices


def backend_params(*, emulated_too: bool = True) -> list:
    """pytest params over every row of BACKENDS (with ``emulated_too=False``, those that run here
    on a device of their own), so a new backend joins the parametrised tests by itself."""
    from model.attention import BACKENDS

    return [pytest.param(name, id=name) for name in BACKENDS if emulated_too or not emulated(name)]


def check_a_short_run_learns(tmp_path, data_cache, backend: str, steps: int, batch: int, drop: float,
                             optim: str = "adamw", **model) -> None:
    """Train the tiny model ``steps`` steps of ``batch`` sequences with ``backend`` (strict), optimizer
    ``optim`` and the ``model`` settings (dropout 0 unless given): every loss finite, and the last below
    the first by more than ``drop``."""
    from training.config import validate
    from training.loop import train

    cfg = tiny_config(data_cache, max_steps=steps, batch_size=batch, log_interval=1, eval_interval=steps, eval_iters=1,
                      device=device_for(backend))
    cfg.model = dataclasses.replace(cfg.model, **{"dropout": 0.0, **model})
    cfg.optim.name = optim
    cfg.attention.name, cfg.attention.strict = backend, True
    validate(cfg)
    summary = train(cfg, tmp_path)
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert summary["backend"] == backend and len(losses) == steps and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - drop, losses


def run_env(gpu: bool = False) -> dict:
    """Environment for `python train.py` subprocesses: the repo importable (ahead of any PYTHONPATH
    already set, which may hold the packages), no wandb calls, and no GPU unless ``gpu`` (then the
    GPUs this process sees)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, WANDB_MODE="disabled")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("TRITON_INTERPRET", None)
    return env


QUICK = ["model=tiny", "data=shakespeare_char", "trainer.max_steps=2", "trainer.sample_tokens=0",
         "logger.progress=false", "trainer.eval_iters=1"]


def train_args(args, tmp_path) -> list:
    """train.py's arguments for a two-step tiny run in ``tmp_path`` plus ``args``."""
    return [*QUICK, f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", *args]


def run_train(args, tmp_path):
    """`python train.py` with a two-step tiny run in ``tmp_path`` plus ``args``; the finished process."""
    return subprocess.run([sys.executable, "train.py", *train_args(args, tmp_path)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)


WALKER = """
import contextlib, io, json, runpy, sys, traceback
results = []
for script, args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    err, out = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            if script.endswith(".py"):
                runpy.run_path(script, run_name="__main__")
            else:  # as `python -m` runs it: fresh, though an earlier case may have imported it
                sys.modules.pop(script, None)
                runpy.run_module(script, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = 0 if exit.code is None else exit.code
        except BaseException:
            traceback.print_exc(file=err)
            code = 1
    results.append([code, err.getvalue(), out.getvalue()])
print(json.dumps(results))
"""


def walk(cases, timeout: int = 600) -> list:
    """``cases``: [script, argv] each, run in turn in one Python process as `python <script> <argv>` (a
    path) or `python -m <script> <argv>` (a module, scripts.sample) runs it (runpy): [exit status,
    stderr, stdout] of each, in order. One process's imports
    serve every case, where a process per case pays 3-4 s of them on 2 CPU cores."""
    proc = subprocess.run([sys.executable, "-c", WALKER, json.dumps(cases)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def indexed(cases) -> list:
    """``cases`` (pytest.param each) as parameters of their index, with their ids and marks."""
    return [pytest.param(i, marks=case.marks, id=case.id) for i, case in enumerate(cases)]


def assert_one_error_line(stderr: str, message: str) -> None:
    """``stderr`` holds ``message``, no traceback and exactly one line starting with ``error:``."""
    assert message in stderr, stderr
    assert "Traceback" not in stderr
    assert len([line for line in stderr.splitlines() if line.startswith("error:")]) == 1, stderr


def walk_train(argvs, tmp_root: Path) -> list:
    """:func:`walk` of `python train.py` with each of ``argvs`` (run_train's tiny run, case i in
    ``tmp_root``/i): [exit status, stderr, stdout] of each."""
    return walk([[str(REPO / "train.py"), train_args(args, tmp_root / str(i))] for i, args in enumerate(argvs)])

