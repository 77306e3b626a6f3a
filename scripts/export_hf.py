"""Write a trained model as a Hugging Face folder that transformers loads with no custom code.

    python -m scripts.export_hf outputs/gpt2-sdpa-shakespeare --out hf/gpt2-shakespeare
    python -m scripts.export_hf outputs/run/checkpoints/step_0005000.pt --out hf/run --dtype bf16

The checkpoint is chosen as scripts/sample.py chooses it (a run folder: its best.pt, else its newest;
FSDP-sharded folders too). A model with learned positions, LayerNorm and the GELU MLP becomes a
GPT2LMHeadModel, one with RoPE, RMSNorm and SwiGLU a LlamaForCausalLM (model/hf.py); anything else is
refused in one line. --out gets config.json, generation_config.json (the padding ids above the
tokenizer's are never generated), model.safetensors and the tokenizer's files, so that
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load it
(and lm_eval --model hf --model_args pretrained=DIR). Needs `pip install transformers safetensors`.
"""
import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402


from model.hf import export_family, generation_config, hf_config, to_hf  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402
from training.hf_folder import check_out, require_export_packages, write_hf_folder  # noqa: E402
from training.checkpoint import validate_checkpoint  # noqa: E402
from training.trained_model import checkpoint_model, checkpoint_tokenizer, choose_checkpoint  # noqa: E402

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16")}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a run folder (its best.pt, else its newest checkpoint) or a checkpoint")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="of the written weights")
    return p.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out)
    check_out(out)
    require_export_packages()
    path, state = choose_checkpoint(Path(args.checkpoint))
    cfg = validate_checkpoint(path, state)
    family = export_family(cfg, state["config"]["attention"].get("window"))
    tokenizer = checkpoint_tokenizer(state)
    weights = checkpoint_model(path, state, torch.device("cpu")).state_dict()
    dtype, dtype_name = DTYPES[args.dtype]
    hf_weights = {name: tensor.to(dtype) for name, tensor in to_hf(cfg, family, weights).items()}
    write_hf_folder(out, hf_config(cfg, family, tokenizer.eot_id, dtype_name),
                    generation_config(tokenizer.eot_id, tokenizer.vocab_size, cfg.vocab_size), hf_weights, tokenizer,
                    cfg.block_size)
    print(f"exported {path} (step {state['step']}) as {family.architecture} ({args.dtype}) to {out} in "
          f"{time.perf_counter() - started:.1f} s")
    return out


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
