"""Metrics files, loss curve, progress bar, summary, peak FLOP/s and MFU."""

import io
import json
import math
import struct
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from trainers.reporting import chips, loss_curve, matmul_peak, peaks
from trainers.reporting.console import Progress, format_summary
from trainers.reporting.metrics import MetricsWriter, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_scalars(logdir):
  """(tag, step, value) of every scalar in the TFRecord event files under `logdir`."""
  scalars = []
  for path in sorted(logdir.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
      # A record: uint64 length, uint32 crc of length, payload, uint32 crc of payload.
      (length,) = struct.unpack_from("<Q", data, offset)
      payload = data[offset + 12 : offset + 12 + length]
      offset += 12 + length + 4
      event = event_pb2.Event.FromString(payload)
      for value in event.summary.value:
        scalars.append((value.tag, event.step, value.simple_value))
  return scalars


def test_jsonl_round_trip_with_numpy_and_jax_scalars(tmp_path):
  with MetricsWriter(tmp_path, enabled=True) as writer:
    writer.write(1, {"loss": np.float32(3.5), "lr": jnp.asarray(0.25)})
    writer.write(np.int64(2), {"loss": 3.0, "eval_loss": float("nan")})
  records = read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == [1, 2]
  assert records[0]["loss"] == 3.5 and records[0]["lr"] == 0.25
  assert math.isnan(records[1]["eval_loss"])
  assert all(isinstance(r["time"], float) for r in records)
  assert list(records[0]) == ["step", "time", "loss", "lr"]


def test_writer_appends_across_runs_and_rejects_bad_values(tmp_path):
  with MetricsWriter(tmp_path, enabled=True) as writer:
    writer.write(1, {"loss": 2.0})
  with MetricsWriter(tmp_path, enabled=True) as writer:  # a resumed run
    writer.write(2, {"loss": 1.0})
    with pytest.raises(ValueError, match=r"reserved"):
      writer.write(3, {"step": 1.0})
    with pytest.raises(ValueError, match=r"metric 'loss'=array\(\[1., 2.\]\) at step=3"):
      writer.write(3, {"loss": np.array([1.0, 2.0])})
  assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
  with pytest.raises(ValueError, match="is closed"):
    writer.write(4, {"loss": 0.5})


def test_read_metrics_names_a_bad_line_but_drops_a_cut_last_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2, "lo\n')
  assert read_metrics(path) == [{"step": 1}]
  path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
  with pytest.raises(ValueError, match="line 2 is not JSON"):
    read_metrics(path)


def test_resumed_writer_drops_a_line_cut_by_a_crash(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
  with MetricsWriter(tmp_path, enabled=True) as writer:
    writer.write(2, {"loss": 1.5})
  records = read_metrics(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["loss"]) for r in records] == [(1, 2.0), (2, 1.5)]


def test_tensorboard_events_are_readable(tmp_path):
  with MetricsWriter(tmp_path, enabled=True) as writer:
    writer.write(5, {"loss": 2.5, "tokens_per_s": 1000.0})
    writer.write(10, {"loss": 2.0})
  scalars = read_scalars(tmp_path / "tensorboard")
  assert ("loss", 5, 2.5) in scalars and ("loss", 10, 2.0) in scalars
  assert ("tokens_per_s", 5, 1000.0) in scalars


def test_disabled_writer_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  with MetricsWriter(workdir, enabled=False) as writer:
    writer.write(1, {"loss": 1.0})
    writer.flush()
  assert not workdir.exists()


def test_loss_curve_png_with_train_and_eval_lines(tmp_path):
  with MetricsWriter(tmp_path, enabled=True) as writer:
    for step in range(1, 21):
      writer.write(step, {"loss": 3.0 / step})
      if step % 10 == 0:
        writer.write(step, {"eval_loss": 3.5 / step})
  records = read_metrics(tmp_path / "metrics.jsonl")
  lines = loss_curve.loss_figure(records).axes[0].get_lines()
  assert [line.get_label() for line in lines] == ["loss", "eval_loss"]
  assert list(lines[1].get_xdata()) == [10, 20]

  png = loss_curve.plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "loss.png")
  data = png.read_bytes()
  assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def test_loss_curve_keeps_the_last_record_of_a_repeated_step():
  # A run resumed from step 2 logs steps 3 and 4 again.
  records = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4)]
  records += [{"step": 3, "loss": 30.0}, {"step": 4, "loss": 40.0}]
  (line,) = loss_curve.loss_figure(records).axes[0].get_lines()
  assert list(line.get_xdata()) == [1, 2, 3, 4]
  assert list(line.get_ydata()) == [1.0, 2.0, 30.0, 40.0]
  with pytest.raises(ValueError, match=r"none of keys=\('eval_loss',\).*\['loss'\]"):
    loss_curve.loss_figure(records, keys=("eval_loss",))


def test_progress_disabled_prints_nothing(capsys):
  with Progress(total_steps=10, enabled=False) as bar:
    for step in range(1, 11):
      bar.update(step, loss=1.0, tokens_per_s=5.0)
  assert capsys.readouterr() == ("", "")


def test_progress_shows_step_loss_and_tokens_and_rejects_device_values():
  out = io.StringIO()
  with Progress(total_steps=100, initial=40, enabled=True, file=out, mininterval_s=0) as bar:
    bar.update(50, loss=2.25, tokens_per_s=123456.0)
    with pytest.raises(TypeError, match="pass a host float"):
      bar.update(51, loss=jnp.asarray(2.0))
  text = out.getvalue()
  assert "50/100" in text and "loss=2.25" in text and "tok/s=123k" in text
  with pytest.raises(ValueError, match="initial=11"):
    Progress(total_steps=10, initial=11, enabled=False)


def test_format_summary_aligns_and_skips_missing():
  text = format_summary(
    {
      "steps": 1200,
      "train_loss": 2.345678,
      "eval_loss": None,
      "tokens_per_s": 45678.9,
      "mfu": 0.3871,
      "peak_flops_per_s": 989e12,
      "peak_source": "table",
      "checkpoints": "/w/checkpoints",
      "metrics": "/w/metrics.jsonl",
      "loss_history": [(1, 2.5)],  # not a summary entry: ignored
      "loss_curve": "/w/loss.png",
    }
  )
  lines = text.splitlines()
  assert lines[0] == "run summary"
  assert "  steps            : 1,200" in lines
  assert "  final train loss : 2.3457" in lines
  assert "  tokens/s         : 45,679" in lines
  assert "  MFU              : 38.7%" in lines
  assert "  peak per device  : 989 TFLOP/s" in lines
  assert "  checkpoints      : /w/checkpoints" in lines
  assert "  loss curve       : /w/loss.png" in lines
  assert "eval loss" not in text and "tensorboard" not in text
  assert len({line.index(":") for line in lines[1:]}) == 1  # one column
  assert format_summary({}) == "run summary"


@pytest.mark.parametrize(
  "kind,dtype,expected",
  [
    ("TPU v4", "bfloat16", 275e12),
    ("TPU v5 lite", "bfloat16", 197e12),
    ("TPU v5e", jnp.bfloat16, 197e12),
    ("TPU v5", "bfloat16", 459e12),
    ("TPU v5p", "bfloat16", 459e12),
    ("TPU v6 lite", "bfloat16", 918e12),
    ("TPU v6e", "float32", 918e12),  # default precision: one bf16 pass
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H100 80GB HBM3", "float32", 495e12),  # default precision: TF32
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H100 NVL", "bfloat16", 835e12),
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA GH200 480GB", "bfloat16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA A100-SXM4-40GB", np.float32, 156e12),
    ("NVIDIA A100 80GB PCIe", "float16", 312e12),
    ("TPU v4 lite", "bfloat16", None),
    ("NVIDIA L4", "bfloat16", None),
    ("cpu", "float32", None),
  ],
)
def test_table_lookups_for_real_device_kinds(kind, dtype, expected):
  assert chips.table_peak(kind, dtype) == expected


def test_full_float32_precision_changes_the_gpu_peak_and_tpu_falls_back():
  with jax.default_matmul_precision("highest"):
    assert chips.table_peak("NVIDIA H100 80GB HBM3", "float32") == 67e12
    assert chips.table_peak("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert chips.table_peak("TPU v5 lite", "float32") is None  # 6 bf16 passes: measure
  with pytest.raises(ValueError, match="dtype='int32' is not a floating-point"):
    chips.table_peak("TPU v4", "int32")


def test_accelerator_peak_comes_from_the_table_without_measuring(monkeypatch, tmp_path):
  monkeypatch.setattr(peaks, "measure_matmul_peak", pytest.fail)
  h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  assert peaks.peak_flops(h100, "bfloat16", cache_dir=tmp_path) == peaks.PeakInfo(989e12, "table")
  assert not (tmp_path / peaks.CACHE_FILE).exists()


def test_cpu_peak_is_measured_once_and_cached(monkeypatch, tmp_path):
  calls = []
  real_measure = peaks.measure_matmul_peak

  def measure_once(*args, **kwargs):
    if calls:
      pytest.fail("measured twice: the cache was not used")
    calls.append(1)
    return real_measure(*args, **{**kwargs, "size": 1024, "repeats": 3})

  monkeypatch.setattr(peaks, "measure_matmul_peak", measure_once)
  cpu = jax.devices("cpu")[0]
  first = peaks.peak_flops(cpu, "float32", cache_dir=tmp_path)
  second = peaks.peak_flops(cpu, "float32", cache_dir=tmp_path)
  assert first == second and first.flops_per_s > 0
  assert first.source.startswith("measured on ")
  (entry,) = json.loads((tmp_path / peaks.CACHE_FILE).read_text()).values()
  # The host's peak is shared by the 8 CPU devices the test process has.
  assert first.flops_per_s == pytest.approx(entry["flops_per_s"] / len(jax.devices("cpu")))
  assert "shared by 8 CPU devices" in first.source


def test_cpu_peak_is_the_better_of_xla_and_onednn_matmuls(monkeypatch):
  # Each sampler reports a fixed rate, told apart by its compiler options:
  # the peak must be the faster of the two, whichever it is.
  for xla, onednn in ((2e9, 3e9), (5e9, 4e9)):
    rates = {None: xla, "onednn": onednn}

    def sampler(dtype, size, device, compiler_options=None, rates=rates):
      return lambda repeats, budget_s: rates["onednn" if compiler_options else None]

    monkeypatch.setattr(matmul_peak, "matmul_sampler", sampler)
    assert matmul_peak.measure_matmul_peak(size=64, repeats=1) == max(xla, onednn)


def test_a_jaxlib_without_onednn_falls_back_to_the_default_matmul(monkeypatch):
  assert matmul_peak.onednn_matmul_sampler(size=64) is not None  # this jaxlib has it
  # An option this XLA does not know makes the oneDNN compile fail, as it
  # would on a jaxlib built without oneDNN: the peak is then XLA's alone.
  monkeypatch.setattr(matmul_peak, "ONEDNN_DOTS", {"xla_cpu_no_such_option": True})
  assert matmul_peak.onednn_matmul_sampler(size=64) is None
  assert matmul_peak.measure_matmul_peak(size=64, repeats=1) > 0


def test_the_onednn_peak_compiles_beside_the_persistent_cache_without_a_warning():
  # The suite's cache is on (tests/session_settings.py); JAX cannot write a
  # oneDNN-fused program to it and warned at every run that measured the peak.
  assert jax.config.jax_compilation_cache_dir
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert matmul_peak.onednn_matmul_sampler(size=48)(1, 1.0) > 0
  assert not [w for w in caught if "persistent compilation cache" in str(w.message)], caught
  assert jax.config.jax_enable_compilation_cache  # on again for what follows


def test_mfu_arithmetic():
  # 8 devices at 100 TFLOP/s each for 0.5 s could do 400 TFLOP; the model used 100.
  assert peaks.mfu(100e12, step_time_s=0.5, num_devices=8, peak_per_device=100e12) == 0.25
  with pytest.raises(ValueError, match="step_time_s=0"):
    peaks.mfu(1e12, step_time_s=0, num_devices=1, peak_per_device=1e12)
  with pytest.raises(ValueError, match="num_devices=-1"):
    peaks.mfu(1e12, step_time_s=1.0, num_devices=-1, peak_per_device=1e12)
