"""`make bench`: every performance figure (P1-P8, P10, M1, M2, L1, C1, C3, E-M1, E-M2, D1-D3, I1) in one run, as JSON and Markdown.

  python -m benchmarks.run [--only=P4,P5] [--out=workdir/bench] [--update-readme]

Each benchmark runs in a process of its own (they need different device
counts and process layouts):

  P1      benchmarks/trainer.py     trainer vs hand-written step (4 CPU devices)
  P3      benchmarks/trainer.py     FLOP/s vs matmul peak (1 CPU device: the
                                    machine as JAX sees it by default, not
                                    split into devices that share its cores)
  P2      benchmarks/dispatch.py    sharded_jit vs jax.jit dispatch
  P4, P5  benchmarks/training.py    input pipeline and async checkpoint costs
  P6, P8  benchmarks/launches.py    2 processes vs 1; warm vs cold compilation cache
  P7      benchmarks/memory.py      FSDP bytes per device from the compiled program
  P10     benchmarks/llama.py       our Llama step vs a hand-written plain-JAX Llama
                                    step at MaxText's small shape (1 CPU device),
                                    and its model FLOP/s
  M1      benchmarks/pod_memory.py  Llama-3-8B's bytes per device on v5p-256 (pure
                                    FSDP, compiled through libtpu) vs MaxText's;
                                    M1-xla the same with XLA's attention
  M2      benchmarks/pod_flops.py   compiled FLOPs per device of llama3_8b on v5p-256
                                    (libtpu), fsdp_tp vs pure FSDP: nothing timed
  L1      benchmarks/lora_memory.py Llama-3-8B's bytes per device on v5e-8 (pure FSDP,
                                    8192 tokens, one row a device, libtpu), LoRA rank 16
                                    on the 7 projections ÷ full fine-tuning; goal: full
                                    does not fit and LoRA does, by the plan's verdicts
  C1      benchmarks/context_memory.py  Llama-3-8B's bytes per device on v5p-256 at
                                    131,072 tokens x 32 rows, fsdp=16 x context=8
                                    (libtpu) vs MaxText's context parallelism
  E-M1, E-M2  benchmarks/moe_memory.py  Mixtral 8x7B's bytes per device on v5p-256 (pure
                                    FSDP, 4096 tokens x 36 rows a chip, libtpu) vs MaxText's
                                    megablox compile; the expert MLPs' executed FLOPs ÷ the
                                    active parameters' (E-M2-cf1.25: a capacity layout, computed)
  C3      benchmarks/context_balance.py  causal attention blocks per context shard at
                                    131k tokens on 8 shards, from the block mask: the
                                    busiest ÷ the mean, and all ÷ one unsplit device
  D1-D3   benchmarks/data_prep.py   data.sources prepared by 4 processes: the largest
                                    share of tokens, peak RSS and time to the first
                                    step as a generated corpus grows 4x
  I1      benchmarks/hf_import.py   one process's peak RSS rise importing a 1B bf16
                                    Hugging Face folder on 4 processes (FSDP) ÷
                                    the model's f32 bytes

Every module runs with TCMalloc preloaded where this machine has it, as
`spmd-launch` runs the trainer (`launch/allocator.py`); each row's machine
says which allocator it had.

The rows go to `OUT/results.json` and `OUT/results.md`. `--update-readme`
also writes them to `benchmarks/latest.json` and into the same table in the
README and in docs/performance.md (between their `bench:start`/`bench:end`
markers), so both always show the latest figures; a test checks that they
agree with `latest.json`. With `--only`, only those figures are replaced
(each row keeps its own date).

The chip's figures (P4-tpu, P9, P11, PL1-PL3, P9 at two more shapes, P9-mha
and P9-long, a mixture of experts' MFU E-P9, the decode speeds S1 and S2,
the eval speed E1 and LoRA's L2 and L3: `TPU_FIGURES`) come from the JSON of the TPU check
(`benchmarks/tpu_check.sh` on a TPU machine), of the shapes' runs
(`benchmarks/tpu_shapes.sh`), of `benchmarks.tpu_sample`, of
`benchmarks.tpu_evals` and of `benchmarks.tpu_lora`, merged without running
anything here:

  python -m benchmarks.run --from-tpu-check=tpu_check.json [--only=P9,P11] --update-readme
  python -m benchmarks.run --from-tpu-check=tpu_shapes.json --only=P9-mha,P9-long,E-P9 --update-readme
  python -m benchmarks.run --from-tpu-check=tpu_sample.json --only=S1,S2 --update-readme
  python -m benchmarks.run --from-tpu-check=e1.json --only=E1 --update-readme
  python -m benchmarks.run --from-tpu-check=tpu_lora.json --only=L2,L3 --update-readme

`make bench` runs and replaces the CPU figures and keeps the chip's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from benchmarks import common
from launch import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (module, figures it reports here, environment it runs with)
BENCHMARKS = [
  ("trainer", ("P1",), {"BENCH_DEVICES": "4"}),
  ("trainer", ("P3",), {"BENCH_DEVICES": "1"}),
  ("dispatch", ("P2",), {}),
  ("training", ("P4", "P5"), {}),
  ("launches", ("P6", "P8"), {}),
  ("memory", ("P7",), {}),
  ("llama", ("P10",), {}),
  ("pod_memory", ("M1", "M1-xla"), {}),
  ("pod_flops", ("M2",), {}),
  ("lora_memory", ("L1",), {}),
  ("context_memory", ("C1",), {}),
  ("context_balance", ("C3", "C3-total"), {}),
  ("moe_memory", ("E-M1", "E-M2", "E-M2-cf1.25"), {}),
  ("data_prep", ("D1", "D2", "D3"), {}),
  ("hf_import", ("I1",), {}),
]
# Measured on a TPU chip by benchmarks/tpu_check.py, and P9 at the shapes of
# benchmarks/tpu_shapes.py (its SHAPES' figures), merged by --from-tpu-check.
TPU_FIGURES = (
  "P4-tpu",
  "P9",
  "P9-mha",
  "P9-long",
  "E-P9",
  "P11",
  "PL1",
  "PL2",
  "PL3",
  "S1",
  "S2",
  "E1",
  "L2",
  "L3",
)
LATEST = os.path.join(ROOT, "benchmarks", "latest.json")
README = os.path.join(ROOT, "README.md")
PERFORMANCE_DOC = os.path.join(ROOT, "docs", "performance.md")
# Every document that shows the latest run's table.
TABLE_DOCS = (README, PERFORMANCE_DOC)
_BLOCK = re.compile(r"(<!-- bench:start -->\n)(.*?)(<!-- bench:end -->)", re.S)


def readme_block(rows: list[dict]) -> str:
  """What goes between a document's markers: the table and where it was measured."""
  machines = sorted({f"{r['machine']} ({r['date']})" for r in rows})
  where = "".join(f"\n- {m}" for m in machines)
  return common.markdown(rows) + f"\nMeasured on:{where}\n"


def figure_order(row: dict) -> tuple[bool, str, int, str]:
  """Sorts rows by series (P before the others), then number, so P10 follows P8, not P1.

  A series may carry a prefix (the mixture of experts' E-M1, E-P9).

  Example:
    >>> ids = ["M1-xla", "P10", "E-P9", "M1", "P2", "E-M1"]
    >>> sorted(ids, key=lambda i: figure_order({"id": i}))
    ['P2', 'P10', 'E-M1', 'E-P9', 'M1', 'M1-xla']
  """
  found = re.fullmatch(r"((?:[A-Z]+-)?[A-Z]+)(\d+)(.*)", row["id"])
  if found is None:
    raise ValueError(f"figure id {row['id']!r} is not a letter series and a number, e.g. P10")
  series, number, suffix = found.groups()
  return series != "P", series, int(number), suffix


def _chip_command(report: dict) -> str:
  """The check's command as a reader would type it: no output path, the tuning file by name.

  A flag given twice keeps its last value, as argparse does (`tpu_check.sh`
  puts its own `--train_steps=60` ahead of the caller's flags).

  >>> _chip_command({"command": "c.sh --a=1 --b=2 --a=3 --out=/x.json --tuning=/t/tune.json"})
  'c.sh --b=2 --a=3 --tuning=tune.json'
  """
  words: list[str] = []
  for word in report.get("command", "benchmarks/tpu_check.sh").split():
    if word.startswith("--out="):
      continue
    if word.startswith("--tuning="):
      word = "--tuning=" + os.path.basename(word.split("=", 1)[1])
    if word.startswith("--"):
      flag = word.split("=", 1)[0] + "="
      words = [w for w in words if not w.startswith(flag)]
    words.append(word)
  return " ".join(words)


# Issue 60's goal for the check model at 8 rows (it was 0.6 at 7 rows before).
P9_GOAL = 0.62


def tpu_rows(report: dict) -> list[dict]:
  """The table's rows for the chip's figures in a JSON `report` of `tpu_check` or `tpu_shapes`.

  A report of `benchmarks.tpu_shapes` gives its shapes' rows alone (`shape_rows`).

  P9 and PL1 come from the first row count (the tuned batch where the check
  was given one), PL2 from every row count that ran, PL3 from every row
  count, P11 and P4-tpu where the check ran them.

  Example:
    >>> report = {"device_kind": "TPU v5 lite", "jax": "0.10.2", "date": "2026-12-05",
    ...   "command": "benchmarks/tpu_check.sh --out=/x/c.json", "p9_mfu": 0.61, "rows": {
    ...   "8": {"plan": {"fits": True, "total_bytes": 10, "step_time_s_range": [0.4, 0.6]},
    ...         "device": {"compiled": True, "total_bytes": 10, "step_s": 0.5, "tokens_per_s": 3.0},
    ...         "verdicts_agree": True, "pl1": 1.0, "pl2_in_range": True}}}
    >>> [(r["id"], r["value"], r["meets_goal"]) for r in tpu_rows(report)]
    [('P9', 0.61, False), ('PL1', 1.0, True), ('PL2', 0.5, True), ('PL3', 1.0, True)]
    >>> tpu_rows(report)[0]["machine"]
    'TPU v5 lite, 1 chip, jax 0.10.2: `benchmarks/tpu_check.sh`'
  """
  figure = _chip_figure(report)
  if report.get("figure") == "E1":  # benchmarks.tpu_evals' report
    return [eval_row(report)]
  if report.get("figure") == "L2":  # benchmarks.tpu_lora's: L2 and L3
    return lora_rows(report)
  if isinstance(report.get("rows"), list):  # benchmarks.tpu_sample's: a row a batch size
    return sample_rows(report)
  if "rows" not in report:  # the shapes' report: no row counts of the check
    return shape_rows(report)
  by_rows = {int(k): v for k, v in report["rows"].items()}
  first_rows, first = next(iter(by_rows.items()))
  dev, plan = first["device"], first["plan"]
  tuning = report.get("tuning") or {}
  setting = ", ".join(f"{k}={v}" for k, v in tuning.items()) or "the defaults"
  out = []
  if report.get("p9_mfu") is not None:
    out.append(
      figure(
        "P9",
        "MFU of the 501M Llama's train step on one TPU chip (bf16, splash; PaLM's FLOPs ÷ the chip's peak)",
        report["p9_mfu"],
        P9_GOAL,
        False,
        f"configs/llama_tpu_check.py, {first_rows} rows x {report.get('seq_len', 2048)} tokens: "
        f"{dev['step_s'] * 1e3:.1f} ms a step, {dev['tokens_per_s']:,.0f} tokens/s; {setting}",
      )
    )
  p11 = report.get("p11") or {}
  if "p11" in p11:
    out.append(
      figure(
        "P11",
        "our Llama step ÷ a hand-written `jax.jit` Llama step with the same splash kernel and remat (TPU chip)",
        p11["p11"],
        1.02,
        True,
        f"the 501M Llama, {p11['rows']} rows: {p11['ours_step_s'] * 1e3:.1f} vs "
        f"{p11['hand_step_s'] * 1e3:.1f} ms; first losses agree "
        f"({p11['losses_ours'][0]:.4f} vs {p11['losses_hand'][0]:.4f})",
      )
    )
  if "p4" in report:
    t = report["trainer"]
    out.append(
      figure(
        "P4-tpu",
        "`spmd-train`'s tokens/s (packed data, splash with segment ids) ÷ the raw step's, on the chip",
        report["p4"],
        0.97,
        False,
        f"{first_rows} rows, {t['steps']} steps: {t['tokens_per_s']:,.0f} vs "
        f"{dev['tokens_per_s']:,.0f} tokens/s, {t['real_token_share']:.0%} real tokens",
      )
    )
  if "pl1" in first:
    out.append(
      figure(
        "PL1",
        "the plan's peak for a described `v5e-1` ÷ the chip's own compiled peak (the description is the chip)",
        first["pl1"],
        1.03,
        True,
        f"{first_rows} rows: {plan['total_bytes'] / 2**30:.2f} vs {dev['total_bytes'] / 2**30:.2f} GiB",
        low=0.97,
      )
    )
  ran = {n: r for n, r in by_rows.items() if r.get("device", {}).get("step_s")}
  if ran and all(r["plan"].get("step_time_s_range") for r in ran.values()):
    n, r = next(iter(ran.items()))
    low, high = r["plan"]["step_time_s_range"]
    out.append(
      figure(
        "PL2",
        "where the chip's step time lies in the plan's range (0: its low end, 1: its high end)",
        (r["device"]["step_s"] - low) / (high - low),
        1.0,
        True,
        f"{n} rows: {r['device']['step_s'] * 1e3:.0f} ms in {low * 1e3:.0f}–{high * 1e3:.0f} ms",
        low=0.0,
      )
    )
  words = {True: "fits", False: "does not fit"}
  out.append(
    figure(
      "PL3",
      "share of row counts where the plan's verdict is the chip's compiler's",
      sum(r["verdicts_agree"] for r in by_rows.values()) / len(by_rows),
      1.0,
      False,
      "; ".join(
        f"{n} rows: plan {words[r['plan']['fits']]}, chip "
        f"{'runs' if r['device']['compiled'] else 'refuses'}"
        for n, r in by_rows.items()
      ),
    )
  )
  return out + shape_rows(report)


def _chip_figure(report: dict):
  """A maker of the chip's table rows, each with `report`'s machine, command and date."""
  machine = f"{report['device_kind']}, 1 chip, jax {report['jax']}: `{_chip_command(report)}`"

  def figure(figure_id, what, value, goal, at_most, detail, low=None):
    r = common.row(figure_id, what, value, goal, at_most, detail, machine)
    if low is not None:  # a range: goal low-goal
      r["goal"], r["meets_goal"] = f"{low}–{goal}", bool(low <= value <= goal)
    return {**r, "date": report["date"]}

  return figure


def sample_rows(report: dict) -> list[dict]:
  """S1 and S2 from `benchmarks.tpu_sample`'s report: decode speed over the bytes a step reads.

  Example:
    >>> report = {"device_kind": "TPU v5 lite", "jax": "0.10.2", "date": "2026-12-07",
    ...   "command": "python3 -m benchmarks.tpu_sample --out=/x/s.json", "config": "configs/c.py",
    ...   "prompt_len": 64, "tokens": 256, "hbm_gbps": 819.0, "rows": [{"figure": "S1",
    ...   "batch": 1, "step_ms": 1.39, "bound_ms": 1.11, "value": 0.8, "goal": 0.8,
    ...   "tokens_per_s": 719.4, "platform": "tpu"}, {"figure": "S@4", "goal": None}]}
    >>> [(r["id"], r["value"], r["meets_goal"]) for r in sample_rows(report)]
    [('S1', 0.7986, False)]
    >>> sample_rows(report)[0]["machine"]
    'TPU v5 lite, 1 chip, jax 0.10.2: `python3 -m benchmarks.tpu_sample`'
  """
  figure = _chip_figure(report)
  # The ratio again from its two times: the report rounds it to 3 places, which
  # can lift 0.79975 to its goal of 0.8.
  return [
    figure(
      r["figure"],
      f"decode speed at batch {r['batch']} ÷ its bound (the bytes a step must read at "
      f"{report['hbm_gbps']:.0f} GB/s), the 501M Llama in bf16 on one TPU chip",
      r["bound_ms"] / r["step_ms"],
      r["goal"],
      False,
      f"{report['config']}, {report['prompt_len']}-token prompts + {report['tokens']} new, "
      f"greedy through `generate_batch` (what `spmd-sample` runs): {r['step_ms']:.3f} ms a step "
      f"against {r['bound_ms']:.3f} ms ({r['bound_ms'] / r['step_ms']:.4f}), "
      f"{r['tokens_per_s']:,.0f} tokens/s",
    )
    for r in report["rows"]
    if r.get("goal") is not None
  ]


def eval_row(report: dict) -> dict:
  """E1 from `benchmarks.tpu_evals`' report: a multiple-choice eval's tokens/s over the train step's.

  Example:
    >>> report = {"device_kind": "TPU v5 lite", "jax": "0.10.2", "date": "2026-12-07",
    ...   "command": "python3 -m benchmarks.tpu_evals", "figure": "E1", "value": 2.5,
    ...   "goal": 2.0, "config": "configs/c.py", "train_tokens_per_s": 34000.0, "eval": {
    ...   "items": 1000, "choices": 4, "scored_tokens": 900000, "rows": 500, "row_fill": 0.9,
    ...   "pass_s": 10.6, "tokens_per_s": 85000.0}}
    >>> r = eval_row(report); r["id"], r["value"], r["meets_goal"]
    ('E1', 2.5, True)
  """
  e = report["eval"]
  return _chip_figure(report)(
    "E1",
    "a multiple-choice eval's scored tokens/s ÷ the train step's tokens/s, the 501M Llama on one "
    "TPU chip",
    report["value"],
    report["goal"],
    False,
    f"{report['config']}, {e['items']:,} items x {e['choices']} choices, {e['scored_tokens']:,} "
    f"context + choice tokens packed into {e['rows']} rows ({e['row_fill']:.0%} filled): "
    f"{e['pass_s']:.2f} s a pass, {e['tokens_per_s']:,.0f} against {report['train_tokens_per_s']:,.0f} "
    "tokens/s",
  )


def lora_rows(report: dict) -> list[dict]:
  """L2 and L3 from `benchmarks.tpu_lora`'s report: the largest LoRA fine-tune, LoRA's step ÷ full's.

  Example:
    >>> report = {"device_kind": "TPU v5 lite", "jax": "0.10.2", "date": "2026-12-07",
    ...   "command": "python3 -m benchmarks.tpu_lora --out=/x/l.json", "figure": "L2", "rows": 4,
    ...   "seq_len": 2048, "rank": 16, "sizes": {"d1024_l16": {"d_model": 1024, "num_layers": 16,
    ...   "params": 5.06e8, "full_plan": {"fits": True}}, "d2048_l8": {"d_model": 2048,
    ...   "num_layers": 8, "params": 9.8e8, "full_plan": {"fits": False}}},
    ...   "l2": {"size": "d3072_l28", "params": 4.27e9, "tokens_per_s": 4100.0, "mfu": 0.41,
    ...          "step_s": 2.0}, "full_stops": {"size": "d1024_l16", "params": 5.06e8,
    ...   "next": {"size": "d2048_l8", "params": 9.8e8, "full_plan": {"fits": False}}},
    ...   "l3": {"size": "d1024_l16", "params": 5.06e8, "lora_step_s": 0.3, "full_step_s": 0.4,
    ...          "value": 0.75}}
    >>> [(r["id"], r["value"], r["meets_goal"]) for r in lora_rows(report)]
    [('L2', 4.27, True), ('L3', 0.75, True)]
    >>> lora_rows(report)[0]["detail"].split("step; ")[-1]
    'full fine-tuning stops at d1024_l16 (0.51B), below d2048_l8 (0.98B), which does not fit'
  """
  figure = _chip_figure(report)
  rows, seq = report["rows"], report["seq_len"]
  out = []
  full = report.get("full_stops")
  stops = "full fine-tuning runs no size of the family"
  if full:
    stops = f"full fine-tuning stops at {full['size']} ({full['params'] / 1e9:.2f}B)"
    above = full.get("next")
    if above:
      stops += f", below {above['size']} ({above['params'] / 1e9:.2f}B), which does not fit"
  if report.get("l2"):
    l2 = report["l2"]
    out.append(
      figure(
        "L2",
        f"the largest Llama LoRA fine-tunes on one TPU chip from an HF folder of bf16 weights "
        f"(rank {report['rank']} on the 7 projections, {rows} rows x {seq} tokens), in billions "
        "of parameters",
        l2["params"] / 1e9,
        4.0,
        False,
        f"{l2['size']} (Llama 3's proportions): {l2['tokens_per_s']:,.0f} tokens/s, MFU "
        f"{l2['mfu']:.1%} on forward + input-gradient FLOPs, {l2['step_s'] * 1e3:.0f} ms a "
        f"step; {stops}",
      )
    )
  if report.get("l3"):
    l3 = report["l3"]
    out.append(
      figure(
        "L3",
        f"the LoRA step ÷ the full fine-tuning step on one TPU chip, same Llama and rows "
        f"({rows} x {seq} tokens)",
        l3["value"],
        0.8,
        True,
        f"{l3['size']} ({l3['params'] / 1e9:.2f}B), the largest that full fine-tuning runs: "
        f"{l3['lora_step_s'] * 1e3:.1f} vs {l3['full_step_s'] * 1e3:.1f} ms",
      )
    )
  return out


def shape_rows(report: dict) -> list[dict]:
  """A row for each shape of `benchmarks.tpu_shapes`' report that ran: its MFU through spmd-train.

  Example:
    >>> report = {"device_kind": "TPU v5 lite", "jax": "0.10.2", "date": "2026-12-07",
    ...   "command": "benchmarks/tpu_shapes.sh --out=/x/s.json", "shapes": {"mha": {
    ...   "figure": "P9-mha", "goal": 0.58, "label": "without GQA", "config": "configs/m.py",
    ...   "params": 542e6, "rows": 8, "seq_len": 2048, "remat_policy": "minimal", "mfu": 0.6,
    ...   "step_s": 0.45, "tokens_per_s": 36e3, "steps_timed": 20,
    ...   "plan": {"total_bytes": 14.83 * 2**30, "remats": 0}}, "long": {"figure": "P9-long"}}}
    >>> [(r["id"], r["value"], r["meets_goal"]) for r in shape_rows(report)]
    [('P9-mha', 0.6, True)]
    >>> shape_rows(report)[0]["detail"]
    'configs/m.py, 8 rows x 2048 tokens, remat minimal: 450.0 ms a step, 36,000 tokens/s (median of 20 steps after the compile); the plan for v5e-1: 14.83 GiB, 0 rematerialized'
  """
  figure = _chip_figure(report)
  out = []
  for s in report.get("shapes", {}).values():
    if "mfu" not in s:  # planned only
      continue
    plan = s.get("plan") or {}
    planned = (
      f"; the plan for {plan.get('topology', 'v5e-1')}: {plan['total_bytes'] / 2**30:.2f} GiB, "
      f"{plan['remats']} rematerialized"
      if plan.get("total_bytes")
      else ""
    )
    out.append(
      figure(
        s["figure"],
        f"MFU of `spmd-train`'s step, a {s['params'] / 1e6:.3g}M Llama {s['label']} at "
        f"{s['seq_len']} tokens, on one TPU chip (bf16, splash, packed data; PaLM's FLOPs"
        f"{' of the active parameters' if s.get('moe_experts') else ''} ÷ the chip's peak)",
        s["mfu"],
        s["goal"],
        False,
        f"{s['config']}, {s['rows']} rows x {s['seq_len']} tokens, remat {s['remat_policy']}: "
        f"{s['step_s'] * 1e3:.1f} ms a step, {s['tokens_per_s']:,.0f} tokens/s (median of "
        f"{s['steps_timed']} steps after the compile){planned}",
      )
    )
  return out


def merged(latest: list[dict], rows: list[dict], replace_all: bool) -> list[dict]:
  """`rows` with the `latest` rows they do not replace, in figure order.

  `replace_all` (a whole `make bench` run): of the latest, only the chip's
  figures stay, which no CPU run measures.

  Example:
    >>> old = [{"id": "P1", "v": 1}, {"id": "P9", "v": 1}, {"id": "P2", "v": 1}]
    >>> [(r["id"], r["v"]) for r in merged(old, [{"id": "P1", "v": 2}], replace_all=True)]
    [('P1', 2), ('P9', 1)]
    >>> [(r["id"], r["v"]) for r in merged(old, [{"id": "P1", "v": 2}], replace_all=False)]
    [('P1', 2), ('P2', 1), ('P9', 1)]
  """
  new = {r["id"] for r in rows}
  kept = [r for r in latest if r["id"] not in new and (not replace_all or r["id"] in TPU_FIGURES)]
  return sorted(kept + rows, key=figure_order)


def update_readme(rows: list[dict], readme: str = README) -> None:
  r"""Replace the table between `readme`'s `bench:start`/`bench:end` markers with `rows`'.

  Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "doc.md")
    >>> _ = open(path, "w").write("intro\n<!-- bench:start -->\nold\n<!-- bench:end -->\nend\n")
    >>> update_readme([], path)
    >>> open(path).read() == f"intro\n<!-- bench:start -->\n{readme_block([])}<!-- bench:end -->\nend\n"
    True
  """
  with open(readme) as f:
    text = f.read()
  if not _BLOCK.search(text):
    raise ValueError(f"{readme} has no <!-- bench:start --> ... <!-- bench:end --> block")
  text = _BLOCK.sub(lambda m: m.group(1) + readme_block(rows) + m.group(3), text)
  with open(readme, "w") as f:
    f.write(text)


def update_docs(rows: list[dict], paths: tuple[str, ...] | None = None) -> None:
  """Write the latest run's table into every document that shows it (default `TABLE_DOCS`)."""
  for path in TABLE_DOCS if paths is None else paths:
    update_readme(rows, path)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="comma-separated figure ids, e.g. P4,P5")
  parser.add_argument("--out", default=os.path.join(ROOT, "workdir", "bench"))
  parser.add_argument("--update-readme", action="store_true")
  parser.add_argument(
    "--from-tpu-check",
    default="",
    metavar="FILE",
    help="merge the chip's figures from benchmarks/tpu_check.py's JSON; run nothing",
  )
  args = parser.parse_args()
  if args.from_tpu_check:
    with open(args.from_tpu_check) as f:
      rows = tpu_rows(json.load(f))
    # --only: those of the chip's figures (another run's file supplies the rest).
    chosen = {f.strip().upper() for f in args.only.split(",") if f.strip()}
    if chosen - {f.upper() for f in TPU_FIGURES}:
      raise SystemExit(f"--only={args.only!r}: the chip's figures are {TPU_FIGURES}")
    rows = [r for r in rows if not chosen or r["id"].upper() in chosen]
    print(readme_block(rows), end="")
    if args.update_readme:
      write_latest(rows, replace_all=False)
    return
  # Ids as registered, whatever their case on the command line (p4, M1-xla).
  registered = {f.upper(): f for _, ids, _ in BENCHMARKS for f in ids}
  asked = {f.strip().upper() for f in args.only.split(",") if f.strip()}
  unknown = asked - set(registered)
  wanted = {registered[f] for f in asked - unknown}
  if unknown:
    raise SystemExit(f"--only={args.only!r}: unknown figures {sorted(unknown)}")
  os.makedirs(args.out, exist_ok=True)
  rows: list[dict] = []
  for module, ids, env in BENCHMARKS:
    if wanted and not wanted & set(ids):
      continue
    path = os.path.join(args.out, f"{module}-{'-'.join(ids)}.json")
    print(f"benchmarks.{module} ({', '.join(ids)}) ...", flush=True)
    start = time.perf_counter()
    subprocess.run(
      [sys.executable, "-m", f"benchmarks.{module}", f"--json={path}"],
      cwd=ROOT,
      env=allocator.with_tcmalloc({**os.environ, **env}),
      check=True,
      stdout=subprocess.DEVNULL,
    )
    print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    with open(path) as f:
      rows += [r for r in json.load(f) if r["id"] in ids and (not wanted or r["id"] in wanted)]
  rows.sort(key=figure_order)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(rows, f, indent=1)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(readme_block(rows))
  print(readme_block(rows), end="")
  if args.update_readme:
    write_latest(rows, replace_all=not wanted)


def write_latest(rows: list[dict], replace_all: bool) -> None:
  """Merges `rows` into `benchmarks/latest.json` (`merged`) and the documents' tables."""
  with open(LATEST) as f:
    rows = merged(json.load(f), rows, replace_all)
  with open(LATEST, "w") as f:
    json.dump(rows, f, indent=1)
    f.write("\n")
  update_docs(rows)


if __name__ == "__main__":
  main()
