"""optim=muon (training/muon.py): the update against a float64 reference of the algorithm, against
torch.optim.Muon where PyTorch has it, a skipped and a clipped step, the parameter groups, and DDP
over two gloo processes."""
import dataclasses

import pytest
import torch

from gloo import on_gloo_ranks
from training.muon import JORDAN, POLAR_EXPRESS, MuonAdamW, orthogonalize


def reference_orthogonalize(u: torch.Tensor, coefficients) -> torch.Tensor:
    """The Newton-Schulz iteration in float64, written out: X <- a X + b (X X^T) X + c (X X^T)^2 X."""
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    norm = torch.linalg.matrix_norm(x)  # Frobenius
    x = x / (norm * 1.02 + 1e-6) if coefficients is POLAR_EXPRESS else x / max(norm, 1e-7)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if tall else x


def reference_muon(weight, grads, lr, momentum, weight_decay, cautious, coefficients, scale, row_splits):
    """Muon's steps on ``weight`` for each gradient of ``grads``, in float64 (see training/muon.py)."""
    w, buf = weight.double().clone(), torch.zeros_like(weight, dtype=torch.float64)
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        update = (1 - momentum) * g + momentum * buf
        start = 0
        for rows in row_splits or (w.shape[0],):
            part, o = w[start:start + rows], reference_orthogonalize(update[start:start + rows], coefficients)
            mask = (o * part >= 0).double() if cautious else torch.ones_like(part)
            part -= lr * weight_decay * part * mask
            factor = max(1.0, rows / w.shape[1]) ** 0.5 if scale == "shape" else 0.2 * max(rows, w.shape[1]) ** 0.5
            part -= lr * factor * o
            start += rows
    return w


def muon_group(weight, coefficients="polar_express", lr=0.05, momentum=0.9, weight_decay=0.0, cautious=False,
               scale="shape", row_splits=None):
    return {"params": [weight], "muon": True, "lr": lr, "lr_scale": 1.0, "momentum": momentum,
            "weight_decay": weight_decay, "cautious": cautious, "coefficients": coefficients,
            "lr_scale_kind": scale, "row_splits": row_splits}


def random_grads(shape, n, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(n)]


@pytest.mark.parametrize("coefficients", ["polar_express", "jordan"])
@pytest.mark.parametrize("shape, row_splits, weight_decay, cautious, scale", [
    pytest.param((6, 10), None, 0.0, False, "shape", id="wide"),
    pytest.param((12, 5), None, 0.3, False, "rms", id="tall-decay-rms"),
    pytest.param((16, 8), (8, 4, 4), 0.3, True, "shape", id="qkv-parts-cautious"),
])
def test_three_steps_match_the_float64_reference(coefficients, shape, row_splits, weight_decay, cautious, scale):
    """On the CPU the iteration runs in the parameters' dtype: float64 weights must match to rounding."""
    weight = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    start = weight.detach().clone()
    settings = dict(coefficients=coefficients, weight_decay=weight_decay, cautious=cautious, scale=scale,
                    row_splits=row_splits)
    opt = MuonAdamW([muon_group(weight, **settings)], fused=False)
    grads = random_grads(shape, 3)
    for g in grads:
        weight.grad = g.clone()
        opt.step()
    table = POLAR_EXPRESS if coefficients == "polar_express" else JORDAN
    want = reference_muon(start, grads, 0.05, 0.9, weight_decay, cautious, table, scale, row_splits)
    torch.testing.assert_close(weight.detach(), want, rtol=1e-12, atol=1e-12)
    assert not torch.equal(weight.detach(), start)


@pytest.mark.parametrize("coefficients", ["polar_express", "jordan"])
def test_singular_values_of_the_update_are_near_one(coefficients):
    u = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    s = torch.linalg.svdvals(orthogonalize(u, coefficients, torch.float32))
    assert 0.6 < s.min() and s.max() < 1.25, s


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs PyTorch >= 2.9")
@pytest.mark.parametrize("scale, torch_scale", [("shape", "original"), ("rms", "match_rms_adamw")])
def test_jordan_coefficients_with_plain_decay_are_torch_optim_muon(scale, torch_scale):
    """torch.optim.Muon iterates in bf16 and we in fp32 on the CPU: the updates agree to bf16's rounding
    (compounded over five steps: a few percent); a wrong scale, decay or momentum would be far off."""
    start = torch.randn(24, 16, generator=torch.Generator().manual_seed(3))
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt_ours = MuonAdamW([muon_group(ours, "jordan", lr=0.02, momentum=0.95, weight_decay=0.1, scale=scale)], fused=False)
    opt_theirs = torch.optim.Muon([theirs], lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn=torch_scale)
    for g in random_grads((24, 16), 3, dtype=torch.float32):
        for p, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            p.grad = g.clone()
            opt.step()
    moved_ours, moved_theirs = ours.detach() - start, theirs.detach() - start
    assert (moved_ours - moved_theirs).norm() / moved_theirs.norm() < 3e-2


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs PyTorch >= 2.9")
@pytest.mark.parametrize("shape", [(24, 16), (16, 24)])
def test_jordan_iteration_in_bf16_is_torch_optim_muons(shape):
    """The same iteration as torch.optim.Muon's (a private function of torch's, so skipped where a release
    drops it), equal within bf16's tolerance: two implementations need not round alike in every release."""
    from torch.optim import _muon

    if not hasattr(_muon, "_zeropower_via_newtonschulz"):
        pytest.skip(f"torch {torch.__version__} has no torch.optim._muon._zeropower_via_newtonschulz")
    g = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    theirs = _muon._zeropower_via_newtonschulz(g, JORDAN[0], len(JORDAN), 1e-7)
    torch.testing.assert_close(orthogonalize(g, "jordan", torch.bfloat16), theirs)  # bf16: rtol 1.6e-2


def test_a_skipped_step_moves_nothing_and_a_grad_scale_divides_the_gradient():
    weight = torch.nn.Parameter(torch.randn(8, 6, dtype=torch.float64))
    opt = MuonAdamW([muon_group(weight, weight_decay=0.2)], fused=False)
    weight.grad = torch.randn(8, 6, dtype=torch.float64)
    opt.step()
    before, buffer = weight.detach().clone(), opt.state[weight]["momentum_buffer"].clone()
    weight.grad = torch.full((8, 6), float("nan"), dtype=torch.float64)
    opt.found_inf = torch.ones((), dtype=torch.float64)
    opt.step()
    assert torch.equal(weight.detach(), before) and torch.equal(opt.state[weight]["momentum_buffer"], buffer)

    scaled, plain = (torch.nn.Parameter(before.clone()) for _ in range(2))
    g = torch.randn(8, 6, dtype=torch.float64)
    for p, grad, grad_scale in ((scaled, 3 * g, torch.tensor(3.0, dtype=torch.float64)), (plain, g, None)):
        opt = MuonAdamW([muon_group(p)], fused=False)
        opt.grad_scale, opt.found_inf = grad_scale, torch.zeros((), dtype=torch.float64)
        p.grad = grad
        opt.step()
    torch.testing.assert_close(scaled.detach(), plain.detach(), rtol=1e-12, atol=1e-14)


def tiny_gpt(**model):
    from model import GPT, ModelConfig
    from model.attention import build_attention
    from model.config import AttentionConfig

    attention, _ = build_attention(AttentionConfig(), torch.device("cpu"))
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0,
                           **model), attention)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest_each_role_at_its_lr():
    from training.config import OptimConfig
    from training.optim import build_optimizer, set_lr

    model = tiny_gpt(tie_embeddings=False, value_embeds=1, mlp="swiglu", gate="forget")
    opt = build_optimizer(model, OptimConfig(name="muon", lr=1e-3, muon_lr=0.04, head_lr=2e-3, embed_lr=0.1,
                                             scalar_lr=5e-3), torch.device("cpu"))
    lr_of = {id(p): (group["lr"], group["muon"], group.get("row_splits")) for group in opt.param_groups
             for p in group["params"]}
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert lr_of[id(attn.c_attn.weight)] == (0.04, True, (32, 16, 16))  # q, k, v rows orthogonalised apart
    assert lr_of[id(mlp.c_fc.weight)] == (0.04, True, (mlp.c_proj.in_features,) * 2)  # SwiGLU's gate and up
    assert lr_of[id(attn.c_proj.weight)] == (0.04, True, None)
    assert lr_of[id(model.lm_head.weight)] == (2e-3, False, None)
    assert lr_of[id(model.wte.weight)][:2] == lr_of[id(model.value_embeds[0].weight)][:2] == (0.1, False)
    assert lr_of[id(attn.gate_proj.weight)][:2] == lr_of[id(attn.ve_mix)][:2] == (5e-3, False)
    set_lr(opt, 5e-4)  # the schedule at half of optim.lr: every group at half of its own
    assert sorted({round(g["lr"], 9) for g in opt.param_groups}) == [1e-3, 2.5e-3, 0.02, 0.05]


def ddp_final_weights(rank: int, world: int) -> dict:
    """Three optimizer steps of a tiny recipe GPT under Muon with DDP over ``world`` gloo ranks (rank r
    takes rows r::world of each global batch of 4): {"start": the weights before, "end": after}."""
    from torch.nn.parallel import DistributedDataParallel

    from training.config import OptimConfig, TrainerConfig
    from training.optim import build_optimizer, set_lr
    from training.precision import make_grad_scaler
    from training.step import train_step

    model = tiny_gpt(qk_norm=True, mlp="relu2", value_embeds=1, skips="unet", logit_softcap=10.0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    step_model = DistributedDataParallel(model) if world > 1 else model
    opt = build_optimizer(model, OptimConfig(name="muon", muon_lr=0.05), torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (4, 17), generator=gen) for _ in range(3)]

    class Loader:
        def __init__(self):
            self.batches = iter(batches)

        def next_batch(self):
            rows = next(self.batches)[rank::world]
            return rows[:, :-1], rows[:, 1:], None

    loader = Loader()
    for _ in range(3):
        set_lr(opt, 1e-3)
        train_step(step_model, model, opt, make_grad_scaler(torch.device("cpu"), torch.float32), loader,
                   TrainerConfig(grad_accum=1), torch.device("cpu"), torch.float32)
    return {"start": start, "end": {k: v.clone() for k, v in model.state_dict().items()}}


def test_ddp_over_two_gloo_ranks_steps_like_one_process(tmp_path):
    """Every tensor within 1 % of the largest step it took. The ranks add their gradients in another
    order than one process does, and AdamW and Muon normalise each update, so an element whose
    gradient sums to about zero moves by what the rounding leaves: 6e-4 of a step on an AMD EPYC
    (2026-11-27: value_embeds.0.weight[24, 5], 1.8e-6 against 3.0e-3), where a 1e-6 tolerance failed.
    Ranks that never synchronise (each trains on its half) differ by 0.24-1.9 steps in every tensor."""
    two = on_gloo_ranks(ddp_final_weights, 2, tmp_path)["end"]
    one = ddp_final_weights(0, 1)
    for key, value in one["end"].items():
        step = (value - one["start"][key]).abs().max().item()
        torch.testing.assert_close(two[key], value, rtol=0, atol=1e-2 * step + 1e-7, msg=key)


def test_fsdp_is_refused_in_one_line(data_cache):
    from conftest import tiny_config
    from errors import UserError
    from training.config import validate

    cfg = tiny_config(data_cache, distributed="fsdp")
    cfg.optim = dataclasses.replace(cfg.optim, name="muon")
    with pytest.raises(UserError, match="optim=muon orthogonalises whole weight matrices, which "
                                        "trainer.distributed=fsdp splits"):
        validate(cfg)
