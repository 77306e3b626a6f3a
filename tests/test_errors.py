"""Each user mistake gets one clear line naming the option, a non-zero exit, and no traceback."""

import pytest

from conftest import assert_one_error_line, indexed, walk_train

CASES = [
    pytest.param(["attention=flsh"], "choose one of: flash, hybrid, naive, sdpa", id="unknown-backend"),
    pytest.param(["model=gpt3"], "choose one of: gpt2, gpt2-medium, small, tiny", id="unknown-model"),
    pytest.param(["model.n_layr=4"], "valid keys: activation_checkpointing", id="misspelt-model-key"),
    pytest.param(["trainer.bach_size=4"], "trainer has no key 'bach_size'", id="misspelt-trainer-key"),
    pytest.param(["lr=1e-3"], "the top level has no key 'lr'", id="unknown-top-level-key"),
    pytest.param(["model.n_embd=100", "model.n_head=3"], "model.n_embd=100 is not divisible by model.n_head=3", id="embd-not-divisible"),
    pytest.param(["model.n_kv_head=3"], "not a multiple of model.n_kv_head=3", id="kv-heads"),
    pytest.param(["trainer.device=cuda"], "trainer.device=cuda but PyTorch sees no CUDA GPU", id="cuda-without-gpu"),
    pytest.param(["trainer.dtype=fp16", "trainer.device=cpu"], "trainer.dtype=fp16 needs a CUDA GPU", id="fp16-on-cpu"),
    pytest.param(["trainer.dtype=fp8"], "trainer.dtype='fp8' is not one of auto, bf16, fp16, fp32", id="bad-dtype"),
    pytest.param(["trainer.batch_size=0"], "trainer.batch_size=0 must be a positive integer or auto", id="zero-batch"),
    pytest.param(["model.block_size=-1"], "model.block_size=-1 must be a positive integer", id="negative-block"),
    pytest.param(["model.loss_chunk=0"], "model.loss_chunk=0 must be a positive integer", id="zero-loss-chunk"),
    pytest.param(["trainer.cuda_graph=maybe"], "trainer.cuda_graph='maybe' must be true, false or auto", id="cuda-graph-word"),
    pytest.param(["optim.schedule=linear"], "optim.schedule='linear' is not one of cosine, wsd, constant", id="bad-schedule"),
    pytest.param(["attention=flash", "attention.strict=true"], "attention=flash cannot run", id="flash-strict-on-cpu"),
    pytest.param(["trainer.resume=/nonexistent/ckpt.pt"], "no such checkpoint; use trainer.resume=auto", id="missing-checkpoint"),
    pytest.param(["trainer.distributed=ddp"], "trainer.distributed=ddp runs under torchrun: torchrun --nproc_per_node=N",
                 id="ddp-without-torchrun"),
    pytest.param(["trainer.distributed=deepspeed"], "trainer.distributed='deepspeed' is not one of none, ddp, fsdp",
                 id="unknown-distributed-kind"),
    pytest.param(["trainer.distributed=ddp", "trainer.context_parallel=2", "attention=hybrid"],
                 "attention=hybrid does not run under context parallelism (ring attention); use attention=naive, sdpa "
                 "or flash (or trainer.context_parallel=1)", id="hybrid-under-context-parallel"),
]




@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    """Every case's `python train.py` run in one process (conftest.walk_train): [status, stderr, stdout] each."""
    return walk_train([case.values[0] for case in CASES], tmp_path_factory.mktemp("errors"))


@pytest.mark.parametrize("case", indexed(CASES))
def test_wrong_option_fails_with_one_clear_line(walked, case):
    code, stderr, _ = walked[case]
    assert code != 0
    assert_one_error_line(stderr, CASES[case].values[1])
