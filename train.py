"""Train a GPT: `python train.py [group=choice ...] [key=value ...]`.

Examples: `python train.py attention=flash`, `python train.py -m attention=naive,hybrid,sdpa,flash`,
`python train.py experiment=gpt2 data=hf data.path=roneneldan/TinyStories`. See README.md.
"""
import sys

import hydra
from omegaconf import DictConfig

from training.caches import keep_compiled_code
from training.cli import add_overrides, check_overrides, config_from_hydra, machine_defaults
from training.config import register_configs
from training.exits import exit_on_error
from training.loop import train
from training.metrics import imports_done

register_configs()


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with exit_on_error():  # in a job: a failed job of a sweep stops the sweep
        train(*config_from_hydra(cfg))


if __name__ == "__main__":
    imports_done()  # the run's start is timed from the command, phase by phase (training/metrics.py)
    keep_compiled_code()  # compiled code kept on disk between runs; torch reads it when it first compiles
    with exit_on_error():  # Hydra's own errors (composing, -cd, ...) and signals before the job
        check_overrides(sys.argv[1:])
        sys.argv[1:] = add_overrides(sys.argv[1:], machine_defaults(sys.argv[1:]))
        main()
