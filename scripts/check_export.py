"""Export a run and check that transformers gives our greedy tokens: timings and agreement as a table.

    python -m scripts.check_export outputs/gpt2-sdpa-shakespeare --out check/ --tokens 100

Exports the run (scripts/export_hf.py) to <out>/hf, loads it with transformers in fp32 and bf16,
and decodes ``--tokens`` tokens greedily from ``--prompt`` with each; beside them the same from our
model in fp32 (in this process) and from `scripts/sample.py --temperature 0`: on the run and on the
exported folder in fp32, and on the run with its default precision (bf16 weights on a GPU). Prints, and writes to
<out>/check_export.json, the seconds of the export and of each load, and for every pair of decoders
whether the texts are equal and how many characters (and tokens, where both gave ids) agree before
the first difference. Needs transformers and safetensors.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file: the repository's packages import only under python -m
    print(f"error: run it from the repository's root as: python -m scripts.{Path(__file__).stem} ...", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402

from errors import import_optional  # noqa: E402
from scripts import export_hf  # noqa: E402
from scripts.sample import load_model  # noqa: E402
from training.exits import ArgumentParser, exit_on_error  # noqa: E402
from training.precision import resolve_device  # noqa: E402

HF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder or checkpoint")
    p.add_argument("--out", required=True, help="a new folder: hf/ and check_export.json go there")
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    return p.parse_args(argv)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def sample_script(path: Path, dtype: str, args) -> str:
    """The text `python -m scripts.sample --temperature 0 --dtype <dtype>` prints for ``path``."""
    proc = subprocess.run([sys.executable, "-m", "scripts.sample", str(path), "--prompt", args.prompt,
                           "--tokens", str(args.tokens), "--temperature", "0", "--device", args.device,
                           "--dtype", dtype], cwd=ROOT, capture_output=True, text=True, check=True)
    return proc.stdout.split("\n---")[0]


def agreement(a, b) -> int:
    """How many leading items (tokens or characters) ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(ids: dict, texts: dict) -> dict:
    """For every pair of decoders: whether their texts are equal, the characters they share before the
    first difference, and (where both gave ``ids``: the new tokens) the new tokens."""
    names = list(texts)
    pairs = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pair = {"same_text": texts[a] == texts[b], "agreeing_chars": agreement(texts[a], texts[b])}  # prompt included
            if a in ids and b in ids:
                pair["agreeing_tokens"] = agreement(ids[a], ids[b])
            pairs[f"{a} | {b}"] = pair
    return pairs


def main(argv=None) -> dict:
    args = parse_args(argv)
    transformers = import_optional("transformers", "scripts/check_export.py", "pip install transformers safetensors")
    device = resolve_device(args.device)
    folder, export_s = timed(lambda: export_hf.main([args.run, "--out", str(Path(args.out) / "hf")]))
    model, tokenizer = load_model(Path(args.run), device)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    ids = {"ours fp32": model.generate(prompt, args.tokens, temperature=0, vocab_limit=tokenizer.vocab_size)[0].tolist()}
    seconds = {"export": export_s}
    getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0])  # its imports, untimed
    for name, dtype in HF_DTYPES.items():
        theirs, seconds[f"load {name}"] = timed(
            lambda: transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval())
        with torch.no_grad():
            ids[f"transformers {name}"] = theirs.generate(prompt, max_new_tokens=args.tokens, do_sample=False)[0].tolist()
    texts = {name: tokenizer.decode(row) for name, row in ids.items()}
    ids = {name: row[prompt.shape[1]:] for name, row in ids.items()}
    for name, path, dtype in (("run", Path(args.run), "fp32"), ("hf", folder, "fp32"), ("run", Path(args.run), "auto")):
        texts[f"sample.py {name} {dtype}"] = sample_script(path, dtype, args)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "seconds": seconds,
              "prompt_tokens": prompt.shape[1],
              "new_tokens": {name: len(row) for name, row in ids.items()},
              "pairs": compare(ids, texts), "texts": texts}
    (Path(args.out) / "check_export.json").write_text(json.dumps(report, indent=1) + "\n")
    for key, value in seconds.items():
        print(f"{key:>12}: {value:.2f} s")
    for pair, result in report["pairs"].items():
        tokens = f", {result['agreeing_tokens']} new tokens" if "agreeing_tokens" in result else ""
        print(f"{pair:>36}: {'same text' if result['same_text'] else 'texts differ'} ({result['agreeing_chars']} "
              f"characters{tokens} agree)")
    return report


if __name__ == "__main__":
    with exit_on_error(stopped="stopped"):
        main()
