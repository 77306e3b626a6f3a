"""Generation with the KV cache (model/kv_cache.py, model/generate.py) against generation without it.

Greedy output with the cache must equal the uncached output token for token, for every attention
backend (which runs the prefill) and every model option the cache must follow: GQA, learned /
rotary / no positions, a sliding window, the forget gate, contexts past block_size (re-prefilled)
and several samples at once. On a CPU the decode step attends with the kernel's PyTorch reference;
one test runs our Triton kernel there under the interpreter, and the GPU tests the CUDA-graph and
compiled steps.
"""
import dataclasses

import pytest
import torch

from conftest import device_for
from kernels.flash_decoding import DecodeConfig
from kernels.flash_decoding import function as decode_function
from model import GPT, ModelConfig
from model import generate as generation
from model import kv_cache
from model.attention import BACKENDS, build_attention
from model.config import AttentionConfig

VOCAB = 64
PROMPT, NEW = 5, 20  # with block_size 16: 11 cached steps, then 9 tokens re-prefilled past the context


@dataclasses.dataclass(frozen=True)
class Setup:
    pos: str = "learned"
    n_kv_head: int = 4
    gate: str = "none"
    window: int = None

    @property
    def id(self) -> str:
        return f"{self.pos}-kv{self.n_kv_head}-gate_{self.gate}-W{self.window}"


PLAIN = Setup()
EVERYTHING = Setup(pos="rope", n_kv_head=2, gate="forget", window=6)
SETUPS = [PLAIN, EVERYTHING, Setup(pos="rope", n_kv_head=1), Setup(pos="none", gate="forget"),
          Setup(pos="learned", window=3), Setup(pos="none", n_kv_head=2, window=20)]


def model_for(setup: Setup, backend: str = "sdpa", block_size: int = 16, seed: int = 0, device: str = None) -> GPT:
    """A 2-layer model (head size 16: flash's least) whose attention weights are scaled up 8x, so
    that attention, not the token itself, decides the next token and greedy output does not settle
    into repeating one token. On the CPU unless ``device`` says otherwise (flash: where it runs)."""
    torch.manual_seed(seed)
    device = torch.device(device or device_for(backend))
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=setup.n_kv_head, n_embd=64, block_size=block_size, dropout=0.0,
                      vocab_size=VOCAB, pos=setup.pos, gate=setup.gate)
    attention, ran = build_attention(AttentionConfig(name=backend, window=setup.window, strict=True), device)
    assert ran == backend
    model = GPT(cfg, attention).to(device).eval()
    with torch.no_grad():
        for block in model.blocks:
            for weight in (p for p in block.attn.parameters() if p.dim() == 2):
                weight.mul_(8.0)
    return model


def prompt(model: GPT, batch: int = 3, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1)).to(model.wte.weight.device)


def greedy(model: GPT, idx: torch.Tensor, **options) -> torch.Tensor:
    return model.generate(idx, NEW, temperature=0, **options)


@pytest.mark.parametrize("setup", [pytest.param(s, id=s.id) for s in SETUPS])
def test_greedy_with_the_cache_equals_without(setup):
    model = model_for(setup)
    idx = prompt(model)
    uncached = greedy(model, idx, use_cache=False)
    assert len(set(uncached[0, PROMPT:].tolist())) > 3  # not a degenerate repetition
    assert torch.equal(greedy(model, idx), uncached)


BACKEND_CASES = [(b, s) for b in BACKENDS if b != "sdpa" for s in (PLAIN, EVERYTHING) if (b, s) != ("flash", PLAIN)]


@pytest.mark.parametrize("backend, setup", [pytest.param(b, s, id=f"{b}-{s.id}") for b, s in BACKEND_CASES])
def test_every_backend_prefills_for_the_cache(backend, setup):
    """A shorter run (flash runs under the interpreter on a CPU): a prompt of 12 tokens prefilled by
    the backend, then 3 tokens decoded from the cache."""
    model = model_for(setup, backend)
    idx = prompt(model, batch=2, length=12)
    cached, uncached = (model.generate(idx, 4, temperature=0, use_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached)


def test_samples_with_the_cache_equal_those_without_from_one_seed():
    """The same random numbers, drawn in the same order, pick the same tokens: top-k sampling too."""
    model = model_for(EVERYTHING)
    idx = prompt(model)

    def sample(**options):
        gen = torch.Generator().manual_seed(7)
        return model.generate(idx, NEW, temperature=0.9, top_k=10, vocab_limit=60, generator=gen, **options)

    cached = sample()
    assert torch.equal(cached, sample(use_cache=False)) and int(cached[:, PROMPT:].max()) < 60


def test_samples_of_one_prompt_prefill_it_once():
    """Samples of one prompt: the prefill runs at batch 1 and its keys, values and gates serve every row;
    the samples differ, and equal those of the uncached path from the same seed."""
    model = model_for(EVERYTHING)
    idx = prompt(model, batch=1).expand(3, -1)
    batches = []
    hook = model.blocks[0].register_forward_pre_hook(lambda block, args: batches.append(args[0].shape[0]))

    def sample(**options):
        return model.generate(idx, NEW, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(7),
                              **options)

    cached = sample()
    hook.remove()
    assert batches[0] == 1 and set(batches[1:]) == {3}
    assert torch.equal(cached, sample(use_cache=False)) and len({tuple(row) for row in cached.tolist()}) == 3


@pytest.mark.parametrize("length, new", [(1, 1), (16, 3), (23, 4), (4, 12)], ids=["one-token", "full-prompt",
                                                                                  "long-prompt", "fills-exactly"])
def test_prompts_at_and_past_the_context(length, new):
    """A prompt of block_size tokens or more starts re-prefilling at once; 4 + 12 = block_size fills the cache."""
    model = model_for(EVERYTHING)
    idx = prompt(model, batch=2, length=length)
    cached, uncached = (model.generate(idx, new, temperature=0, use_cache=c) for c in (True, False))
    assert cached.shape == (2, length + new) and torch.equal(cached, uncached)


def test_a_decode_step_gives_the_logits_of_the_whole_context():
    model = model_for(EVERYTHING)
    idx = prompt(model, length=12)
    cache = model.kv_cache(3, 12, idx.device)
    with torch.no_grad():
        model(idx[:, :9], cache=cache)
        for t in range(9, 12):
            logits, _ = model(idx[:, t:t + 1], cache=cache)
            whole, _ = model(idx[:, :t + 1])
            torch.testing.assert_close(logits, whole[:, -1:], rtol=1e-5, atol=1e-5)


def test_no_new_tokens_returns_the_prompt():
    model = model_for(PLAIN)
    idx = prompt(model)
    assert torch.equal(model.generate(idx, 0), idx)


def test_the_compiled_step_traces_as_one_graph(monkeypatch):
    """step="compile" traces the whole decode step with fullgraph=True (Dynamo only, on the CPU: Inductor's
    reduce-overhead graphs are measured on the GPU) and generates what eager does."""
    monkeypatch.setattr(generation, "COMPILE_OPTIONS", {"backend": "eager", "fullgraph": True})
    model = model_for(EVERYTHING)
    idx = prompt(model)
    assert torch.equal(greedy(model, idx, step="compile"), greedy(model, idx, step="eager"))


def test_the_model_decodes_with_our_kernel(monkeypatch):
    """The decode step through kernels/flash_decoding (under the interpreter on a CPU): q as slices of the
    fused projection, GQA, the gates' c, a window, and the cache's split over programs."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(kv_cache, "flash_decode_available", lambda t: True)
        monkeypatch.setattr(decode_function, "decode_config", lambda *args: DecodeConfig(3, 64, 4, 3))
    model = model_for(EVERYTHING, block_size=32, device="cuda" if torch.cuda.is_available() else "cpu")
    idx = prompt(model, batch=2)
    cache = model.kv_cache(2, 8, idx.device)
    assert cache.use_kernel
    assert torch.equal(model.generate(idx, 8, temperature=0), model.generate(idx, 8, temperature=0, use_cache=False))


@pytest.mark.parametrize("step, message", [("graphs", "step='graphs' is not one of auto, eager, graph, compile"),
                                           ("graph", "captures a CUDA graph and this generation runs on cpu")])
def test_a_step_that_cannot_run_is_refused(step, message):
    model = model_for(PLAIN)
    with pytest.raises(ValueError, match=message):
        model.generate(prompt(model), 2, step=step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("step", ["eager", "graph", "compile"])
@pytest.mark.parametrize("setup", [pytest.param(s, id=s.id) for s in (PLAIN, EVERYTHING)])
def test_cuda_steps_generate_what_the_uncached_model_does(step, setup):
    """On the GPU the decode step runs our kernel, eagerly, replayed as one CUDA graph, or compiled."""
    model = model_for(setup, device="cuda")
    idx = prompt(model)
    assert model.kv_cache(3, 8, idx.device).use_kernel
    assert torch.equal(greedy(model, idx, step=step), greedy(model, idx, use_cache=False))
