"""Hugging Face export and import: tiny runs exported and loaded by transformers give our logits and
greedy tokens; random transformers models start our runs (model.init_from); every refusal is one line.
Skipped without transformers and safetensors (requirements-dev.txt installs them)."""
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_env, tiny_config
from data.config import DataConfig
from data.hf_tokenizer import folder_tokenizer, write_tokenizer
from data.tokenizers import GPT2_DIR, CharTokenizer, GPT2Tokenizer
from errors import UserError
from model import ModelConfig
from model.hf import FIELDS, GPT2, LLAMA, export_family, from_hf, to_hf
from training import pretrained
from training.checkpoint import load_checkpoint
from training.cli import compose_config, model_options_given
from training.config import validate
from training.loop import train
from training.trained_model import checkpoint_model, checkpoint_tokenizer, choose_checkpoint, plain_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

CPU = torch.device("cpu")
CORPUS = (REPO / "data" / "tinyshakespeare" / "input.txt").read_text()
LLAMA_OPTIONS = dict(pos="rope", norm="rmsnorm", mlp="swiglu", n_head=4, n_kv_head=2)
# name: (model options, tokenizer): both families, both tokenizers, GPT-2 with and without biases
RUNS = {"gpt2-bias-char": (dict(bias=True), "char"),
        "gpt2-nobias-bpe": (dict(bias=False), "gpt2"),
        "llama-bpe": (LLAMA_OPTIONS, "gpt2")}


def short_run(cache: str, run_dir: Path, tokenizer: str, steps: int = 3, **model):
    """Train the tiny model (dropout 0, ``model`` options) ``steps`` steps on Tiny Shakespeare with ``tokenizer``."""
    cfg = tiny_config(cache, max_steps=steps, batch_size=2, eval_interval=steps, eval_iters=1, ckpt_interval=steps)
    cfg.model = dataclasses.replace(cfg.model, **{"dropout": 0.0, **model})
    if tokenizer == "gpt2":
        cfg.data = DataConfig(cache_dir=cache)
    validate(cfg)
    train(cfg, run_dir)
    return cfg


def export(source: Path, out: Path, *extra: str) -> Path:
    from scripts import export_hf
    return export_hf.main([str(source), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def exported(tmp_path_factory, data_cache):
    """{name: (run folder, exported folder)} for RUNS, each trained 3 steps."""
    root = tmp_path_factory.mktemp("hf-export")
    out = {}
    for name, (options, tokenizer) in RUNS.items():
        short_run(data_cache, root / name, tokenizer, **options)
        out[name] = (root / name, export(root / name, root / f"{name}-hf"))
    return out


def ours_and_theirs(run: Path, folder: Path):
    path, state = choose_checkpoint(run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return checkpoint_model(path, state, CPU), checkpoint_tokenizer(state), theirs


@pytest.mark.parametrize("name", list(RUNS))
def test_transformers_gives_our_logits_and_greedy_tokens(exported, name, capsys):
    from scripts import sample

    ours, tokenizer, theirs = ours_and_theirs(*exported[name])
    assert type(theirs).__name__ == (LLAMA if name.startswith("llama") else GPT2).architecture
    ids = torch.randint(0, tokenizer.vocab_size, (2, ours.cfg.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids)[0] - theirs(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff

    prompt = torch.tensor([tokenizer.encode("ROMEO:")])
    greedy = theirs.generate(prompt, max_new_tokens=16, do_sample=False)[0].tolist()
    mine = ours.generate(prompt, 16, temperature=0, vocab_limit=tokenizer.vocab_size)[0].tolist()
    assert mine[:len(greedy)] == greedy and (len(greedy) == len(mine) or greedy[-1] == tokenizer.eot_id)
    capsys.readouterr()
    sample.main([str(exported[name][1]), "--prompt", "ROMEO:", "--tokens", "16", "--temperature", "0", "--device", "cpu"])
    out = capsys.readouterr()
    assert out.out.split("\n---")[0] == tokenizer.decode(mine)
    assert out.err.strip() == f"sampling from {exported[name][1]} ({type(theirs).__name__})"


def test_a_bias_free_gpt2_exports_zero_biases_and_the_padding_ids_are_never_generated(exported):
    _, folder = exported["gpt2-nobias-bpe"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    biases = [p for n, p in theirs.named_parameters() if n.endswith(".bias")]
    assert len(biases) == 2 * 2 + 4 * 2 + 1 and all(not b.any() for b in biases)  # ln_1/2, 4 Linear per block, ln_f
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(50257, 50304)) and generation["eos_token_id"] == 50256
    assert list(theirs.generation_config.suppress_tokens) == generation["suppress_tokens"]  # what generate applies
    assert theirs.config.vocab_size == 50304 and len(transformers.AutoTokenizer.from_pretrained(folder)) == 50257


def test_exported_tokenizers_load_with_auto_tokenizer_and_give_our_ids(exported):
    char = transformers.AutoTokenizer.from_pretrained(exported["gpt2-bias-char"][1])
    ids = char.encode(CORPUS)
    assert ids == CharTokenizer.from_text(CORPUS).encode(CORPUS) and char.decode(ids) == CORPUS
    for name in ("gpt2-nobias-bpe", "llama-bpe"):
        bpe = transformers.AutoTokenizer.from_pretrained(exported[name][1])
        text = CORPUS[:20000] + "  two spaces, a tab\t, é and 日本 \n\n"
        assert bpe.encode(text) == GPT2Tokenizer().encode(text) and bpe.decode(bpe.encode(text)) == text
        assert folder_tokenizer(exported[name][1]) == GPT2Tokenizer.identity


def test_a_bf16_export_holds_our_weights_rounded(exported, tmp_path):
    run, _ = exported["llama-bpe"]
    folder = export(run, tmp_path / "bf16", "--dtype", "bf16")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours, _, _ = ours_and_theirs(run, folder)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(theirs.get_input_embeddings().weight, ours.wte.weight.to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_exports_the_same_weights(exported, tmp_path):
    """An FSDP checkpoint folder (DCP shards + meta.pt), written here in one process, exports as its
    whole-model checkpoint does."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    run, whole = exported["gpt2-bias-char"]
    path, state = choose_checkpoint(run)
    sharded = tmp_path / "run" / "checkpoints" / "step_0000003"
    dcp.save({"model": state["model"]}, checkpoint_id=sharded, no_dist=True)
    torch.save({k: v for k, v in state.items() if k not in ("model", "optimizer", "sharded")}, sharded / "meta.pt")
    assert load_checkpoint(sharded)["sharded"]
    a = load_file(export(tmp_path / "run", tmp_path / "hf") / "model.safetensors")
    b = load_file(whole / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("options, window, message", [
    (dict(gate="forget"), None, "cannot export model.gate=forget: a model.pos=learned model exports as GPT-2"),
    (dict(pos="none"), None, "cannot export model.pos=none: Hugging Face export takes GPT-2 (norm=layernorm "
                             "pos=learned gate=none mlp=gelu n_kv_head=n_head) or Llama (norm=rmsnorm pos=rope "
                             "gate=none mlp=swiglu) models with the recipe's switches off and no attention.window"),
    (dict(mlp="swiglu"), None, "cannot export model.mlp=swiglu: a model.pos=learned model exports as GPT-2 "
                               "(GPT2LMHeadModel), which needs model.mlp=gelu"),
    (dict(n_kv_head=2), None, "cannot export model.n_kv_head=2: a model.pos=learned model exports as GPT-2 "
                              "(GPT2LMHeadModel), which needs n_kv_head equal to n_head (4)"),
    (dict(pos="rope", norm="layernorm", mlp="swiglu"), None, "cannot export model.norm=layernorm: a model.pos=rope "
                                                             "model exports as Llama (LlamaForCausalLM)"),
    ({}, 16, "cannot export attention.window=16: neither GPT-2 nor Llama has a sliding window"),
    (dict(qk_norm=True), None, "cannot export model.qk_norm=True: a model.pos=learned model exports as GPT-2"),
    (dict(pos="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False), None,
     "cannot export model.tie_embeddings=False: a model.pos=rope model exports as Llama"),
    (dict(mlp="relu2"), None, "cannot export model.mlp=relu2: a model.pos=learned model exports as GPT-2"),
], ids=["forget-gate", "no-positions", "learned-swiglu", "gqa-gpt2", "rope-layernorm", "window", "qk-norm",
        "untied-llama", "relu2"])
def test_what_neither_family_holds_is_refused_in_one_line(options, window, message):
    with pytest.raises(UserError) as err:
        export_family(dataclasses.replace(ModelConfig(n_head=4, n_embd=64), **options), window)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("options", [dict(bias=True), dict(bias=False), dict(LLAMA_OPTIONS, bias=True), LLAMA_OPTIONS],
                         ids=["gpt2-bias", "gpt2-nobias", "llama-bias", "llama-nobias"])
def test_the_mapping_round_trips_every_tensor(options):
    """to_hf then from_hf gives our weights back; a GPT-2 without biases comes back with zero ones."""
    cfg = dataclasses.replace(ModelConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128), **options)
    ours = {k: torch.randn_like(v) for k, v in plain_model(cfg, CPU).state_dict().items()}
    ours["lm_head.weight"] = ours["wte.weight"]
    family = export_family(cfg, None)
    back = from_hf(dataclasses.replace(cfg, bias=cfg.bias or family is GPT2), family, to_hf(cfg, family, ours), "x")
    assert all(torch.equal(back[k], v) for k, v in ours.items())
    assert all(not back[k].any() for k in set(back) - set(ours)) and len(set(back) - set(ours)) == (
        0 if cfg.bias or family is LLAMA else 2 * 2 + 4 * 2 + 1)


def test_every_model_option_is_classified_for_export_and_import():
    """A new ModelConfig option must say what each family holds and what model.init_from does with it."""
    assert set(FIELDS) == {f.name for f in dataclasses.fields(ModelConfig)}
    for family in (GPT2, LLAMA):
        assert export_family(dataclasses.replace(ModelConfig(), **({} if family is GPT2 else LLAMA_OPTIONS)),
                             None) is family


def test_refusals_of_the_export_script_are_one_line_with_exit_2(exported, tmp_path):
    run, _ = exported["gpt2-bias-char"]
    path, state = choose_checkpoint(run)
    state["config"]["attention"]["window"] = 16
    torch.save(state, tmp_path / "windowed.pt")
    proc = subprocess.run([sys.executable, "-m", "scripts.export_hf", str(tmp_path / "windowed.pt"), "--out",
                           str(tmp_path / "out")], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot export attention.window=16:"), proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match=r"^--out .*full exists and is not an empty folder; give a new folder"):
        export(run, tmp_path / "full")


def test_without_the_packages_export_and_import_name_the_pip_command(exported, monkeypatch):
    from training.hf_folder import read_weights

    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(UserError, match=r"^scripts/export_hf.py needs the safetensors package: "
                                        r"`pip install transformers safetensors`$"):
        export(exported["llama-bpe"][0], exported["llama-bpe"][0] / "never")
    with pytest.raises(UserError, match=r"^reading .*model.safetensors needs the safetensors package: `pip inst"):
        read_weights(exported["llama-bpe"][1], "x")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(UserError, match=r"^model.init_from=gpt2 \(a Hugging Face Hub name\) needs the huggingface_hub "
                                        r"package: `pip install huggingface_hub`$"):
        pretrained.locate("gpt2")


# ---- import: model.init_from ----

@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Random tiny models saved by transformers: GPT-2 (GPT-2's vocabulary, its tokenizer saved by
    transformers from GPT-2's vocab.json and merges.txt) and Llama (biases, GQA, no tokenizer)."""
    root = tmp_path_factory.mktemp("hf-import")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64))
    gpt2.save_pretrained(root / "gpt2")
    (root / "gpt2-files").mkdir()
    shutil.copy(GPT2_DIR / "encoder.json", root / "gpt2-files" / "vocab.json")
    shutil.copy(GPT2_DIR / "vocab.bpe", root / "gpt2-files" / "merges.txt")
    transformers.GPT2TokenizerFast.from_pretrained(root / "gpt2-files").save_pretrained(root / "gpt2")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=48, intermediate_size=ModelConfig(n_embd=48, mlp="swiglu").mlp_hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True))
    for p in llama.parameters():  # biases and norms start at 0 and 1: make every tensor count
        torch.nn.init.normal_(p, std=0.05)
    llama.save_pretrained(root / "llama")
    return {"gpt2": (root / "gpt2", gpt2.eval(), "gpt2"), "llama": (root / "llama", llama.eval(), "char")}


def import_config(cache: str, folder: Path, tokenizer: str, steps: int, **given):
    """A tiny run config started from ``folder``, with ``given`` model options as if on the command line."""
    cfg = tiny_config(cache, max_steps=steps, batch_size=2, eval_interval=steps, eval_iters=1, ckpt_interval=2)
    if tokenizer == "gpt2":
        cfg.data = DataConfig(cache_dir=cache)
    cfg.model = dataclasses.replace(cfg.model, init_from=str(folder), **given)
    cfg.model = pretrained.resolve(cfg.model, set(given) | {"init_from"})
    validate(cfg)
    return cfg


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_init_from_a_transformers_folder_gives_its_logits_then_trains_and_resumes(hf_models, data_cache, tmp_path,
                                                                                 name, capsys):
    folder, theirs, tokenizer = hf_models[name]
    cfg = import_config(data_cache, folder, tokenizer, steps=2, block_size=32, dropout=0.0)
    assert (cfg.model.n_layer, cfg.model.block_size, cfg.model.dropout) == (2, 32, 0.0)
    assert cfg.model.vocab_size == theirs.config.vocab_size and cfg.model.bias
    data_tokenizer = GPT2Tokenizer() if tokenizer == "gpt2" else CharTokenizer.from_text(CORPUS)
    source = pretrained.open_checked(str(folder), data_tokenizer)
    model = plain_model(cfg.model, CPU)
    origin = pretrained.load_weights(model, source)
    ids = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids)[0] - theirs(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff

    train(cfg, tmp_path)
    cfg.trainer.max_steps = 4
    train(cfg, tmp_path)
    out = capsys.readouterr().out
    assert f"weights from {folder} ({theirs.__class__.__name__}" in out and "resuming from" in out
    assert json.loads((tmp_path / "run.json").read_text())["init_from"] == origin
    assert ("tokenizer" in origin) == (name == "llama")  # the Llama folder carries none


def test_init_from_a_nanoflash_run_takes_its_shape_and_weights(exported):
    run, _ = exported["llama-bpe"]
    cfg = pretrained.resolve(ModelConfig(init_from=str(run), dropout=0.2), given={"init_from", "dropout"})
    assert (cfg.pos, cfg.mlp, cfg.kv_heads, cfg.vocab_size, cfg.dropout) == ("rope", "swiglu", 2, 50304, 0.2)
    model = plain_model(cfg, CPU)
    origin = pretrained.load_weights(model, pretrained.open_checked(str(run), GPT2Tokenizer()))
    path, state = choose_checkpoint(run)
    assert origin["format"] == "nanoflash checkpoint" and origin["step"] == 3
    assert all(torch.equal(v, state["model"][k]) for k, v in model.state_dict().items())


def test_the_command_line_may_not_contradict_the_folder_but_free_options_stay_free(hf_models):
    folder = str(hf_models["gpt2"][0])
    base = ModelConfig(init_from=folder, n_layer=3, block_size=16)
    assert pretrained.resolve(base, {"init_from"}).n_layer == 2  # a preset's or default value gives way
    assert pretrained.resolve(base, {"init_from", "block_size"}).block_size == 16  # a shorter context
    for given, message in (({"n_layer"}, "model.n_layer=3 contradicts model.init_from=.*, whose model has n_layer=2"),
                           ({"n_kv_head"}, "model.n_kv_head=1 contradicts"),
                           ({"block_size"}, "model.block_size=128 contradicts .* \\(or give at most 64\\)")):
        cfg = dataclasses.replace(base, n_kv_head=1 if "n_kv_head" in given else None,
                                  block_size=128 if "block_size" in given else 16)
        with pytest.raises(UserError, match=f"^{message}"):
            pretrained.resolve(cfg, given | {"init_from"})
    free = pretrained.resolve(dataclasses.replace(base, dropout=0.3, activation_checkpointing=True, loss_chunk=7),
                              {"init_from", "dropout", "activation_checkpointing", "loss_chunk"})
    assert (free.dropout, free.activation_checkpointing, free.loss_chunk) == (0.3, True, 7)


def test_which_model_options_the_command_line_sets():
    given = model_options_given(["model=tiny", "model.n_layer=3", "trainer.max_steps=2", "model.n_kv_head=null",
                                 "++model.dropout=0.1", "experiment=gpt2", "model.init_from=/x/y"])
    assert given == {"n_layer", "n_kv_head", "dropout", "init_from"}


def test_a_clash_on_the_command_line_stops_train_py_in_one_line(hf_models, tmp_path):
    """Through Hydra: the options given on the command line are read from its overrides."""
    proc = subprocess.run([sys.executable, "train.py", f"model.init_from={hf_models['gpt2'][0]}", "model.n_head=4",
                           f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"error: model.n_head=4 contradicts model.init_from={hf_models['gpt2'][0]}, whose model has "
                           "n_head=2: the model's shape comes from there; remove model.n_head\n")


def test_sources_that_cannot_start_a_run_are_refused_in_one_line(hf_models, tmp_path, monkeypatch):
    import huggingface_hub

    gpt2_folder, _, _ = hf_models["gpt2"]
    with pytest.raises(UserError, match=r"^model.init_from=.* was trained with the gpt2 tokenizer .*, but the data gives "
                                        r"the char tokenizer \(65 characters\): its token ids would mean other text"):
        pretrained.open_checked(str(gpt2_folder), CharTokenizer.from_text(CORPUS))
    with pytest.raises(UserError, match=r"^model.init_from=.*llama has 128 token ids, fewer than the 50257 of the "):
        pretrained.open_checked(str(hf_models["llama"][0]), GPT2Tokenizer())
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"^model.init_from=.*empty is neither a Hugging Face model folder \(it has no "
                                        r"config.json\) nor a nanoflash checkpoint"):
        pretrained.resolve(ModelConfig(init_from=str(tmp_path / "empty")), set())
    with pytest.raises(UserError, match=r"^model.init_from=.*nowhere: no such folder or checkpoint$"):
        pretrained.resolve(ModelConfig(init_from=str(tmp_path / "nowhere")), set())
    for name, config, message in (
            ("bert", {"model_type": "bert"}, "config.json has model_type='bert'; nanoflash loads gpt2 and llama models"),
            ("untied", {"model_type": "llama", "intermediate_size": 10944, "rms_norm_eps": 1e-5},
             "config.json has tie_word_embeddings=False"),
            ("wide", {"model_type": "llama", "intermediate_size": 5}, "config.json has intermediate_size=5")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        with pytest.raises(UserError, match=f"^model.init_from=.*{name}: {message}"):
            pretrained.resolve(ModelConfig(init_from=str(tmp_path / name)), set())

    def offline(repo_id, **_):
        assert repo_id == "gpt2"
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(UserError, match=r"^model.init_from=gpt2 is not a folder here and the Hugging Face Hub did not "
                                        r"give it \(LocalEntryNotFoundError\); where there is a network run `hf download "
                                        r"gpt2 --local-dir DIR`"):
        pretrained.resolve(ModelConfig(init_from="gpt2"), set())
    with pytest.raises(UserError, match=r"llama carries no tokenizer; nanoflash samples with GPT-2 BPE or a char"):
        pretrained.hf_model(hf_models["llama"][0], CPU)


def test_finetune_shakespeare_is_nanogpts_preset_with_the_shape_of_the_folder(hf_models, data_cache):
    cfg = compose_config(["experiment=finetune_shakespeare", f"model.init_from={hf_models['gpt2'][0]}",
                          f"data.cache_dir={data_cache}"])
    t, o = cfg.trainer, cfg.optim
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.block_size, cfg.model.dropout) == (2, 32, 64, 0.0)
    assert (cfg.data.name, cfg.data.tokenizer) == ("shakespeare", "gpt2")
    assert (t.batch_size, t.grad_accum, t.max_steps) == (1, 32, 20)
    assert (t.eval_interval, t.eval_iters, t.keep_best) == (5, 40, True)
    assert (o.lr, o.schedule, o.warmup_steps) == (3e-5, "constant", 0)


def test_the_char_tokenizer_files_tell_their_characters(tmp_path):
    write_tokenizer(CharTokenizer("ab\n "), tmp_path, 8)
    assert folder_tokenizer(tmp_path) == CharTokenizer("ab\n ").identity
