"""The benchmark harness: the README and docs show its latest run, and a figure runs end to end.

Timings are never asserted here (they belong in `make bench`); only that the
tools work and the table in the README and docs/performance.md is the
committed latest run's.
"""

import doctest
import json
import os
import subprocess
import sys

import pytest

from benchmarks import common, run, tpu_tuning
from spmd.topology import libtpu_available
from tests.multiprocess import ROOT
from trainers.reporting import matmul_peak


def _run_module(module: str, *args: str, **env: str) -> subprocess.CompletedProcess:
  """`python -m module args` from the repository root, killed after 300 s.

  With the suite's fast compile (tests/session_settings.py): these tests show
  that a figure's script runs end to end and what its row says, not the
  figure's value, which `make bench` measures on XLA's default pipeline.
  """
  return subprocess.run(
    ["timeout", "-k", "5", "300", sys.executable, "-m", module, *args],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
  )


def test_readme_and_performance_doc_show_the_latest_run():
  with open(run.LATEST) as f:
    rows = json.load(f)
  # Every registered figure, once `make bench` has run it (P10 came later),
  # and the chip's, merged from the TPU check's JSON.
  registered = {f for _, ids, _ in run.BENCHMARKS for f in ids} | set(run.TPU_FIGURES)
  assert {f"P{i}" for i in range(1, 9)} <= {r["id"] for r in rows} <= registered
  expected = f"<!-- bench:start -->\n{run.readme_block(rows)}<!-- bench:end -->"
  assert run.PERFORMANCE_DOC in run.TABLE_DOCS and run.README in run.TABLE_DOCS
  for doc in run.TABLE_DOCS:
    with open(doc) as f:
      text = f.read()
    assert expected in text, f"{doc} is stale: run make bench BENCH_ARGS=--update-readme"


def test_the_tpu_checks_json_merges_into_the_table_and_keeps_the_cpu_rows(tmp_path, monkeypatch):
  # What `--from-tpu-check=FILE --update-readme` does, on copies of latest.json and a document.
  report = {
    "device_kind": "TPU v5 lite",
    "jax": "0.10.2",
    "date": "2026-12-05",
    "command": "benchmarks/tpu_check.sh --tuning=/root/out/t.json --out=/root/out/c.json",
    "tuning": {"splash_fused_bwd": True},
    "p9_mfu": 0.625,
    "p4": 0.98,
    "trainer": {"steps": 30, "tokens_per_s": 35e3, "real_token_share": 1.0},
    "p11": {
      "rows": 4,
      "p11": 1.01,
      "ours_step_s": 0.25,
      "hand_step_s": 0.2475,
      "losses_ours": [10.4],
      "losses_hand": [10.4],
    },
    "rows": {
      "8": {
        "plan": {"fits": True, "total_bytes": 17.6e9, "step_time_s_range": [0.425, 0.668]},
        "device": {"compiled": True, "total_bytes": 17.6e9, "step_s": 0.46, "tokens_per_s": 35.6e3},
        "verdicts_agree": True,
        "pl1": 1.0,
      },
      "12": {"plan": {"fits": False}, "device": {"compiled": False}, "verdicts_agree": True},
    },
  }
  path = tmp_path / "tpu_check.json"
  path.write_text(json.dumps(report))
  # The shapes' runs (benchmarks/tpu_shapes.py), a file of their own merged after it.
  shape = {"goal": 0.58, "config": "configs/x.py", "params": 5.4e8, "rows": 8, "seq_len": 2048}
  shape.update(remat_policy="minimal", step_s=0.45, tokens_per_s=36e3, steps_timed=20)
  shapes = {
    "device_kind": "TPU v5 lite",
    "jax": "0.10.2",
    "date": "2026-12-07",
    "command": "benchmarks/tpu_shapes.sh --out=/root/out/s.json",
    "shapes": {
      "mha": {**shape, "figure": "P9-mha", "label": "without GQA", "mfu": 0.61},
      "long": {**shape, "figure": "P9-long", "label": "GQA", "mfu": 0.57, "seq_len": 4096},
      "moe": {**shape, "figure": "E-P9", "label": "with 8 experts", "mfu": 0.35, "goal": 0.4},
    },
  }
  shapes_path = tmp_path / "tpu_shapes.json"
  shapes_path.write_text(json.dumps(shapes))
  latest, doc = tmp_path / "latest.json", tmp_path / "doc.md"
  with open(run.LATEST) as f:
    cpu_rows = [r for r in json.load(f) if r["id"] not in run.TPU_FIGURES]
  latest.write_text(json.dumps(cpu_rows))
  doc.write_text("<!-- bench:start -->\nold\n<!-- bench:end -->\n")
  monkeypatch.setattr(run, "LATEST", str(latest))
  monkeypatch.setattr(run, "TABLE_DOCS", (str(doc),))
  monkeypatch.setattr(sys, "argv", ["run", f"--from-tpu-check={path}", "--update-readme"])
  run.main()
  only = "--only=P9-mha,p9-long,E-P9"
  monkeypatch.setattr(
    sys, "argv", ["run", f"--from-tpu-check={shapes_path}", only, "--update-readme"]
  )
  run.main()
  # The decode speeds (benchmarks/tpu_sample.py) and the eval's (benchmarks/tpu_evals.py).
  header = {"device_kind": "TPU v5 lite", "jax": "0.10.2", "date": "2026-12-07"}
  decode = {"figure": "S1", "batch": 1, "step_ms": 1.3893, "bound_ms": 1.1111, "goal": 0.8}
  sample = {
    **header,
    "command": "python3 -m benchmarks.tpu_sample --out=/root/out/s.json",
    "config": "configs/x.py",
    "prompt_len": 64,
    "tokens": 256,
    "hbm_gbps": 819.0,
    # 0.79975, which the script's own rounding to 3 places lifted to its goal
    "rows": [
      {**decode, "value": 0.8, "tokens_per_s": 719.8},
      {
        **decode,
        "figure": "S2",
        "batch": 32,
        "step_ms": 1.8948,
        "bound_ms": 1.3494,
        "goal": 0.6,
        "tokens_per_s": 16888.7,
      },
    ],
  }
  e1 = {**header, "command": "python3 -m benchmarks.tpu_evals", "figure": "E1", "goal": 2.0}
  e1.update(value=3.75, config="configs/x.py", train_tokens_per_s=36792.5)
  e1["eval"] = {"items": 1000, "choices": 4, "scored_tokens": 920246, "rows": 456}
  e1["eval"].update(row_fill=1.0, pass_s=6.7, tokens_per_s=138055.1)
  lora = {
    **header,
    "command": "python3 -m benchmarks.tpu_lora --out=/x/l.json",
    "figure": "L2",
    "rows": 4,
    "seq_len": 2048,
    "rank": 16,
    "l2": {"size": "d3072_l28", "params": 4.27e9, "tokens_per_s": 4100.0, "mfu": 0.4, "step_s": 2},
    "full_stops": {"size": "d1024_l16", "params": 5.06e8},
    "l3": {
      "size": "d1024_l16",
      "params": 5.06e8,
      "lora_step_s": 0.3,
      "full_step_s": 0.4,
      "value": 0.75,
    },
  }
  reports = (("s.json", sample, "S1,S2"), ("e1.json", e1, "E1"), ("l.json", lora, "L2,L3"))
  for name, report, figures in reports:
    (tmp_path / name).write_text(json.dumps(report))
    argv = ["run", f"--from-tpu-check={tmp_path / name}", f"--only={figures}", "--update-readme"]
    monkeypatch.setattr(sys, "argv", argv)
    run.main()
  rows = json.loads(latest.read_text())
  chip = {r["id"]: r for r in rows if r["id"] in run.TPU_FIGURES}
  assert set(chip) == set(run.TPU_FIGURES), sorted(chip)
  assert chip["S1"]["value"] == 0.7998 and not chip["S1"]["meets_goal"], chip["S1"]
  assert chip["E1"]["value"] == 3.75 and chip["E1"]["meets_goal"], chip["E1"]
  assert chip["L2"]["value"] == 4.27 and chip["L3"]["meets_goal"], (chip["L2"], chip["L3"])
  assert [r for r in rows if r["id"] not in run.TPU_FIGURES] == cpu_rows
  assert chip["P9"]["value"] == 0.625 and chip["P9"]["meets_goal"]  # goal 0.62
  assert (
    chip["PL3"]["value"] == 1.0
    and "12 rows: plan does not fit, chip refuses" in chip["PL3"]["detail"]
  )
  assert "`benchmarks/tpu_check.sh --tuning=t.json`" in chip["P11"]["machine"]
  others = ("P9-mha", "P9-long", "E-P9", "S1", "S2", "E1", "L2", "L3")
  from_check = [r for r in chip.values() if r["id"] not in others]
  assert all(r["date"] == "2026-12-05" for r in from_check)
  assert chip["P9-mha"]["meets_goal"] and not chip["P9-long"]["meets_goal"]
  assert chip["P9-long"]["date"] == "2026-12-07" and chip["P9-long"]["value"] == 0.57
  assert chip["E-P9"]["value"] == 0.35 and not chip["E-P9"]["meets_goal"]  # goal 0.40
  assert "`benchmarks/tpu_shapes.sh`" in chip["P9-mha"]["machine"]
  assert "540M Llama without GQA at 2048 tokens" in chip["P9-mha"]["what"], chip["P9-mha"]
  assert run.readme_block(rows) in doc.read_text()
  # A whole `make bench` run replaces the CPU rows and keeps the chip's.
  assert {r["id"] for r in run.merged(rows, cpu_rows[:1], replace_all=True)} == {
    cpu_rows[0]["id"],
    *run.TPU_FIGURES,
  }


def test_the_shapes_are_the_issues_llamas_and_their_figures_are_the_charts():
  """Issue 60's two more shapes: 300M-1B parameters, seq 1024-4096, one without GQA."""
  from benchmarks import tpu_shapes

  shapes = {name: tpu_shapes.facts(tpu_shapes.shape_config(name)) for name in tpu_shapes.SHAPES}
  for name, s in shapes.items():
    assert 300e6 <= s["params"] <= 1e9 and 1024 <= s["seq_len"] <= 4096, (name, s)
    # The MXU's width: every matmul dimension a multiple of 128.
    assert s["d_model"] // s["num_heads"] == 128 and s["d_ff"] % 256 == 0, (name, s)
    # Tokens enough to keep the MXU busy: the MHA shape's 6 x 2048 ran at 59.3 %
    # MFU on the chip, faster than at 8 rows (56.9 %), where memory was tight.
    assert s["rows"] * s["seq_len"] >= 12288, (name, s)
  assert shapes["mha"]["num_kv_heads"] == shapes["mha"]["num_heads"]
  assert shapes["long"]["seq_len"] == 4096
  figures = {shape.figure for shape in tpu_shapes.SHAPES.values()}
  assert figures <= set(run.TPU_FIGURES), figures


@pytest.fixture(scope="module")
def tiny_chip_runs(tmp_path_factory):
  """A corpus and a workdir whose prepared data the `--tiny` chip scripts share (read, not changed)."""
  from tests.data_fixtures import write_training_text

  root = tmp_path_factory.mktemp("tiny_chip_runs")
  # Enough files that the default 2 % holds one out for the run's eval.
  return {"source": write_training_text(root, files=100, words=200), "workdir": root / "runs"}


def test_the_shapes_mfu_is_spmd_trains_own_after_the_compile_and_merges(
  tmp_path, monkeypatch, tiny_chip_runs
):
  """P9-mha's CPU path (`benchmarks.tpu_shapes --tiny`), in this process: no process started.

  The figure is the run's own `mfu` from metrics.jsonl, without the first
  log interval's step (the compile's), and `--from-tpu-check` merges it.
  """
  from benchmarks import tpu_shapes
  from tests.session_settings import compilation_cache_dir
  from trainers.reporting.metrics import read_metrics

  source, runs = tiny_chip_runs["source"], tiny_chip_runs["workdir"]
  out = tmp_path / "tpu_shapes.json"
  shapes = ["--tiny", "--shapes=mha", "--steps=2", f"--out={out}", f"--workdir={runs}"]
  tpu_shapes.main([*shapes, f"--data_source={source}", f"--cache_dir={compilation_cache_dir()}"])
  mha = json.loads(out.read_text())["shapes"]["mha"]
  assert mha["num_kv_heads"] == mha["num_heads"] and mha["figure"] == "P9-mha", mha
  first, second = [r for r in read_metrics(runs / "mha" / "metrics.jsonl") if "mfu" in r]
  # The second interval's figure, read by its step, never by which is faster: with the
  # step in the compilation cache the first interval can be the faster one.
  assert (first["step"], second["step"]) == (1, 2), (first, second)
  assert mha["steps_timed"] == 1 and mha["mfu"] == second["mfu"], (mha, second)
  latest, doc = tmp_path / "latest.json", tmp_path / "doc.md"
  latest.write_text("[]")
  doc.write_text("<!-- bench:start -->\nold\n<!-- bench:end -->\n")
  monkeypatch.setattr(run, "LATEST", str(latest))
  monkeypatch.setattr(run, "TABLE_DOCS", (str(doc),))
  monkeypatch.setattr(sys, "argv", ["run", f"--from-tpu-check={out}", "--update-readme"])
  run.main()
  (row,) = json.loads(latest.read_text())
  assert row["id"] == "P9-mha" and row["value"] == round(mha["mfu"], 4), row
  assert "| P9-mha |" in doc.read_text()


def test_the_lora_chip_script_finds_its_sizes_and_merges_l2_and_l3(
  tmp_path, monkeypatch, tiny_chip_runs
):
  """`benchmarks.tpu_lora --tiny` in this process: the search, the runs from HF folders, the rows.

  Two sizes, no plan (the chip's plan is libtpu's, `--topology`): the
  larger runs under LoRA, then without it, so L2 is its LoRA run and L3
  the two runs' step times; `--from-tpu-check` merges both rows.
  """
  from benchmarks import tpu_lora
  from tests.session_settings import compilation_cache_dir

  source, runs = tiny_chip_runs["source"], tiny_chip_runs["workdir"]
  out = tmp_path / "tpu_lora.json"
  args = ["--tiny", "--steps=2", f"--out={out}", f"--workdir={runs}"]
  tpu_lora.main([*args, f"--data_source={source}", f"--cache_dir={compilation_cache_dir()}"])
  report = json.loads(out.read_text())
  largest = tpu_lora.TINY_FAMILY[-1].name
  assert report["l2"]["size"] == report["full_stops"]["size"] == largest, report
  size = report["sizes"][largest]
  assert "error" not in size["lora"] and "error" not in size["full"], size
  assert report["l3"]["value"] == size["lora"]["step_s"] / size["full"]["step_s"]
  assert not (runs / "folders" / largest).exists()  # gigabytes on the chip
  latest, doc = tmp_path / "latest.json", tmp_path / "doc.md"
  latest.write_text("[]")
  doc.write_text("<!-- bench:start -->\nold\n<!-- bench:end -->\n")
  monkeypatch.setattr(run, "LATEST", str(latest))
  monkeypatch.setattr(run, "TABLE_DOCS", (str(doc),))
  monkeypatch.setattr(sys, "argv", ["run", f"--from-tpu-check={out}", "--update-readme"])
  run.main()
  rows = {r["id"]: r for r in json.loads(latest.read_text())}
  assert set(rows) == {"L2", "L3"}, rows
  assert rows["L2"]["value"] == round(size["params"] / 1e9, 4) and not rows["L2"]["meets_goal"]
  assert f"full fine-tuning stops at {largest}" in rows["L2"]["detail"], rows["L2"]["detail"]
  assert "| L3 |" in doc.read_text()


def test_alternate_takes_medians_of_rounds_in_both_orders():
  order = []
  ours = iter([2.0, 4.0, 3.0])
  theirs = iter([1.0, 1.0, 2.0])

  def a():
    order.append("a")
    return next(ours)

  def b():
    order.append("b")
    return next(theirs)

  ratio, median_a, median_b = common.alternate(a, b, rounds=3)
  assert order == ["b", "a", "a", "b", "b", "a"]
  assert (ratio, median_a, median_b) == (2.0, 3.0, 1.0)


def test_the_shared_helpers_examples_hold():
  # benchmarks/ is not among pytest's doctest paths: its scripts set up JAX's
  # devices when imported. This module sets up nothing, so its examples run here.
  from benchmarks import tpu_shapes

  for module in (common, run, tpu_tuning, tpu_shapes):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0, module.__name__


def test_the_context_balance_figure_counts_each_shards_blocks(tmp_path):
  """C3 at a size where the natural order's imbalance is known by hand, then the table's JSON."""
  from benchmarks import context_balance

  assert doctest.testmod(context_balance).failed == 0
  # 4 shards of 64 tokens, blocks of 8: the natural order's last shard has
  # 8 query blocks reading 25..32 key blocks (228), the first 8 reading 1..8 (36).
  got = context_balance.counts(256, 4, 8)
  assert got["natural"] == [36, 100, 164, 228] and got["balanced"] == [132] * 4
  out = tmp_path / "c3.json"
  context_balance.main(["--length=256", "--shards=4", "--block=8", f"--json={out}"])
  c3, total = json.loads(out.read_text())
  assert (c3["id"], c3["value"], c3["meets_goal"]) == ("C3", 1.0, True)
  assert (total["id"], total["value"], total["meets_goal"]) == ("C3-total", 1.0, True)
  assert "the natural order 1.727" in c3["detail"], c3["detail"]


@pytest.mark.multiprocess
def test_the_fsdp_memory_figure_runs_end_to_end(tmp_path):
  out = tmp_path / "p7.json"
  done = _run_module(
    "benchmarks.memory", "--config=configs/lm_tiny_bytes.py", f"--json={out}", BENCH_DEVICES="2"
  )
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  [row] = json.loads(out.read_text())
  assert row["id"] == "P7" and row["value"] > 0 and "| P7 |" in done.stdout


@pytest.mark.multiprocess
def test_the_hf_import_figure_runs_end_to_end_on_one_layer(tmp_path):
  """2 processes import a 1-layer folder of 4096 ids (about 0.06B parameters), report their RSS rise."""
  out = tmp_path / "i1.json"
  done = _run_module(
    "benchmarks.hf_import",
    "--layers=1",
    "--vocab-size=4096",
    "--processes=2",
    f"--workdir={tmp_path / 'hf'}",
    f"--json={out}",
  )
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  [row] = json.loads(out.read_text())
  assert row["id"] == "I1" and row["value"] > 0 and "| I1 |" in done.stdout
  assert not (tmp_path / "hf" / "llama_1_layers").exists()  # the random folder is removed


@pytest.mark.multiprocess
def test_the_step_figures_run_end_to_end_on_a_shrunken_lm_small(tmp_path):
  # The same script measures P1 and MFU on a GPU (`BENCH_PLATFORM=cuda
  # ... --model=lm_small`); here on CPU with the model shrunk, to show it runs,
  # and the peak's square matmuls too (a 2048 one's QR alone took seconds).
  out = tmp_path / "steps.json"
  shrunk = ["--model=lm_small", "--global-batch=2", "--seq-len=32", "--num-layers=1"]
  shrunk.append("--matmul-size=1024")
  done = _run_module(
    "benchmarks.trainer", *shrunk, "--rounds=2", "--steps=1", f"--json={out}", BENCH_DEVICES="1"
  )
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  rows = {r["id"]: r for r in json.loads(out.read_text())}
  assert set(rows) == {"P1", "P3"} and rows["P1"]["value"] > 0 and rows["P3"]["value"] > 0
  assert "lm_small (" in rows["P1"]["detail"], rows["P1"]["detail"]
  # P3's ceiling on this machine: square matmuls alone, by the same estimate.
  assert "square matmuls alone" in rows["P3"]["detail"], rows["P3"]["detail"]
  # And on one device, the step's own dots replayed without the rest of the step.
  assert "the step's own matmuls alone" in rows["P3"]["detail"], rows["P3"]["detail"]


@pytest.mark.multiprocess
def test_the_llama_figure_runs_end_to_end_on_a_shrunken_shape(tmp_path):
  # P10 at the peer shape takes minutes; shrunk, it still checks that both
  # steps agree on their first losses before timing them.
  out = tmp_path / "p10.json"
  shrunk = ["--global-batch=2", "--seq-len=16", "--num-layers=1", "--rounds=2", "--steps=1"]
  done = _run_module("benchmarks.llama", *shrunk, f"--json={out}")
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  [row] = json.loads(out.read_text())
  assert row["id"] == "P10" and row["value"] > 0, row
  assert "first losses agree" in row["detail"] and "GFLOP/s" in row["detail"], row["detail"]


@pytest.mark.multiprocess
@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (the tpu extra)")
def test_the_pod_memory_figure_runs_end_to_end_on_a_shrunken_llama(tmp_path):
  # M1 compiles Llama-3-8B for v5p-256 twice (minutes); a tiny Llama at 128
  # tokens (one splash block) on v5p-8 takes the same path: splash through
  # libtpu, then xla. One row a chip: libtpu's compile time grows with the rows
  # (8 rows took 27 CPU s, 4 took 20) and with the tokens a chip holds.
  out = tmp_path / "m1.json"
  shrunk = ["--config=configs/llama_tiny.py", "--topology=v5p-8", "--seq-len=128"]
  done = _run_module("benchmarks.pod_memory", *shrunk, "--global-batch=4", f"--json={out}")
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  rows = {r["id"]: r for r in json.loads(out.read_text())}
  assert set(rows) == {"M1", "M1-xla"} and rows["M1"]["value"] > 0 and rows["M1-xla"]["value"] > 0
  assert rows["M1"]["detail"].startswith("splash: "), rows["M1"]["detail"]
  assert rows["M1-xla"]["detail"].startswith("xla: "), rows["M1-xla"]["detail"]


@pytest.mark.multiprocess
@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (the tpu extra)")
def test_the_context_memory_figure_runs_end_to_end_on_a_shrunken_llama(tmp_path):
  # C1 compiles Llama-3-8B at 131k tokens for v5p-256 (minutes); a tiny Llama
  # at 256 tokens on v5p-8 takes the same path: context=2, splash per shard
  # (one block of 128 each; libtpu's compile time grows with the tokens).
  out = tmp_path / "c1.json"
  shrunk = ["--config=configs/llama_tiny.py", "--topology=v5p-8", "--seq-len=256"]
  mesh = "--ici=data=1,fsdp=2,context=2,tensor=1"
  done = _run_module(
    "benchmarks.context_memory", *shrunk, mesh, "--global-batch=2", f"--json={out}"
  )
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  [row] = json.loads(out.read_text())
  assert row["id"] == "C1" and row["value"] > 0, row
  assert row["detail"].startswith("splash: "), row["detail"]


@pytest.mark.multiprocess
@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (the tpu extra)")
def test_the_moe_figures_run_end_to_end_on_a_shrunken_mixtral(tmp_path):
  # E-M1 and E-M2 compile Mixtral 8x7B for v5p-256 (minutes); two layers of 4
  # small experts on v5p-8 take the same path: the plan through libtpu, then
  # the step's grouped matmuls traced and each compiled alone. One row a chip,
  # not mixtral_tiny's 8 rows: libtpu's compile time grows with the rows, and
  # both ratios are the same at 4 rows and 8 (27 CPU s at 8, 20 at 4).
  out = tmp_path / "em.json"
  shrunk = ["--config=tests/configs/mixtral_tiny.py", "--topology=v5p-8", "--global-batch=4"]
  done = _run_module("benchmarks.moe_memory", *shrunk, f"--json={out}")
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  rows = {r["id"]: r for r in json.loads(out.read_text())}
  assert set(rows) == {"E-M1", "E-M2", "E-M2-cf1.25"}, rows
  # A routed step compiles for a slice of more than one chip (libtpu refused the
  # per-batch-shard ragged dots a vmap gave a batch dimension).
  e_m1 = rows["E-M1"]
  assert (e_m1["value"] or 0) > 0 and "libtpu refuses" not in e_m1["detail"], e_m1
  # Dropless, the routed rows are the active parameters' FLOPs exactly. The
  # step is for a TPU and its shapes tile, so each chip's routing (in a
  # shard_map) runs megablox's kernels, counted from the group sizes: gmm for the
  # rows and tgmm for the weight gradients; XLA's ragged dot there would run the
  # weight gradients densely over the 4 experts: (6 + 3 x 4) / 9 = 2.0.
  e_m2 = rows["E-M2"]
  assert "9 of them megablox's (3 tgmm for the weight gradients, 6 gmm" in e_m2["detail"], e_m2
  assert "the routed rows alone (group sizes) 1.000" in e_m2["detail"], e_m2
  assert e_m2["value"] == pytest.approx(1.0, rel=0.01), e_m2
  assert rows["E-M2-cf1.25"]["value"] == 1.25, rows["E-M2-cf1.25"]


@pytest.mark.multiprocess
@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (the tpu extra)")
def test_the_lora_memory_figure_flips_the_verdicts_on_one_layer_of_llama3_8b(tmp_path):
  # L1 compiles Llama-3-8B for v5e-8 twice (minutes). One of its layers at 256
  # tokens on one v5e chip keeps its 128k-row tables (1.27B parameters): full
  # fine-tuning's float32 state alone (16 B a parameter) overflows the chip and
  # LoRA's bf16 weights do not, so both verdicts are the compiler's, as L1's.
  out = tmp_path / "l1.json"
  shrunk = ["--topology=v5e-1", "--num-layers=1", "--seq-len=256"]
  done = _run_module("benchmarks.lora_memory", *shrunk, f"--json={out}")
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  [row] = json.loads(out.read_text())
  assert row["id"] == "L1" and 0 < row["value"] < 0.5 and row["meets_goal"] is True, row
  assert row["goal"] == "full does not fit, LoRA fits"
  lora, full = row["detail"].split("; full ")
  assert lora.startswith("LoRA ") and "fits (by the compiler)" in lora, row["detail"]
  assert "does not fit (by the compiler)" in full, row["detail"]


def test_a_figure_without_a_goal_shows_a_dash():
  r = common.row("P3-gpu", "MFU", 0.41, None, False, "detail", "machine")
  assert r["meets_goal"] is None and r["goal"] == "—"
  assert "| P3-gpu | MFU | 0.410 | — | — | detail |" in common.markdown([r])


def test_the_onednn_options_hand_every_dot_to_onednn():
  import jax
  import jax.numpy as jnp

  from spmd import compiler_log

  x = jnp.ones((4, 8, 8))
  batched = jax.jit(lambda a, b: jnp.einsum("nqs,nsd->nqd", a, b)).lower(x, x)
  assert "__onednn_fusion" not in batched.compile().as_text()
  # Cache off: JAX cannot write a oneDNN-fused program, and would warn.
  with compiler_log.without_persistent_cache():
    compiled = batched.compile(matmul_peak.ONEDNN_DOTS)
  assert '"kind":"__onednn_fusion"' in compiled.as_text()
  assert jnp.array_equal(compiled(x, x), jnp.full((4, 8, 8), 8.0))


ABSENT_ON_THE_GPU_MACHINE = ("tensorflow_datasets", "grain", "array_record", "pyarrow", "zstandard")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_accelerator_check_runs_end_to_end_at_a_cpu_size(tmp_path):
  # The script an accelerator runs (benchmarks/accelerator_check.sh), at --tiny:
  # the plan, the real train step on synthetic batches, the report. Without a
  # GPU the cuDNN comparisons say they were skipped rather than fail.
  out = tmp_path / "check.json"
  # The GPU machine has no tfds, grain, array_record, pyarrow or zstandard:
  # here they are refused at import, so the check proves it needs none.
  absent = tmp_path / "absent"
  absent.mkdir()
  (absent / "sitecustomize.py").write_text(
    "import sys\n"
    "class Absent:\n"
    "  def find_spec(self, name, path=None, target=None):\n"
    f"    if name.split('.')[0] in {ABSENT_ON_THE_GPU_MACHINE!r}:\n"
    "      raise ModuleNotFoundError(f'no module named {name!r} (absent on the GPU machine)')\n"
    "sys.meta_path.insert(0, Absent())\n"
  )
  done = subprocess.run(
    [
      str(ROOT / "benchmarks" / "accelerator_check.sh"),
      "--tiny",
      "--steps=1",
      "--warmup=1",
      "--global_batch=4",
      f"--out={out}",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, PYTHONPATH=str(absent)),
    timeout=300,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  report = json.loads(out.read_text())
  assert report["attention"] == {"skipped": "no GPU (cpu)"}, report
  assert report["measured"]["tokens_per_s"] > 0 and report["measured"]["global_batch"] == 4
  low, high = report["plan"]["mfu_range"]
  assert 0 < low < high < 1 and report["plan"]["fits"], report["plan"]
  assert "MFU planned" in done.stdout and "accelerator check" in done.stdout


@pytest.mark.multiprocess
@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (the tpu extra)")
def test_the_tpu_check_gives_the_plans_figure_beside_its_verdict_at_each_row_count(tmp_path):
  """The chip's per-row report, on its CPU path: the tiny Llama planned for v5e-1 at 1 and 2 rows."""
  out = tmp_path / "tpu_check.json"
  command = [sys.executable, "-m", "benchmarks.tpu_check", "--tiny", "--sweep=2", "--rows=2"]
  quick = ["--steps=1", "--warmup=1", "--p11_rows=0", f"--out={out}"]
  done = subprocess.run(
    ["timeout", "-k", "5", "300", *command, *quick],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  sweep = json.loads(out.read_text())["sweep"]
  assert list(sweep) == ["1", "2"], sweep
  for plan in sweep.values():
    assert plan["fits"] and plan["agrees_with_hbm"], plan
    assert 0 < plan["total_bytes"] <= plan["device_bytes"], plan
  table = done.stdout[done.stdout.index("the plan at each row count, v5e-1") :]
  assert [line.split()[0] for line in table.splitlines()[2:4]] == ["1", "2"], table
  assert all(line.rstrip().endswith("yes") for line in table.splitlines()[2:4]), table
