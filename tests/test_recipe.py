"""The small-GPT recipe's switches (docs/RECIPE.md): what each one builds, a run with all of them and
optim=muon on every attention backend, each alone, exact resume, and checkpoints that refuse another
recipe in one line."""
import dataclasses
import json
import shutil

import pytest
import torch

from conftest import RECIPE, check_a_short_run_learns, tiny_config
from errors import UserError
from model import GPT, ModelConfig
from model.attention import build_attention
from model.config import AttentionConfig
from training.checkpoint import load_checkpoint
from training.loop import train

CUDA = torch.cuda.is_available()


def gpt(n_layer=4, **switches) -> GPT:
    attention, _ = build_attention(AttentionConfig(), torch.device("cpu"))
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=16, vocab_size=64, dropout=0.0,
                           **switches), attention)


def test_every_weight_is_made_on_the_default_device():
    """A run makes its model on its device (training/run.py: with torch.device(device)); no part of any
    switch may be made on the CPU regardless (here: the meta device, which allocates nothing)."""
    with torch.device("meta"):
        model = gpt(n_layer=4, **RECIPE)
        gated = gpt(n_layer=2, mlp="swiglu", gate="forget", bias=True)
    tensors = [*model.parameters(), *model.buffers(), *gated.parameters(), *gated.buffers()]
    assert tensors and all(t.device.type == "meta" for t in tensors)


def test_qk_norm_gives_every_head_of_q_and_k_unit_rms():
    attn = gpt(qk_norm=True).blocks[0].attn
    x = 5 * torch.randn(2, 7, 16)
    q, k, v, _, packed = attn.project(x, None)
    for t in (q, k):
        torch.testing.assert_close(t.square().mean(-1), torch.ones(2, 7, 2), rtol=1e-4, atol=1e-4)
    assert packed is None and torch.equal(v, attn.c_attn(x).view(2, 7, 6, 8)[:, :, 4:])


def test_q_k_and_v_keep_the_projections_dtype_under_autocast():
    """The value tables are fp32 and autocast may norm in fp32: the backend still gets one dtype."""
    attn = gpt(qk_norm=True, value_embeds=1).blocks[0].attn
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v, _, _ = attn.project(torch.randn(2, 7, 16), None, torch.randn(2, 7, 16))
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16


def test_value_embeddings_serve_the_first_and_the_last_blocks_in_order():
    model = gpt(n_layer=6, value_embeds=2)
    assert [block.attn.ve_mix is not None for block in model.blocks] == [True, True, False, False, True, True]
    seen = {}
    for layer, block in enumerate(model.blocks):
        block.attn.register_forward_pre_hook(lambda m, args, layer=layer: seen.__setitem__(layer, args[3]))
    idx = torch.randint(0, 64, (1, 8))
    model(idx)
    tables = [table(idx) for table in model.value_embeds]
    assert seen[2] is None and seen[3] is None
    for layer, table in ((0, 0), (1, 1), (4, 0), (5, 1)):  # modded-nanogpt's 01...01
        assert torch.equal(seen[layer], tables[table])
    std = model.value_embeds[0].weight.std().item()
    assert std == pytest.approx(0.02 * 16 ** 0.5, rel=0.1)  # the scale of LayerNorm'd x times N(0, 0.02) weights


def test_unet_skips_add_block_i_output_to_the_input_of_block_n_minus_1_minus_i():
    model = gpt(n_layer=5, skips="unet")
    inputs, outputs = {}, {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0].clone()))
        block.register_forward_hook(lambda m, args, out, i=i: outputs.__setitem__(i, out.clone()))
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.5, 2.0]))
        model(torch.randint(0, 64, (1, 8)))
    torch.testing.assert_close(inputs[2], outputs[1])  # the middle block: no skip
    torch.testing.assert_close(inputs[3], outputs[2] + 2.0 * outputs[1])
    torch.testing.assert_close(inputs[4], outputs[3] + 0.5 * outputs[0])


def test_zero_init_and_an_untied_head_start_the_output_projections_and_the_head_at_zero():
    model = gpt(zero_init=True, tie_embeddings=False)
    assert model.lm_head.weight is not model.wte.weight and not model.lm_head.weight.any()
    assert all(not b.attn.c_proj.weight.any() and not b.mlp.c_proj.weight.any() for b in model.blocks)
    assert model.wte.weight.any() and model.blocks[0].attn.c_attn.weight.any()
    tied = gpt()
    assert tied.lm_head.weight is tied.wte.weight  # by default
    assert model.num_params() == gpt(tie_embeddings=False).num_params() < model.num_params(non_embedding=False)


def test_relu2_is_the_square_of_relu():
    mlp = gpt(mlp="relu2").blocks[0].mlp
    x = torch.randn(3, 16)
    torch.testing.assert_close(mlp(x), mlp.c_proj(torch.relu(mlp.c_fc(x)) ** 2))


def test_generated_logits_are_capped_and_the_loss_is_the_capped_logits_loss():
    model = gpt(logit_softcap=2.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(1000)  # raw logits far beyond the cap
    x = torch.randint(0, 64, (2, 8))
    logits, _ = model(x)
    assert 1.9 < logits.abs().max() <= 2.0
    _, loss = model(x, x)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.view(-1, 64), x.view(-1)))


@pytest.mark.parametrize("backend", ["naive", "hybrid", "tiled", "sdpa", "flash"])
def test_the_full_recipe_with_muon_trains_with_every_backend(tmp_path, data_cache, backend):
    """Every switch at once and optim=muon: every loss finite and the loss falls. flash runs under
    Triton's interpreter on the CPU (about 2.5 s a step), so for 3 steps there."""
    interpreted = backend == "flash" and not CUDA
    steps, batch, drop = (3, 4, 0.01) if interpreted else (12, 8, 0.3)
    check_a_short_run_learns(tmp_path, data_cache, backend, steps, batch, drop, optim="muon", **RECIPE)


@pytest.mark.parametrize("switch, backend", [
    ({"qk_norm": True}, "naive"), ({"mlp": "relu2"}, "hybrid"), ({"zero_init": True}, "tiled"),
    ({"logit_softcap": 5.0}, "sdpa"), ({"tie_embeddings": False}, "naive"), ({"value_embeds": 1}, "hybrid"),
    ({"skips": "unet"}, "tiled"), ({"optim": "muon"}, "sdpa"),
], ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else x)
def test_each_switch_alone_trains(tmp_path, data_cache, switch, backend):
    check_a_short_run_learns(tmp_path, data_cache, backend, 10, 8, 0.3, **switch)


def recipe_config(data_cache, **trainer):
    cfg = tiny_config(data_cache, **trainer)
    cfg.model = dataclasses.replace(cfg.model, **RECIPE)
    cfg.optim = dataclasses.replace(cfg.optim, name="muon", head_lr=5e-3, embed_lr=1e-2)
    return cfg


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_muon_and_every_switch_matches_the_uninterrupted_run_exactly(tmp_path, data_cache):
    """As tests/test_training.py's resume test: drop the last checkpoint, resume from step 10; every
    metric and the final weights must be bitwise equal (Muon's momentum is in the checkpoint)."""
    cfg = recipe_config(data_cache)
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(cfg, full)
    shutil.copytree(full, killed)
    (killed / "checkpoints" / "step_0000020.pt").unlink()
    train(cfg, killed)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in rs]  # noqa: E731
    assert strip(read_metrics(killed)) == strip(read_metrics(full))
    a = load_checkpoint(full / "checkpoints" / "step_0000020.pt")
    b = load_checkpoint(killed / "checkpoints" / "step_0000020.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    momenta = [s["momentum_buffer"] for s in a["optimizer"]["state"].values() if "momentum_buffer" in s]
    assert len(momenta) == 4 * cfg.model.n_layer and all(m.any() for m in momenta)
    info = json.loads((full / "run.json").read_text())
    assert 0 < info["first_step_in_job_s"] and len(info["steps_done_s"]) == 5


@pytest.mark.parametrize("change, message", [
    (lambda cfg: setattr(cfg.model, "tie_embeddings", True), "was made with model.tie_embeddings=False but this run "
                                                              "has model.tie_embeddings=True"),
    (lambda cfg: setattr(cfg.model, "logit_softcap", None), "this run changes model.logit_softcap 15.0 → None"),
    (lambda cfg: setattr(cfg.optim, "name", "adamw"), "was made with optim=muon; resume with the optimizer settings"),
    # the tables join the scalars' group at optim.lr (another value of a role's lr that is set keeps the
    # groups: test_a_checkpoint_resumes_under_the_runs_own_learning_rates)
    (lambda cfg: setattr(cfg.optim, "embed_lr", None), "was made with its parameters in other optimizer groups"),
], ids=["tie", "softcap", "optimizer", "groups"])
def test_a_checkpoint_of_another_recipe_is_refused_in_one_line(tmp_path, data_cache, change, message):
    cfg = recipe_config(data_cache, max_steps=2, ckpt_interval=2)
    train(cfg, tmp_path)
    cfg.trainer.max_steps = 4
    change(cfg)
    with pytest.raises(UserError, match=message):
        train(cfg, tmp_path)


def test_a_checkpoint_resumes_under_the_runs_own_learning_rates(tmp_path, data_cache):
    """The config's settings win over those saved with the optimizer state (here a new head lr)."""
    cfg = recipe_config(data_cache, max_steps=2, ckpt_interval=2, eval_interval=2)
    train(cfg, tmp_path)
    cfg.trainer.max_steps, cfg.optim.head_lr = 3, 7e-3
    from training.run import setup_run
    from training import distributed
    run = setup_run(cfg, tmp_path, distributed.Ranks(), torch.device("cpu"))
    head = next(g for g in run.optimizer.param_groups if any(p is run.model.lm_head.weight for p in g["params"]))
    assert head["lr_scale"] == pytest.approx(7e-3 / cfg.optim.lr)
    assert run.optimizer.state[run.model.lm_head.weight]["step"] == 2  # the moments came from the checkpoint
