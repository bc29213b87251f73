"""Sampling with a KV cache: cached decoding equals the full forward pass token for token,
temperature and top-k, the cache sharded on a mesh, the `spmd-sample` CLI on a tiny run,
and the cache's memory in the plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd import rules
from spmd.mesh import create_mesh
from trainers.models import decode, llama, logical_axes
from trainers.models import transformer as lm

SEQ_LEN = 24


def _llama(scan_layers=False, tie=False):
  config = llama.LlamaConfig(
    vocab_size=96,
    seq_len=SEQ_LEN,
    num_layers=2,
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    scan_layers=scan_layers,
    tie_embeddings=tie,
  )
  return llama.Llama(config, rngs=nnx.Rngs(1))


def _transformer(scan_layers=False):
  config = lm.TransformerConfig(
    vocab_size=96, seq_len=SEQ_LEN, num_layers=2, d_model=32, num_heads=4, d_ff=64,
    scan_layers=scan_layers,
  )  # fmt: skip
  return lm.TransformerLM(config, rngs=nnx.Rngs(1))


MODELS = {
  "llama": _llama,
  "llama_scan": lambda: _llama(scan_layers=True),
  "llama_tied": lambda: _llama(tie=True),
  "transformer": _transformer,
  "transformer_scan": lambda: _transformer(scan_layers=True),
}
PROMPT = jnp.array([[5, 17, 3, 42], [8, 8, 60, 1]], jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cached_greedy_equals_the_full_forward_pass_token_for_token(name):
  model = MODELS[name]()
  num_tokens = SEQ_LEN - PROMPT.shape[1]  # to the end of the cache
  cached = decode.generate(model, PROMPT, num_tokens)
  uncached = decode.generate_uncached(model, PROMPT, num_tokens)
  np.testing.assert_array_equal(cached, uncached)
  assert cached.shape == (2, SEQ_LEN)
  # The prefill's logits are the forward pass's.
  logits, _ = decode.prefill(model, PROMPT)
  np.testing.assert_allclose(logits, model(PROMPT), atol=1e-5)


@pytest.mark.slow
def test_top_k_one_is_greedy_and_a_key_gives_the_same_tokens_twice():
  # The token count and the draws' settings are the sharded test's: the same
  # programs, compiled once in a run (the jit cache, or the persistent one).
  model = _llama()
  greedy = decode.generate(model, PROMPT, 12)
  one = decode.generate(model, PROMPT, 12, temperature=2.0, top_k=1, key=jax.random.key(3))
  np.testing.assert_array_equal(one, greedy)
  a = decode.generate(model, PROMPT, 12, temperature=1.0, top_k=4, key=jax.random.key(4))
  b = decode.generate(model, PROMPT, 12, temperature=1.0, top_k=4, key=jax.random.key(4))
  c = decode.generate(model, PROMPT, 12, temperature=1.0, top_k=4, key=jax.random.key(5))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)  # other keys, other draws (a fixed model: deterministic)


@pytest.mark.slow
def test_every_sampled_token_is_in_the_top_k_of_the_uncached_logits():
  model, k, start = _llama(), 3, PROMPT.shape[1]
  out = np.asarray(
    decode.generate(model, PROMPT, 12, temperature=3.0, top_k=k, key=jax.random.key(0))
  )
  # Causal: position t - 1 of one forward pass over the whole output holds
  # the logits the uncached decoder reads before choosing token t.
  every = np.asarray(model(jnp.asarray(out)))
  for t in range(start, out.shape[1]):
    top = np.argsort(-every[:, t - 1], axis=-1)[:, :k]
    for row in range(out.shape[0]):
      assert out[row, t] in top[row], (t, row, out[row, t], top[row])


def test_bad_arguments_are_named():
  model = _llama()
  with pytest.raises(ValueError, match="num_tokens=30"):
    decode.generate(model, PROMPT, 30)
  with pytest.raises(ValueError, match="top_k=500"):
    decode.generate(model, PROMPT, 2, temperature=1.0, top_k=500)
  with pytest.raises(ValueError, match="max_len=99"):
    decode.generate(model, PROMPT, 2, max_len=99)


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_cache_is_sharded_on_the_mesh_and_gives_the_same_tokens(scan_layers):
  model = _llama(scan_layers=scan_layers)
  mesh = create_mesh("data=2,tensor=2", devices=jax.devices()[:4])
  graphdef, state = nnx.split(model)
  params = nnx.state(model, nnx.Param)
  shardings = rules.logical_to_sharding(logical_axes(params), mesh, rules.FSDP_TP, shapes=params)
  placed = nnx.merge(graphdef, jax.device_put(state, shardings))
  _, cache = decode.prefill(placed, PROMPT, rules=rules.FSDP_TP, mesh=mesh)
  # batch over data, the key/value heads over tensor: a quarter of the cache per device
  assert cache.keys.sharding.spec == jax.sharding.PartitionSpec(None, "data", "tensor")
  assert decode.cache_bytes_per_device(cache) * 4 == 2 * cache.keys.nbytes
  sharded = decode.generate(placed, PROMPT, 12, rules=rules.FSDP_TP, mesh=mesh)
  np.testing.assert_array_equal(sharded, decode.generate(model, PROMPT, 12))
  drawn = dict(temperature=1.0, top_k=4, key=jax.random.key(9))
  np.testing.assert_array_equal(
    decode.generate(placed, PROMPT, 12, rules=rules.FSDP_TP, mesh=mesh, **drawn),
    decode.generate(model, PROMPT, 12, **drawn),
  )


# ---------------------------------------------------------------------------
# The plan: the cache's memory per device, from its shapes and shardings.


def test_the_plan_has_the_kv_cache_row_with_its_bytes():
  from configs import llama_tiny
  from trainers.planning import plan as plan_lib
  from trainers.planning import targets
  from trainers.planning.report import format_plan

  config = llama_tiny.get_config()
  config.mesh.ici, config.mesh.rules = "data=-1,tensor=2", "fsdp_tp"
  target = targets.gpu_target("h100", 4)
  plan = plan_lib.make_plan(config, target, compile_step=False)
  m = config.model
  # k and v, layers, batch, length, kv heads, head dim, float32; batch over data=2, heads over tensor=2
  total = 2 * m.num_layers * config.global_batch * m.seq_len * m.num_kv_heads * 32 * 4
  assert plan.kv_cache.total_bytes == total
  assert plan.kv_cache.bytes_per_device == total // 4
  assert plan.kv_cache.spec == "P(None, 'data', 'tensor')"
  assert (
    f"kv cache         {total // 4 / 1024:.2f} KiB (decode, {config.global_batch} x {m.seq_len}:"
    in format_plan(plan)
  )
  assert plan.to_dict()["kv_cache"]["bytes_per_device"] == total // 4
  small = plan_lib.make_plan(config, target, compile_step=False, decode_batch=2)
  assert small.kv_cache.bytes_per_device == total // config.global_batch * 2 // 4
  with pytest.raises(ValueError, match="batch=3"):
    plan_lib.make_plan(config, target, compile_step=False, decode_batch=3)


# ---------------------------------------------------------------------------
# spmd-sample on a run: restore, encode through the run's tokenizer, decode.


def test_a_byte_level_runs_codec_is_bytes(tmp_path):
  from configs import lm_tiny_bytes
  from trainers.sampling.sample import run_codec

  codec = run_codec(lm_tiny_bytes.get_config(), str(tmp_path))
  assert codec.describe == "bytes" and codec.decode(codec.encode("déf")) == "déf"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_spmd_sample_on_a_tiny_llama_run_prints_the_runs_own_greedy_sample(tmp_path):
  """Reads the straight llama_tiny run tests/test_llama.py resumes (tests/shared_runs.py)."""
  import subprocess
  import sys

  from tests import shared_runs
  from tests.multiprocess import ROOT

  folder, facts = shared_runs.llama_tiny_run()
  workdir = shared_runs.copy_of(folder / "run", tmp_path / "run")
  env = {"PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": facts["data"]["cache"]}
  assert (workdir / "tokenizer.json").exists()
  # The run's own end-of-run sample (the Llama task's, with the cache), as it printed it.
  output = facts["output"]
  assert "sample (greedy, prompt 'the', text through the tokenizer" in output, output[-2000:]
  sample = subprocess.run(
    [sys.executable, "-m", "trainers.sampling.sample_cli", f"--workdir={workdir}", "--prompt=the",
     "--num_tokens=12"],
    capture_output=True, text=True, timeout=120, cwd=str(ROOT), env={**env, "PATH": ""},
  )  # fmt: skip
  assert sample.returncode == 0, sample.stderr
  # The checkpoint restored on one device continues the prompt as the run's model did.
  assert sample.stdout.startswith("the") and f":\n{sample.stdout}" in output, (
    sample.stdout,
    output[-1000:],
  )
  assert "step 40, " in sample.stderr and "+ 12 new tokens (greedy" in sample.stderr, sample.stderr
  drawn = subprocess.run(
    [sys.executable, "-m", "trainers.sampling.sample_cli", f"--workdir={workdir}", "--prompt=the model",
     "--num_tokens=8", "--temperature=1.0", "--top_k=5", "--seed=2", "--step=20"],
    capture_output=True, text=True, timeout=120, cwd=str(ROOT), env={**env, "PATH": ""},
  )  # fmt: skip
  assert drawn.returncode == 0 and drawn.stdout.startswith("the model"), drawn.stderr


def test_a_byte_level_run_decodes_bytes_whatever_its_vocabulary_size(tmp_path):
  """A byte-level run with a 32,000-id vocabulary (the TPU check's) shows text, not ids."""
  from configs import lm_tiny_bytes
  from trainers.sampling.sample import run_codec

  config = lm_tiny_bytes.get_config()
  config.model.vocab_size = 32000
  codec = run_codec(config, str(tmp_path))
  assert codec.decode(list("déf".encode())) == "déf"
  # An id past the bytes (never in byte data) shows as U+FFFD, the text around it intact.
  assert codec.decode([104, 105, 31999, 0xC3, 0xA9]) == "hi\ufffdé"
  assert "U+FFFD" in codec.describe


@pytest.mark.slow
@pytest.mark.multiprocess
def test_spmd_sample_of_ragged_jsonl_prompts_decodes_each_as_alone_on_one_and_two_processes(
  tmp_path,
):
  """Reads the llama_tiny run tests/test_llama.py resumes (tests/shared_runs.py); one test for
  both the one-process and the 2 x 2 launch, so that the run is copied and compiled once."""
  import json
  import subprocess
  import sys

  from launch.local import run_local
  from tests import shared_runs
  from tests.multiprocess import ROOT
  from trainers.checkpoints import saved_run
  from trainers.sampling import restore, sample

  folder, facts = shared_runs.llama_tiny_run()
  workdir = shared_runs.copy_of(folder / "run", tmp_path / "run")
  env = {"PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": facts["data"]["cache"]}
  config = saved_run.saved_config(workdir)
  codec = sample.run_codec(config, str(workdir))
  new = 10
  # BOS alone (1 token), short ones, and one that leaves exactly `new` slots of seq_len;
  # each length is two programs for its decode alone below: no more prompts than that.
  texts = ["", "the", "the model of"]
  long_text = " ".join(["the"] * 80)
  while len(codec.encode(long_text)) > config.model.seq_len - new:
    long_text = long_text[:-4]
  texts.append(long_text)
  assert len(codec.encode(long_text)) == config.model.seq_len - new, len(codec.encode(long_text))
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
  command = [sys.executable, "-m", "trainers.sampling.sample_cli", f"--workdir={workdir}",
             f"--prompts={prompts}", f"--num_tokens={new}"]  # fmt: skip
  one = subprocess.run(
    [*command, f"--out={tmp_path / 'one.jsonl'}"],
    capture_output=True, text=True, timeout=180, cwd=str(ROOT), env={**env, "PATH": ""},
  )  # fmt: skip
  assert one.returncode == 0, one.stderr
  assert "4 prompt(s) of 1..54 tokens" in one.stderr and "tokens/s" in one.stderr, one.stderr
  rows = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
  assert [r["prompt"] for r in rows] == texts
  # Each row is its prompt decoded alone, with the cache and without, on one CPU device.
  model = restore.restore_model(config, saved_run.find_checkpoint(str(workdir), "", None), True)
  tokenizer = sample.run_tokenizer(config, str(workdir))
  for row, text in zip(rows, texts, strict=True):
    ids = jnp.array([codec.encode(text)], jnp.int32)
    for alone in (
      decode.generate(model.model, ids, new), decode.generate_uncached(model.model, ids, new)
    ):  # fmt: skip
      made = np.asarray(alone)[0, ids.shape[1] :].tolist()
      if tokenizer.eos_id in made:
        made = made[: made.index(tokenizer.eos_id)]
      assert row["completion"] == codec.decode(made), (row, made)
  # Two processes of two devices: the batch split over the run's mesh, the same rows.
  two = run_local(
    [*command, f"--out={tmp_path / 'two.jsonl'}"], num_processes=2, devices_per_process=2,
    timeout_s=240, grace_s=10, echo=False, cwd=str(ROOT), env=env,
  )  # fmt: skip
  assert two.ok, two.report()
  assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()


def test_a_prompts_files_bad_row_is_one_line_naming_the_file_and_line(tmp_path, capsys):
  from trainers.sampling.sample_cli import main, read_prompts

  good = tmp_path / "good.jsonl"
  good.write_text('{"prompt": "a"}\n\n{"prompt": "b", "seed": 9}\n{"prompt": "c"}\n')
  assert read_prompts(str(good), 5) == (["a", "b", "c"], [5, 9, 7])  # default: --seed + row
  bad = tmp_path / "bad.jsonl"
  for rows, message in [
    ('{"prompt": "a"}\n{"prompt": "b"', "line 2: not JSON"),
    ('{"prompt": "a"}\n{"text": "b"}\n', 'line 2: a row is {"prompt": "text"}'),
    ('["a"]\n', 'line 1: a row is {"prompt": "text"}'),
    ('{"prompt": "a", "seed": -1}\n', "line 1: seed=-1 must be an integer"),
    ("\n", "has no rows"),
  ]:
    bad.write_text(rows)
    assert main([f"--workdir={tmp_path}", f"--prompts={bad}"]) == 2
    err = capsys.readouterr().err
    assert f"--prompts={bad}" in err and message in err and err.count("\n") == 1, err
  assert main([f"--workdir={tmp_path}", f"--prompts={tmp_path / 'none.jsonl'}"]) == 2
  assert "no such file" in capsys.readouterr().err


def test_a_completion_ends_with_the_first_stop_string_its_text_reaches():
  from trainers.data.prepare.token_codec import byte_codec, cut_at_stop

  codec = byte_codec(256)
  new = list(b"x = 1\n\ndef f():\n###")
  assert cut_at_stop(codec, new, ["\n\n"]) == ("x = 1\n\n", 7)
  assert cut_at_stop(codec, new, ["###", "def"]) == ("x = 1\n\ndef", 10)  # the first reached
  # A stop string made of two tokens' text, split across them.
  assert cut_at_stop(codec, new, ["1\n"]) == ("x = 1\n", 6)
  assert cut_at_stop(codec, new, ["never"]) is None and cut_at_stop(codec, new, []) is None


@pytest.mark.slow
def test_the_weights_restore_onto_the_runs_mesh_in_the_compute_dtype(tmp_path):
  """Reads the llama_tiny run tests/test_llama.py resumes (tests/shared_runs.py), as bfloat16."""
  from tests import shared_runs
  from trainers.checkpoints import saved_run
  from trainers.sampling import restore

  folder, _ = shared_runs.llama_tiny_run()
  workdir = shared_runs.copy_of(folder / "run", tmp_path / "run")
  config = saved_run.saved_config(workdir)
  config.train.precision = "bfloat16"
  ref = saved_run.find_checkpoint(str(workdir), "", None)
  restored = restore.restore_model(config, ref)
  params = jax.tree.leaves(nnx.state(restored.model, nnx.Param))
  assert {str(p.dtype) for p in params} == {"bfloat16"}
  # The run's mesh (data=-1) over this process's 8 devices: the batch splits 8 ways.
  assert restored.mesh.devices.size == 8 and restored.batch_multiple == 8
  assert {d for p in params for d in p.devices()} == set(jax.devices())
  # The numbers are the checkpoint's, rounded to bfloat16.
  saved = saved_run.restore_weights(ref)["params"]
  table = np.asarray(saved["token_embed"], np.float32)
  np.testing.assert_array_equal(
    np.asarray(restored.model.token_embed[...], np.float32),
    table.astype(jnp.bfloat16).astype(np.float32),
  )
