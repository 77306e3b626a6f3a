"""The measurement scripts on CPU: bench_attention (tables, files, plots, the correctness gate), the
pieces the bench scripts share, compare_runs (on a real multirun of experiment=compare_backends and on
hand-written runs), fit, plot_runs (the docs' plots from docs/runs), bench_context_parallel.sh's
arguments and its search for the longest sequence (against a fake GPU), and perf_round.sh's and
decode_round.sh's choice of steps."""
import csv
import importlib.util
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, indexed, run_env, walk
from model.attention import BACKENDS

CPU = torch.device("cpu")


def run(args, timeout=300, env=None):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env or run_env(), capture_output=True, text=True,
                          timeout=timeout)


def load_script(name):
    return importlib.import_module(f"scripts.{name}")


def markdown_table(text: str, heading: str):
    """The rows (lists of cells, header first) of the first markdown table after ``heading``."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not line.startswith("|---"):
            table.append([c.strip() for c in line.strip("|").split("|")])
    return table


def test_bench_attention_on_cpu_writes_tables_files_and_plots(tmp_path):
    proc = run(["-m", "scripts.bench_attention", "--device", "cpu", "--dtype", "fp32", "--B", "1", "--H", "2",
                "--D", "16", "--T", "32,64", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# cpu, torch ") and "triton" in proc.stdout.splitlines()[0]
    assert "# checked against float32 at (B,H,T,D)=(1, 2, 32, 16) (o, dq, dk, dv" in proc.stdout
    assert "# flash: n/a (" in proc.stdout and "# sdpa-cudnn: n/a (needs a CUDA GPU)" in proc.stdout
    progress = [line for line in proc.stdout.splitlines() if line.startswith("| fwd")]
    assert len(progress) == 2 * 2 * 3  # modes x lengths x (naive, hybrid, sdpa)
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert {r["backend"] for r in rows} == {"naive", "hybrid", "sdpa"}
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and float(r["tflops"]) > 0 and r["peak_mb"] == "" for r in rows)
    meta = json.loads((tmp_path / "results.json").read_text())["meta"]
    assert meta["device"] == "cpu" and meta["unavailable"]["flex"] == "needs a CUDA GPU"
    assert meta["check"]["sdpa"]["dv"] < 1e-4
    table = markdown_table((tmp_path / "summary.md").read_text(), "## fwd+bwd: TFLOP/s")
    assert table[0] == ["B", "H", "H_kv", "T", "D", "naive", "hybrid", "sdpa"]
    assert [r[3] for r in table[1:]] == ["32", "64"] and all(float(c) > 0 for r in table[1:] for c in r[5:])
    for name in ("bench_fwd.png", "bench_fwd_bwd.png"):
        assert (tmp_path / name).stat().st_size > 10_000

    again = tmp_path / "again"  # tables and plots from a saved results.json (e.g. one copied off a GPU machine)
    load_script("bench_attention").main(["--from-json", str(tmp_path / "results.json"), "--out", str(again)])
    assert (again / "summary.md").read_text() == (tmp_path / "summary.md").read_text()
    assert (again / "bench_fwd_bwd.png").stat().st_size > 10_000


def test_bench_attention_stops_when_a_backend_disagrees(capsys):
    bench = load_script("bench_attention")
    sdpa = bench.backends(CPU, ["sdpa"])["sdpa"]
    shape, Hkv = (1, 4, 32, 16), 2  # grouped-query attention: two query heads per key/value head

    def no_kernel(q, k, v):
        raise RuntimeError("No available kernel. Aborting execution.")

    found = {"sdpa": sdpa, "sdpa-fa2": no_kernel}
    errors = bench.check_backends(found, shape, Hkv, torch.float32, CPU, grads=True)
    assert set(errors["sdpa"]) == {"o", "dq", "dk", "dv"} and max(errors["sdpa"].values()) < 1e-5
    assert found["sdpa-fa2"].startswith("fails at the first shape (RuntimeError: No available kernel")

    with pytest.raises(SystemExit) as stop:
        bench.check_backends({"sdpa": sdpa, "wrong": lambda q, k, v: q * 1.0}, shape, Hkv, torch.float32, CPU, grads=False)
    assert stop.value.code == 1 and "wrong o relative error" in capsys.readouterr().err


def test_forced_sdpa_takes_heads_first_or_last_and_grouped_heads():
    from scripts.bench_common import forced_sdpa, relative_error

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=gen, dtype=torch.float64)  # (B, H, T, D)
    k, v = (torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64) for _ in range(2))  # two query heads per kv head
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 8 ** 0.5
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    expected = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v.repeat_interleave(2, dim=1)

    heads_first = forced_sdpa("MATH")(q, k, v)
    heads_last = forced_sdpa("MATH", heads_first=False)(*(x.transpose(1, 2) for x in (q, k, v)))
    assert relative_error(heads_first, expected) < 1e-6
    assert torch.equal(heads_last.transpose(1, 2), heads_first)
    with pytest.raises(AttributeError):
        forced_sdpa("NO_SUCH_KERNEL")


def test_plot_runs_draws_the_docs_plots_from_the_raw_runs(tmp_path):
    load_script("plot_runs").main(["--out", str(tmp_path)])
    for name in ("flash_anchors.png", "gpt2_end_to_end.png", "fit_gpt2.png", "cross_entropy.png", "scaling_2xh200.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_flex_is_compiled_for_static_shapes(monkeypatch):
    """One bench run times flex at several T: with Dynamo's automatic dynamic shapes the second T
    would get a shape-generic kernel, slower than what a model at one T runs."""
    bench = load_script("bench_attention")
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.update(kwargs) or fn)
    bench.flex_attention_fn()
    assert seen.get("dynamic") is False


def test_bench_attention_tables_the_replayed_graphs_beside_the_eager_calls():
    bench = load_script("bench_attention")
    point = {"mode": "fwd", "B": 1, "H": 2, "Hkv": 2, "T": 128, "D": 64, "peak_mb": None, "status": "ok"}
    rows = [{**point, "backend": "flash", "ms": 2.0, "tflops": 1.0, "graph_ms": 1.0, "graph_tflops": 2.0},
            {**point, "backend": "sdpa-fa2", "ms": 1.0, "tflops": 2.0, "graph_ms": 1.0, "graph_tflops": 2.0}]
    meta = {"device": "GPU", "torch": "t", "triton": "tr", "dtype": "bf16", "date": "d", "command": "c", "unavailable": {}}
    text = bench.summary(rows, meta)
    assert markdown_table(text, "## fwd: TFLOP/s (causal)")[1][-1] == "0.50x"
    assert markdown_table(text, "## fwd: TFLOP/s as replayed CUDA graphs")[1][-1] == "1.00x"
    assert "peak MB" not in text and "as replayed" not in bench.summary([{k: v for k, v in r.items()
                                                                          if not k.startswith("graph")} for r in rows], meta)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("args,message", [
    (["--device", "cpu", "--vram-budget-gb", "8"], "--vram-budget-gb caps GPU memory and needs a CUDA GPU"),
    (["--device", "cuda"], "--device cuda but PyTorch sees no CUDA GPU"),
    (["--device", "cpu", "--graphs"], "--graphs replays CUDA graphs and needs a CUDA GPU"),
])
def test_bench_attention_gpu_options_fail_clearly_without_cuda(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        load_script("bench_attention").main(args)
    assert stop.value.code == 2 and message in capsys.readouterr().err


# Each refusal of a wrong argument, before any work: (module, arguments with {tmp} for a scratch folder, the
# texts its stderr holds), all walked in one process. The ones that need the absence of a GPU (the
# script stops at once) are left out on a GPU machine.
NO_GPU = not torch.cuda.is_available()
NEEDS_CUDA = ["needs a CUDA GPU", "bench_attention.py --device cpu"]
REFUSALS = [
    *[pytest.param("scripts." + script, ["--out", "{tmp}", "--shapes", shapes], ["argument --shapes", "B,H,T,D"],
                   id=f"{script}-shapes={shapes}")
      for script in ("bench_flash", "profile_flash") for shapes in ("16,12,1024", "16,12,x,64", "16,12,0,64", ";")],
    *[pytest.param("scripts.bench_attention", ["--device", "cpu", "--backends", f"naive,{bad}"],
                   [f"{bad!r} is not a mode or backend"], id=f"bench_attention-backends={bad}")
      for bad in ("hybrid@", "hybrid@0", "hybrid@x", "tiledd")],
    *[pytest.param("scripts.bench_decode", ["--out", "{tmp}", option, "1,x"], [option, "positive whole numbers"],
                   id=f"bench_decode{option}") for option in
      ("--batches", "--kernel-batches", "--lengths", "--sweep-batches", "--sweep-lengths")],
    pytest.param("scripts.bench_flash", ["--gate", "--dropout", "0.1", "--out", "{tmp}"],
                 ["--dropout and --gate are separate measurements"], id="bench_flash-one-mode-at-a-time"),
    pytest.param("scripts.bench_flash", ["--out", "{tmp}"], ["bench_attention.py --preset anchors"],
                 id="bench_flash-no-mode"),  # the speed against SDPA is bench_attention's
] + ([
    pytest.param("scripts.fit", ["model=tiny"], ["needs a CUDA GPU"], id="fit-no-cuda"),
    pytest.param("scripts.bench_flash", ["--gate", "--out", "{tmp}"], NEEDS_CUDA, id="bench_flash--gate-no-cuda"),
    pytest.param("scripts.bench_flash", ["--hopper", "--out", "{tmp}"], NEEDS_CUDA, id="bench_flash--hopper-no-cuda"),
    pytest.param("scripts.profile_flash", ["--out", "{tmp}"], NEEDS_CUDA, id="profile_flash-no-cuda"),
    pytest.param("scripts.bench_cross_entropy", [], ["needs a CUDA GPU", "tests/test_cross_entropy.py"],
                 id="bench_cross_entropy-no-cuda"),
    pytest.param("scripts.bench_decode", ["--out", "{tmp}", "--parts", "kernel"],
                 ["needs a CUDA GPU", "tests/test_flash_decoding.py"], id="bench_decode-no-cuda"),
] if NO_GPU else [])


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """[exit status, stderr, stdout] of every REFUSALS case, walked in one process (conftest.walk)."""
    tmp = tmp_path_factory.mktemp("refusals")
    return walk([[case.values[0], [a.format(tmp=tmp) for a in case.values[1]]] for case in REFUSALS])


@pytest.mark.parametrize("case", indexed(REFUSALS))
def test_a_wrong_argument_is_refused_in_one_line_with_status_2(refused, case):
    code, stderr, _ = refused[case]
    assert code == 2 and all(text in stderr for text in REFUSALS[case].values[2]), stderr
    assert "Traceback" not in stderr


def test_bench_flash_first_call_table_holds_each_shape_to_its_target():
    bench = load_script("bench_flash")

    def run(first, tuning, tunes, notices=(), torch_first=2.5):
        return {"first_call_s": first, "tuning_s": tuning, "tunes": tunes, "configs": {"fwd": "64x64, 4 warps, 3 stages"},
                "notices": list(notices), "torch_first_backward_s": torch_first}

    rows = [{"shape": ["bf16", 2, 8, 512, 128], "cold": run(8.4, 1.9, 2), "warm": run(0.3, 0.0, 0)},
            {"shape": ["fp32", 2, 8, 512, 64], "cold": run(14.2, 0.0, 0, ["nanoflash: compiling x"]),
             "warm": run(0.2, 0.0, 0)},
            {"shape": ["fp16", 2, 8, 512, 80], "cold": run(10.6, 2.0, 2), "warm": run(0.3, 0.0, 0)},
            {"shape": ["bf16", 2, 8, 512, 64], "cold": run(6.0, 1.0, 1), "warm": run(1.1, 1.0, 1, torch_first=3.44)}]
    meta = {"device": "GPU", "torch": "t", "triton": "3.x", "date": "today", "commit": "abc1234",
            "command": "python -m scripts.bench_flash --first-call"}
    text = bench.first_call_table(rows, meta)
    table = markdown_table(text, "device: GPU")
    assert table[0][-3:] == ["target (cold)", "met", "torch's first backward, before the clock (cold / warm)"]
    assert [(r[0], r[4], r[5], r[6], r[-3], r[-2]) for r in table[1:]] == [
        ("bf16", "128", "8.4", "1.9 (2)", "10", "yes"), ("fp32", "64", "14.2", "0.0 (0)", "15", "yes"),
        ("fp16", "80", "10.6", "2.0 (2)", "10", "NO"), ("bf16", "64", "6.0", "1.0 (1)", "10", "NO")]
    assert table[1][-1] == "2.5 / 2.5" and table[4][-1] == "2.5 / 3.4"
    assert "  - `nanoflash: compiling x`" in text.splitlines()


def test_bench_flash_gate_records_and_table_show_costs_ratios_and_what_is_missing():
    bench = load_script("bench_flash")

    def times(fwd, fwd_bwd):
        return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}

    rows = [{"B": 16, "H": 12, "T": 1024, "D": 64, "ours": times(1.2, 4.0), "ours_no_gate": times(1.0, 3.2),
             "fla": times(2.4, 6.0), "fla_rel_err": {"o": 3e-3, "dq": 5e-3, "dk": 5e-3, "dv": 4e-3, "dg": 8e-3}},
            {"B": 4, "H": 12, "T": 2048, "D": 64, "ours": times(1.5, 5.0), "ours_no_gate": times(1.5, 4.0),
             "fla": {"error": "OutOfResources: shared memory"}, "fla_rel_err": {"o": 3e-3, "dg": 0.5}},
            {"B": 1, "H": 16, "T": 16384, "D": 128, "ours": times(9.0, 30.0), "ours_no_gate": times(8.0, 27.0)}]
    records = bench.gate_records(rows)
    assert [list(r) for r in records] == [bench.GATE_COLUMNS] * 3
    assert records[0]["gate_cost_fwd"] == pytest.approx(1.2) and records[0]["fla_over_ours_fwd_bwd"] == pytest.approx(1.5)
    assert records[0]["fla_agrees"] is True and records[1]["fla_agrees"] is False and records[2]["fla_agrees"] is None
    assert records[1]["fla_fwd_ms"] is None and records[1]["fla_over_ours_fwd"] is None

    meta = {"device": "GPU", "torch": "t", "triton": "3.x", "date": "today", "commit": "abc1234",
            "command": "python -m scripts.bench_flash --gate"}
    text = bench.gate_table(records, "flash-linear-attention: missing (ModuleNotFoundError: fla)", meta)
    assert "commit abc1234" in text and "flash-linear-attention: missing" in text
    table = markdown_table(text, "| B")
    assert table[0][-5:] == ["gate cost fwd", "gate cost fwd+bwd", "FLA/ours fwd", "FLA/ours fwd+bwd", "FLA agrees"]
    assert table[1][4:] == ["1.200", "4.000", "1.000", "3.200", "2.400", "6.000", "1.200x", "1.250x", "2.000x",
                            "1.500x", "yes"]
    assert table[2][8:10] == ["n/a", "n/a"] and table[2][-1] == "NO" and table[3][-1] == "n/a"


def test_bench_flash_hopper_table_gives_each_kernel_and_the_ratio_to_cudnn():
    bench = load_script("bench_flash")
    timed = {name: {"fwd_ms": f, "fwd_tflops": tf, "fwd_bwd_ms": fb, "fwd_bwd_tflops": tfb}
             for name, f, tf, fb, tfb in (("gluon", 0.5, 550.0, 2.0, 480.0), ("auto", 0.5, 550.0, 1.9, 505.0),
                                          ("tl", 0.6, 458.0, 2.4, 400.0), ("cudnn", 0.55, 500.0, 1.8, 533.0))}
    rows = [{"shape": [8, 16, 2048, 128], "max_diff_vs_tl": 0.0039, **timed}]
    meta = {"device": "GPU", "torch": "2", "triton": "3", "date": "d", "commit": "c",
            "command": "python -m scripts.bench_flash --hopper"}
    table = markdown_table(bench.hopper_table(rows, meta), "| B, H, T, D")
    assert table[1] == ["8, 16, 2048, 128", "fwd", "0.500", "0.500", "0.600", "0.550", "550", "550", "458", "500",
                        "1.10x", "1.10x", "3.90e-03"]
    assert table[2] == ["8, 16, 2048, 128", "fwd+bwd", "2.000", "1.900", "2.400", "1.800", "480", "505", "400", "533",
                        "0.90x", "0.95x", "3.90e-03"]


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs an sm90 GPU (H100/H200)")
def test_bench_flash_hopper_times_every_kernel_choice_cuda(tmp_path):
    proc = run(["-m", "scripts.bench_flash", "--hopper", "--shapes", "1,2,256,64", "--out", str(tmp_path)],
               env=run_env(gpu=True))
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "hopper.json").read_text())["rows"][0]
    assert row["max_diff_vs_tl"] < 0.05 and all(row[k]["fwd_bwd_ms"] > row[k]["fwd_ms"] > 0 for k in ("gluon", "auto", "tl", "cudnn"))


def test_decode_benchmark_gives_transformers_our_weights():
    """bench_decode's GPT2LMHeadModel computes our GPT-2's logits and greedy tokens (its static cache too)."""
    pytest.importorskip("transformers")
    from model import GPT, ModelConfig
    from model.attention import build_attention
    from model.config import AttentionConfig

    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, dropout=0.0, vocab_size=128)
    model = GPT(cfg, build_attention(AttentionConfig(name="sdpa"), CPU)[0]).eval()
    hf = load_script("bench_decode").hf_gpt2(model, CPU, torch.float32)
    idx = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], rtol=1e-5, atol=1e-5)
        ours = model.generate(idx, 8, temperature=0)
        theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, pad_token_id=0, cache_implementation="static", disable_compile=True)
    assert torch.equal(ours, theirs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_attention_on_gpu_under_a_budget(tmp_path):
    proc = run(["-m", "scripts.bench_attention", "--device", "cuda", "--B", "1", "--H", "2", "--D", "64", "--T", "256,512",
                "--modes", "fwd+bwd", "--vram-budget-gb", "2", "--backends", "naive,sdpa,flash,sdpa-fa2,sdpa-cudnn",
                "--graphs", "--out", str(tmp_path)], env=run_env(gpu=True))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert all(r["peak_mb"] is not None for r in rows if r["status"] == "ok")
    assert all(r["graph_tflops"] > 0 for r in rows if r["status"] == "ok" and r["backend"] in ("flash", "sdpa"))
    assert {r["backend"] for r in rows if r["status"] == "ok"} >= {"naive", "sdpa", "flash"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_flash_on_gpu_reports_every_host_piece_and_each_kernel(tmp_path):
    proc = run(["-m", "scripts.profile_flash", "--out", str(tmp_path), "--shapes", "1,2,256,64"],
               env=run_env(gpu=True))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "profile.json").read_text())
    assert "floor: round trip, our allocations, 3 empty launches" in report["host"]
    assert "autograd round trip of one built-in op (q * 2)" in report["host"]
    assert all(us > 0 for us in report["host"].values()), report["host"]
    found = report["shapes"]["(1, 2, 256, 64)"]
    assert set(found) == {"flash", "flash, forget gate", "sdpa-fa2", "sdpa-cudnn"}
    for r in found.values():
        assert 0 < r["enqueue_us"] <= r["back_to_back_us"] and r["kernels_sum_us"] > 0, r
    assert any("_attn_bwd_dkdv_kernel" in name for name in found["flash"]["kernels_us"])


def test_profile_flash_compare_table_has_a_row_per_tree_and_plain_launches_where_they_replay(tmp_path):
    profile = load_script("profile_flash")
    assert profile.replays(REPO) and not profile.replays(tmp_path)
    report = {"device": "GPU", "torch": "2", "triton": "3", "date": "d", "commit": "c", "host_shape": [1, 2, 128, 64],
              "rounds": 2, "host_compare": {".": {"a": [190.0, 180.0], "b": [5.0, 7.0]},
                                            "../base": {"a": [300.0, 320.0], "b": [6.0, 6.0]}}}
    table = markdown_table(profile.compare_markdown(report), "| tree")
    assert table == [["tree", "a", "b"], [".", "185 (190, 180)", "6 (5, 7)"], ["../base", "310 (300, 320)", "6 (6, 6)"]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_flash_compares_the_host_time_of_trees_with_and_without_replay(tmp_path):
    proc = run(["-m", "scripts.profile_flash", "--compare", ".", "--rounds", "1", "--out", str(tmp_path)],
               env=run_env(gpu=True))
    assert proc.returncode == 0, proc.stderr
    found = json.loads((tmp_path / "host.json").read_text())["host_compare"]
    assert set(found) == {".", "., plain launches"}
    for times in found.values():
        assert set(times) == {"flash_attn fwd+bwd", "flash_attn fwd+bwd, dropout 0.1", "flash_attn_qkvpacked fwd+bwd",
                              "sdpa FA2 fwd+bwd", "sdpa cuDNN fwd+bwd"}
        assert all(len(us) == 1 and us[0] > 0 for us in times.values())
    assert "| ., plain launches |" in (tmp_path / "host.md").read_text()


def test_compare_runs_reads_a_multirun_of_compare_backends(tmp_path, data_cache):
    sweep = tmp_path / "mr"
    proc = run(["train.py", "experiment=compare_backends", "model=tiny", "data=shakespeare_char",
                f"data.cache_dir={data_cache}", "trainer.max_steps=6", "trainer.batch_size=2", "trainer.log_interval=2",
                "trainer.eval_interval=3", "trainer.eval_iters=1", "trainer.sample_tokens=0", "logger.progress=false",
                f"hydra.sweep.dir={sweep}"], timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "cmp"
    load_script("compare_runs").main([str(sweep), "--out", str(out)])
    rows = list(csv.DictReader(open(out / "table.csv")))
    # One job per file of configs/attention/ (= per row of the backend table), in the sweep's (name) order.
    assert [r["backend"] for r in rows] == [f"{b} (ran sdpa)" if b == "flash" else b for b in sorted(BACKENDS)]
    assert all(r["steps"] == "6" and float(r["tokens_per_s"]) > 0 and float(r["wall_s"]) > 0 for r in rows)
    assert all(r["mfu"] == "" and r["peak_vram_mb"] == "" for r in rows)  # null on CPU
    assert len({r["train_loss"] for r in rows}) == 1  # same function, same losses on CPU
    table = markdown_table((out / "table.md").read_text(), "| run")
    assert table[0][:4] == ["run", "backend", "model", "tokens/s"] and len(table) == len(BACKENDS) + 1
    assert table[1][6] == table[2][6] and table[1][7] != "n/a"  # final train and val loss printed
    for name in ("loss_vs_step.png", "loss_vs_time.png", "throughput_memory.png"):
        assert (out / name).stat().st_size > 10_000


def write_run(folder, backend, ran, records):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"attention:\n  name: {backend}\nmodel:\n  name: gpt2\ntrainer:\n  max_steps: 30\n")
    (folder / "run.json").write_text(json.dumps({"attention": ran, "device": "NVIDIA H100 80GB HBM3", "dtype": "bf16"}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def train_record(step, loss, tokens_per_s, peak):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": tokens_per_s, "mfu": tokens_per_s / 1e6,
            "peak_vram_mb": peak, "elapsed_s": step / 10}


def test_compare_runs_summarises_hand_written_runs(tmp_path, capsys):
    parent = tmp_path / "multirun" / "2026-11-23"
    for job, backend, ran in ((10, "naive", "naive"), (2, "flash", "sdpa"), (0, "sdpa", "sdpa")):
        records = [train_record(10, 5.0, 1_000, 900), train_record(20, 4.0, 300_000, 1_000), {"step": 20, "val_loss": 4.5, "elapsed_s": 2.5},
                   train_record(30, 3.0, 400_000, 1_100), train_record(40, 2.5, 500_000, 1_000)]
        write_run(parent / f"{job}-{backend}", backend, ran, records)
    (parent / "notes").mkdir()  # a folder without metrics.jsonl is skipped
    load_script("compare_runs").main([str(tmp_path / "multirun")])
    table = markdown_table(capsys.readouterr().out, "| run")
    assert [r[0] for r in table[1:]] == ["2026-11-23/0-sdpa", "2026-11-23/2-flash", "2026-11-23/10-naive"]
    assert table[2][1:] == ["flash (ran sdpa)", "gpt2", "400,000", "40.0%", "1,100.0", "2.5000", "4.5000", "4.0", "40"]


def test_compare_runs_says_when_there_is_nothing_to_compare(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        load_script("compare_runs").main([str(tmp_path)])
    assert stop.value.code == 2 and "no run folders" in capsys.readouterr().err


def test_bench_attention_takes_tiled_forced_hybrid_blocks_and_times_compilation(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_attention")
    monkeypatch.setattr(torch, "compile", lambda fn: fn)  # the plumbing, not inductor (minutes on 2 CPU cores)
    bench.main(["--device", "cpu", "--dtype", "fp32", "--B", "1", "--H", "2", "--D", "16", "--T", "40",
                "--backends", "naive,tiled,hybrid,hybrid@16", "--compile", "hybrid", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "# checked against float32 at (B,H,T,D)=(1, 2, 40, 16)" in out
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [r["backend"] for r in rows if r["mode"] == "fwd"] == ["naive", "tiled", "hybrid", "hybrid@16"]
    assert all(r["status"] == "ok" for r in rows)
    compiled = json.loads((tmp_path / "results.json").read_text())["meta"]["compile"]["hybrid"]
    assert compiled["shape"] == [1, 2, 40, 16] and compiled["compile_s"] > 0 and compiled["status"] == "ok"
    assert "# compiled hybrid at (B,H,T,D)=(1, 2, 40, 16), fwd+bwd: first call" in (tmp_path / "summary.md").read_text()


def test_bench_attention_seed001_preset_picks_its_backends_and_compiles(monkeypatch, capsys):
    bench = load_script("bench_attention")
    monkeypatch.setattr(bench, "SEED001", [(1, 2, 24, 16)])  # the preset's GPU shapes take minutes on a CPU
    monkeypatch.setattr(torch, "compile", lambda fn: fn)
    bench.main(["--preset", "seed001", "--device", "cpu", "--dtype", "fp32", "--modes", "fwd"])
    out = capsys.readouterr().out
    table = markdown_table(out, "## fwd: median ms")
    assert table[0][5:] == list(bench.SEED001_BACKENDS)
    assert [line.split(" at ")[0] for line in out.splitlines() if line.startswith("# compiled")] == \
        ["# compiled naive", "# compiled hybrid"] * 2  # as measured, then again in the summary


def test_shape_lists_parse_into_b_h_t_d_tuples():
    from scripts.bench_common import parse_shapes

    assert parse_shapes("16,12,1024,64;4,12,2048,64;") == [(16, 12, 1024, 64), (4, 12, 2048, 64)]


# ---------------------------------------------------------------------------------------------
# bench_context_parallel.sh

CP_BENCH = REPO / "scripts" / "bench_context_parallel.sh"


@pytest.mark.parametrize("args,extra_env,why", [
    ([], {}, "name what to run"),
    (["bogus"], {}, "unknown: bogus"),
    (["longest", "2"], {}, "longest needs N and OUT"),
    (["longest", "two", "out"], {}, "N=two must be a positive integer"),
    (["longest", "2", "out"], {"START": "0"}, "START=0 must be a positive integer"),
    (["trial", "2", "12k", "out"], {}, "T=12k must be a positive integer"),
    (["curve-cp2"], {}, "curve-cp2 needs OUT"),
    (["longest", "2", "out"], {"DIST": "zero"}, "DIST=zero must be ddp or fsdp"),
])
def test_the_context_parallel_bench_refuses_bad_arguments_in_one_line(args, extra_env, why):
    proc = subprocess.run(["bash", str(CP_BENCH), *args], cwd=REPO, env=dict(run_env(), **extra_env),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and why in proc.stderr and "usage: bash scripts/" in proc.stderr


def longest_search(limit: int, mb_per_1k: int = 360, base_mb: int = 2000, gpu_mb: int = 143000):
    """``longest 2`` with trials on a fake GPU of ``gpu_mb`` where T tokens train up to ``limit`` and
    peak at base_mb + mb_per_1k * T / 1024: (the lengths tried, the answer printed)."""
    script = f"""
source {CP_BENCH}
gpu_memory_mb() {{ echo {gpu_mb}; }}
fits() {{
    if [ "$2" -le {limit} ]; then PEAK_MB=$(( {base_mb} + {mb_per_1k} * $2 / 1024 )); echo "| $1 | $2 | trains |"; return 0; fi
    echo "| $1 | $2 | out of memory |"; return 1
}}
longest 2 unused
"""
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    tried = [int(line.split("|")[2]) for line in proc.stdout.splitlines() if line.startswith("| 2 |")]
    return tried, int(re.search(r"at batch 1: (\d+) ", proc.stdout).group(1))


@pytest.mark.parametrize("limit", [393216, 350000, 600000, 200000, 100000])
def test_the_longest_search_ends_on_the_last_length_that_trains(limit):
    tried, answer = longest_search(limit)
    assert answer == limit // 16384 * 16384
    assert answer in tried and answer + 16384 in tried  # shown to train, and the next to run out of memory


def test_the_longest_search_needs_four_trials_where_memory_grows_on_the_measured_line():
    tried, answer = longest_search(393216)  # (143000 - 2000) MB / 360 MB per 1024 tokens -> 393216 at most
    assert tried == [131072, 262144, 393216, 409600] and answer == 393216


# ---------------------------------------------------------------------------------------------
# perf_round.sh

PERF_ROUND = REPO / "scripts" / "perf_round.sh"


@pytest.mark.parametrize("steps,why", [("tests bogus", "unknown step 'bogus'"), (" ", "STEPS is empty")])
def test_perf_round_refuses_unknown_steps_in_one_line_before_running_anything(tmp_path, steps, why):
    out = tmp_path / "round"
    proc = subprocess.run(["bash", str(PERF_ROUND)], cwd=REPO, env=dict(run_env(), OUT=str(out), STEPS=steps),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert why in proc.stderr and "tests profile anchors dropout gate first-call" in proc.stderr
    assert not out.exists()


def test_perf_round_runs_only_the_steps_named(tmp_path):
    out = tmp_path / "round"
    proc = subprocess.run(["bash", str(PERF_ROUND)], cwd=REPO, env=dict(run_env(), OUT=str(out), STEPS="dropout"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    log = (out / "run.log").read_text()
    assert "=== dropout (limit" in log and "=== dropout: exit" in log
    assert not any(f"=== {name} (limit" in log for name in ("tests", "profile", "anchors", "gate", "first-call"))
    assert sorted(p.name for p in out.iterdir()) == ["dropout.md", "run.log"]


# ---------------------------------------------------------------------------------------------
# decode_round.sh

@pytest.mark.parametrize("folder, steps, why", [
    (False, None, "usage: bash scripts/decode_round.sh OUT"),
    (True, "tests bogus", "unknown step 'bogus'"),
    (True, " ", "STEPS is empty"),
], ids=["no-folder", "unknown-step", "no-step"])
def test_decode_round_refuses_in_one_line_before_running_anything(tmp_path, folder, steps, why):
    out = tmp_path / "round"
    env = dict(run_env(), **({"STEPS": steps} if steps is not None else {}))
    proc = subprocess.run(["bash", "scripts/decode_round.sh", *([str(out)] if folder else [])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and why in proc.stderr, proc.stderr
    assert not out.exists()


def test_decode_benchmark_reads_each_cache_from_hbm_unless_told(monkeypatch):
    """Copies of a cache hold twice the L2 together (a 50 MB L2: 34 copies of 3 MB), one past it; one with --l2-warm."""
    bench = load_script("bench_decode")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=50 * 2**20))
    assert bench.cache_copies(3 * 2**20, l2_warm=False) == 34
    assert bench.cache_copies(2**30, l2_warm=False) == 1
    assert bench.cache_copies(3 * 2**20, l2_warm=True) == 1
