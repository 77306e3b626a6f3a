"""What a resume may change: every option of the schema (training/config.py) sorted into one of four kinds.

- ``SHAPE``: the checkpoint cannot be loaded into the model, or its token ids would mean other text:
  refused.
- ``MEANING``: the model would compute or learn something else than the checkpoint was trained for
  (attention that sees fewer keys, other dropout, document masks): refused unless
  ``trainer.resume_changes=allow``, and then said.
- ``ORDER``: the batches the run is fed from here on change (their order, their size, or the corpus
  itself, fine-tuning): allowed, and said in one line.
- ``FREE``: how the rest of the run is carried out (its length, learning-rate schedule, device,
  logging, checkpointing, the attention backend that computes the same function): allowed silently.

A test fails when an option of the schema is missing here, so a new option must be sorted when it is
added. ``compare`` gives the changes between a checkpoint's config and this run's.
"""
from typing import Dict, List, Tuple

SHAPE, MEANING, ORDER, FREE = "shape", "meaning", "order", "free"

KINDS: Dict[str, str] = {
    # model/config.py
    "model.name": FREE,  # a label
    "model.n_layer": SHAPE,
    "model.n_head": SHAPE,
    "model.n_kv_head": SHAPE,
    "model.n_embd": SHAPE,
    "model.block_size": SHAPE,
    "model.vocab_size": SHAPE,
    "model.bias": SHAPE,
    "model.norm": SHAPE,
    "model.pos": SHAPE,
    "model.gate": SHAPE,
    "model.mlp": SHAPE,
    "model.tie_embeddings": SHAPE,  # an untied head is a weight of its own
    "model.value_embeds": SHAPE,  # tables of their own
    "model.skips": SHAPE,  # weights of their own
    "model.qk_norm": MEANING,
    "model.logit_softcap": MEANING,
    "model.zero_init": MEANING,  # the weights the run started from
    "model.dropout": MEANING,
    "model.attention_dropout": MEANING,
    "model.gate_bias_init": MEANING,  # the weights the run started from
    "model.init_from": MEANING,  # the weights the run started from
    "model.activation_checkpointing": FREE,  # the same function, recomputed
    "model.recompute_attention": FREE,  # the same function, its attention kept or recomputed
    "model.loss_chunk": FREE,
    "attention.name": FREE,  # every backend computes the same attention
    "attention.block_size": FREE,
    "attention.strict": FREE,
    "attention.kernel": FREE,  # the same attention, computed by another forward kernel
    "attention.window": MEANING,
    # data/config.py
    "data.tokenizer": SHAPE,
    "data.document_mask": MEANING,
    "data.source": ORDER,
    "data.path": ORDER,
    "data.hf_config": ORDER,
    "data.split": ORDER,
    "data.text_column": ORDER,
    "data.max_docs": ORDER,
    "data.val_fraction": ORDER,
    "data.name": FREE,  # the cache folder's label
    "data.cache_dir": FREE,
    "data.num_proc": FREE,
    # training/config.py
    "trainer.batch_size": ORDER,
    "trainer.grad_accum": ORDER,
    "trainer.seed": ORDER,
    "optim.name": FREE,  # another optimizer's state is refused on its own (training/checkpoint.py: check_optimizer)
    "optim.lr": FREE,
    "optim.head_lr": FREE,  # set or null, they group the parameters: checked with the optimizer's state
    "optim.embed_lr": FREE,
    "optim.scalar_lr": FREE,
    "optim.muon_lr": FREE,
    "optim.muon_momentum": FREE,
    "optim.muon_weight_decay": FREE,
    "optim.muon_cautious": FREE,
    "optim.muon_coefficients": FREE,
    "optim.muon_lr_scale": FREE,
    "optim.min_lr": FREE,
    "optim.weight_decay": FREE,
    "optim.betas": FREE,
    "optim.eps": FREE,
    "optim.warmup_steps": FREE,
    "optim.schedule": FREE,
    "optim.decay_fraction": FREE,
    "trainer.device": FREE,
    "trainer.dtype": FREE,
    "trainer.compile": FREE,
    "trainer.cuda_graph": FREE,
    "trainer.max_steps": FREE,
    "trainer.grad_clip": FREE,
    "trainer.eval_interval": FREE,
    "trainer.eval_iters": FREE,
    "trainer.log_interval": FREE,
    "trainer.ckpt_interval": FREE,
    "trainer.keep_checkpoints": FREE,
    "trainer.keep_best": FREE,
    "trainer.resume": FREE,
    "trainer.resume_changes": FREE,
    "trainer.peak_tflops": FREE,
    "trainer.vram_budget_gb": FREE,
    "trainer.distributed": FREE,  # the checkpoint's layout is checked on its own (training/checkpoint.py)
    "trainer.context_parallel": FREE,
    "trainer.max_bad_steps": FREE,
    "trainer.sample_tokens": FREE,
    "trainer.profile_steps": FREE,
    "trainer.run_name": FREE,
    "logger.name": FREE,
    "logger.progress": FREE,
    "logger.project": FREE,
    "logger.mode": FREE,
    "logger.entity": FREE,
}

Change = Tuple[str, object, object]  # (option, the checkpoint's value, this run's)
MISSING = object()


def compare(saved: dict, now: dict, defaults: dict) -> Dict[str, List[Change]]:
    """{kind: [(option, saved value, this run's value)]} of the options that differ between two configs
    (nested dicts as checkpoints hold them), in the order of KINDS. An option the saved config lacks (a
    checkpoint made before it existed) had its value in ``defaults`` (the schema's)."""
    found = {kind: [] for kind in (SHAPE, MEANING, ORDER, FREE)}
    for option, kind in KINDS.items():
        theirs, mine = lookup(saved, option), lookup(now, option)
        if theirs is MISSING:
            theirs = lookup(defaults, option)
        if theirs is not MISSING and theirs != mine:
            found[kind].append((option, theirs, mine))
    return found


def lookup(config: dict, option: str):
    """The value of the dotted ``option`` in ``config``, or MISSING."""
    node = config
    for part in option.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def listed(changes: List[Change]) -> str:
    """"trainer.batch_size 4 → 8, trainer.seed 1 → 2"."""
    return ", ".join(f"{option} {theirs} → {mine}" for option, theirs, mine in changes)
