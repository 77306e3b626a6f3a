"""Tokenize a `data=` config ahead of time, with the same overrides as train.py.

    python -m scripts.prepare_data                                  # Tiny Shakespeare, GPT-2 BPE
    python -m scripts.prepare_data data=shakespeare_char
    python -m scripts.prepare_data data=hf data.path=./corpus/ data.num_proc=8
    python -m scripts.prepare_data data=hf data.path=HuggingFaceFW/fineweb-edu data.hf_config=sample-10BT data.max_docs=100000
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from data.prepare import prepare_from_config, summary  # noqa: E402
from training.cli import add_overrides, check_overrides  # noqa: E402
from training.config import register_configs  # noqa: E402
from training.exits import exit_on_error  # noqa: E402

register_configs()


@hydra.main(config_path=str(ROOT / "configs"), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with exit_on_error():  # in the job: an error escaping it would add Hydra's "Error executing job" line
        print(summary(prepare_from_config(cfg.data)))


if __name__ == "__main__":
    with exit_on_error():
        check_overrides(sys.argv[1:])
        quiet = ["hydra.run.dir=.", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
                 "~hydra.callbacks.run_folder"]  # no run folder: nothing is written to the current one
        sys.argv[1:] = add_overrides(sys.argv[1:], quiet)
        main()
