"""One process of a multi-process sharded_jit test; checks its own results.

Run by tests/test_sharded_jit_multiprocess.py through tests/multiprocess.py.
Usage: sharded_jit_worker.py MODE[,MODE...]; modes: all, tracers, agree-once,
  changed-signature=P, mismatch-shape, mismatch-dtype, mismatch-divisible, device-errors
"""

import sys
import time

import numpy as np

import spmd

spmd.initialize()

import jax  # noqa: E402  (after initialize, which sets the device count)
import jax.numpy as jnp  # noqa: E402

from spmd import PartitionSpec as P  # noqa: E402
from spmd import multihost, sharded_jit, with_sharding_constraint  # noqa: E402

pid, nproc = jax.process_index(), jax.process_count()
L = jax.local_device_count()
N = jax.device_count()
assert N == nproc * L, (N, nproc, L)

ROWS = 4 * N  # global rows; each process owns ROWS // nproc of them
COLS = 8
X = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) / 100
W = np.linspace(-1, 1, COLS * 3, dtype=np.float32).reshape(COLS, 3)
mine = slice(pid * ROWS // nproc, (pid + 1) * ROWS // nproc)


def close(a, b, what):
  a = np.asarray(a)
  if a.shape != np.shape(b) or not np.allclose(a, b, rtol=1e-5, atol=1e-5):
    raise AssertionError(f"process {pid} {what}: got {a.shape}\n{a}\nexpected {np.shape(b)}\n{b}")
  print(f"PASS {what}", flush=True)


def round_trip():
  f = sharded_jit(
    lambda x: x * 2 + 1,
    in_parts=P(N, 1),
    out_parts=P(N, 1),
    local_in_parts=P(L, 1),
    local_out_parts=P(L, 1),
  )
  close(f(X[mine]), X[mine] * 2 + 1, "round trip rows")


def _two_dims_fn():
  # Processes split the rows, local devices split the columns.
  return sharded_jit(
    lambda x, w: jnp.tanh(x) @ w,
    in_parts=(P(nproc, L), None),
    out_parts=P(N, 1),
    local_in_parts=(P(1, L), None),
    local_out_parts=P(L, 1),
  )


two_dims_fn = _two_dims_fn()


def two_dims():
  close(two_dims_fn(X[mine], W), np.tanh(X[mine]) @ W, "2-D split + replicated weight")


def keyword_and_static():
  def scaled(x, k, *, bias):
    return x * k + bias

  f = sharded_jit(
    scaled,
    in_parts=P(N, 1),
    out_parts=P(N, 1),
    local_in_parts=P(L, 1),
    local_out_parts=P(L, 1),
    static_argnums=1,
  )
  close(f(X[mine], 3, bias=np.float32(0.5)), X[mine] * 3 + 0.5, "static + keyword-only")
  close(f(x=X[mine], k=2, bias=np.float32(0)), X[mine] * 2, "all by keyword")


def grad_through():
  # out = x * sum(x) couples all rows across processes: the gradient of the
  # sum of every process's loss is 2 * sum(X) everywhere.
  f = sharded_jit(
    lambda x: x * jnp.sum(x),
    in_parts=P(N, 1),
    out_parts=P(N, 1),
    local_in_parts=P(L, 1),
    local_out_parts=P(L, 1),
  )
  g = jax.grad(lambda x: jnp.sum(f(x)))(X[mine])
  close(g, np.full_like(X[mine], 2 * X.sum()), "grad through local pieces")
  # A replicated scalar output: every process holds the same loss, and the
  # gradient is that one loss's, not the sum over processes.
  h = sharded_jit(
    lambda x: jnp.sum(x * x),
    in_parts=P(N, 1),
    out_parts=None,
    local_in_parts=P(L, 1),
    local_out_parts=None,
  )
  close(jax.grad(h)(X[mine]), 2 * X[mine], "grad through a replicated output")
  w_grad = jax.grad(lambda w: jnp.sum(two_dims_fn(X[mine], w)))(W)
  close(
    w_grad,
    np.tanh(X).sum(axis=0)[:, None] * np.ones((1, 3)),
    "grad of a replicated input sums over every process's rows",
  )


def constraint_inside():
  def body(x):
    y = with_sharding_constraint(x @ x.T, P(1, N))
    return with_sharding_constraint(y.sum(axis=1), None)

  f = sharded_jit(
    body, in_parts=P(N, 1), out_parts=None, local_in_parts=P(L, 1), local_out_parts=None
  )
  close(f(X[mine]), (X @ X.T).sum(axis=1), "constraints inside, replicated output whole")


def global_arrays_pass_through():
  sharding = jax.sharding.NamedSharding(
    jax.make_mesh(
      (N,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,), devices=spmd.device_order()
    ),
    jax.sharding.PartitionSpec("rows"),
  )
  gx = jax.make_array_from_process_local_data(sharding, X[mine], X.shape)
  f = sharded_jit(lambda x: x - 1, in_parts=P(N, 1), out_parts=P(N, 1), local_in_parts=P(L, 1))
  out = f(gx)  # no local_out_parts: the global array comes back
  assert not out.is_fully_addressable and out.shape == X.shape, out
  local = np.concatenate(
    [np.asarray(s.data) for s in sorted(out.addressable_shards, key=lambda s: s.index[0].start)]
  )
  close(local, X[mine] - 1, "global array in, global array out")


def named_global_fast_path():
  # Named specs, no local parts: global arrays in and out, straight to jax.jit
  # after the first call; a numpy input still gets the clear error.
  mesh = jax.make_mesh(
    (N,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,), devices=spmd.device_order()
  )
  rows = jax.sharding.PartitionSpec("rows")
  # An empty named spec is a replicated global output (as the trainer's
  # metrics are): still all global, and every process can read it whole.
  f = sharded_jit(
    lambda x: (x * 3, x.sum()),
    in_parts=rows,
    out_parts=(rows, jax.sharding.PartitionSpec()),
    mesh=mesh,
  )
  gx = jax.make_array_from_process_local_data(
    jax.sharding.NamedSharding(mesh, rows), X[mine], X.shape
  )
  for _ in range(3):
    out, total = f(gx)
  assert f.sharded_jit.fast is not None, "the all-global plan should use the fast path"
  close(np.asarray(total), X.sum(), "replicated global output, read on every process")
  local = np.concatenate(
    [np.asarray(s.data) for s in sorted(out.addressable_shards, key=lambda s: s.index[0].start)]
  )
  close(local, X[mine] * 3, "named specs, global arrays, fast path")
  try:
    f(X[mine])
  except ValueError as e:
    assert "must be a global jax.Array" in str(e), e
    print("PASS numpy into a global-only call is a clear error", flush=True)
  else:
    raise AssertionError("numpy input to a global-only cross-process call was accepted")


def replicated_only():
  f = sharded_jit(
    lambda w: w @ w.T, in_parts=None, out_parts=None, num_partitions=N, local_num_partitions=L
  )
  close(f(W), W @ W.T, "replicated-only with local_num_partitions")


def compiles_once():
  traces = []

  def body(x):
    traces.append(x.shape)
    return x + 1

  f = sharded_jit(
    body, in_parts=P(N, 1), out_parts=P(N, 1), local_in_parts=P(L, 1), local_out_parts=P(L, 1)
  )
  for _ in range(3):
    f(X[mine])
  f(X[mine][: 2 * L])
  assert traces == [X.shape, (2 * L * nproc, COLS)], traces
  print("PASS traced once per signature", flush=True)


def close_global(a, expected, what):
  """Each of this process's shards of global `a` against the same block of `expected`."""
  assert not a.is_fully_addressable and a.shape == np.shape(expected), (a.shape, a.sharding)
  for s in a.addressable_shards:
    got, want = np.asarray(s.data), np.asarray(expected)[s.index]
    if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
      raise AssertionError(f"process {pid} {what}: shard {s.index}\n{got}\nexpected\n{want}")
  print(f"PASS {what}", flush=True)


def rows_global(data):
  """`data`, whose rows `mine` this process holds, as one global array split by rows."""
  mesh = jax.make_mesh(
    (N,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,), devices=spmd.device_order()
  )
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
  return jax.make_array_from_process_local_data(sharding, data[mine], data.shape)


def tracers_of_global_arrays():
  # jax.grad, jax.vjp and jax.jit hand sharded_jit tracers of global arrays;
  # each result must equal plain JAX's on the full data in this one process.
  def loss(x, w):
    # sum(x, axis=0) couples every process's rows.
    return jnp.sum(jnp.tanh(x @ w) * jnp.sum(x, axis=0)[:3]) ** 2

  f = sharded_jit(loss, in_parts=(P(N, 1), None), out_parts=None)
  gx = rows_global(X)
  want_x, want_w = jax.grad(loss, argnums=(0, 1))(X, W)
  close_global(jax.grad(f)(gx, W), want_x, "grad of a global array")
  close_global(jax.jit(jax.grad(f))(gx, W), want_x, "grad of a global array under jax.jit")
  value, vjp = jax.vjp(f, gx, W)
  ct_x, ct_w = vjp(jnp.ones_like(value))
  close(value, loss(X, W), "vjp of a global array: value")
  close_global(ct_x, want_x, "vjp of a global array: global cotangent")
  close(ct_w, want_w, "vjp of a global array: replicated cotangent")
  close(jax.jit(f)(gx, W), loss(X, W), "jax.jit of a global array")
  # An argument with local_in_parts takes a global array as it is, and its tracer too.
  h = sharded_jit(loss, in_parts=(P(N, 1), None), out_parts=None, local_in_parts=(P(L, 1), None))
  close_global(jax.grad(h)(gx, W), want_x, "grad of a global array through local_in_parts")
  close_global(
    jax.jit(jax.grad(h))(gx, W), want_x, "grad of a global array through local_in_parts, jitted"
  )
  close(jax.grad(h)(X[mine], W), want_x[mine], "grad of local pieces through local_in_parts")
  try:
    jax.grad(f)(X[mine], W)
  except ValueError as e:
    assert "must be a global jax.Array; got LinearizeTracer tracing a" in str(e), e
    print("PASS a traced local piece into a global-only call is a clear error", flush=True)
  else:
    raise AssertionError("a traced local piece into a global-only call was accepted")


def agreement_once():
  # A failure at a new signature on the fast path is raised at once: one
  # agreement round, one trace, however the fast path failed.
  rounds = []
  check = multihost.check_agreement

  def counting(what, record, timeout_s=None):
    rounds.append(what)
    return check(what, record, timeout_s)

  multihost.check_agreement = counting
  traces = []

  def body(x, k):
    traces.append(k)
    if k < 0:
      raise ValueError(f"k={k} must not be negative")
    return x * k

  mesh = jax.make_mesh(
    (N,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,), devices=spmd.device_order()
  )
  rows = jax.sharding.PartitionSpec("rows")
  f = sharded_jit(body, in_parts=rows, out_parts=rows, mesh=mesh, static_argnums=1)
  gx = rows_global(X)
  f(gx, 1)
  assert f.sharded_jit.fast is not None, "an all-global plan should use the fast path"
  try:
    rounds.clear()
    traces.clear()
    try:
      f(gx, 10 + pid)  # every process a new static value, each a different one
    except multihost.AgreementError as e:
      print(f"ERROR {type(e).__name__}: {e}", flush=True)
      assert len(rounds) == 1 and traces == [], (rounds, traces)
      print("PASS a disagreement on the fast path is one agreement round", flush=True)
    else:
      raise AssertionError("processes with different static arguments agreed")
    rounds.clear()
    traces.clear()
    try:
      f(gx, -1)
    except ValueError as e:
      assert "k=-1 must not be negative" in str(e), e
      assert len(rounds) == 1 and traces == [-1], (rounds, traces)
      print("PASS an error while tracing on the fast path traces once", flush=True)
    else:
      raise AssertionError("k=-1 raised nothing")
  finally:
    multihost.check_agreement = check


def changed_signature(changing):
  # Process `changing` passes fewer rows on the second call; the others reuse
  # the program compiled for the first, whose sum waits for every process.
  f = sharded_jit(
    lambda x: x * jnp.sum(x),
    in_parts=P(N, 1),
    out_parts=P(N, 1),
    local_in_parts=P(L, 1),
    local_out_parts=P(L, 1),
  )
  close(f(X[mine]), X[mine] * X.sum(), "first call agreed")
  rows = X[mine][:-L] if pid == changing else X[mine]
  print("CALLING with a changed signature", flush=True)
  np.asarray(f(rows))
  np.asarray(f(X[mine]))
  print(f"process {pid}: UNEXPECTED: the calls returned", flush=True)


def first_run_waits_for_the_slowest_compile(delay_s=3.0):
  """Process 1 finishes compiling `delay_s` later; no process runs the program before it.

  XLA's CPU collectives give peers a fixed 30 s to meet at a program's first
  run; spmd.compile_meeting closes the gap after compiling. Must run before
  any other cross-process call, so that this delay is the first listener.
  """
  import jax.monitoring

  client = multihost.runtime_client()

  delayed = []

  def late(event, duration, **kwargs):
    named = str(kwargs.get("fun_name", "")).endswith("(slowly_compiled)")
    compiled = event == "/jax/core/compile/backend_compile_duration"
    if pid == 1 and named and compiled and not delayed:
      time.sleep(delay_s)
      delayed.append(True)
      client.key_value_set("test/compiled_at", repr(time.time()))

  jax.monitoring.register_event_duration_secs_listener(late)

  def slowly_compiled(x):
    return jnp.sum(x) * jnp.ones((N, 1))

  f = sharded_jit(
    slowly_compiled,
    in_parts=P(N, 1),
    out_parts=P(N, 1),
    local_in_parts=P(L, 1),
    local_out_parts=P(L, 1),
  )
  out = f(X[mine])
  returned_at = time.time()
  close(out, np.full((N // nproc, 1), X.sum()), "the slowly compiled program's result")
  compiled_at = float(client.blocking_key_value_get("test/compiled_at", 60_000))
  if returned_at < compiled_at:
    raise AssertionError(
      f"process {pid} ran the program {compiled_at - returned_at:.2f}s before process 1 "
      "had compiled it"
    )
  print("PASS the first run waits for the slowest compile", flush=True)


def expect_error(fn, what):
  try:
    fn()
  except ValueError as e:
    print(f"ERROR {type(e).__name__}: {e}", flush=True)
    print(f"PASS {what}", flush=True)
    return
  raise AssertionError(f"process {pid}: {what} raised nothing")


def main(mode):
  if mode == "all":
    for scenario in (
      round_trip,
      two_dims,
      keyword_and_static,
      grad_through,
      constraint_inside,
      global_arrays_pass_through,
      named_global_fast_path,
      replicated_only,
      compiles_once,
    ):
      scenario()
  elif mode == "slow-compile":
    first_run_waits_for_the_slowest_compile()
  elif mode == "tracers":
    tracers_of_global_arrays()
  elif mode == "agree-once":
    agreement_once()
  elif mode.startswith("changed-signature="):  # =P: process P changes; -1 is the last
    changed_signature(int(mode.split("=")[1]) % nproc)
  elif mode == "mismatch-shape":
    rows = X[mine] if pid != nproc - 1 else X[mine][:-L]  # the last host is short
    f = sharded_jit(
      lambda x: x * 2,
      in_parts=P(N, 1),
      out_parts=P(N, 1),
      local_in_parts=P(L, 1),
      local_out_parts=P(L, 1),
    )
    expect_error(lambda: f(rows), "shape mismatch detected")
  elif mode == "mismatch-dtype":
    rows = X[mine] if pid != 0 else X[mine].astype(np.int32)
    f = sharded_jit(
      lambda x: x * 2,
      in_parts=P(N, 1),
      out_parts=P(N, 1),
      local_in_parts=P(L, 1),
      local_out_parts=P(L, 1),
    )
    expect_error(lambda: f(rows), "dtype mismatch detected")
  elif mode == "mismatch-divisible":
    rows = X[mine] if pid != nproc - 1 else X[mine][:-1]  # not divisible by L
    f = sharded_jit(
      lambda x: x * 2,
      in_parts=P(N, 1),
      out_parts=P(N, 1),
      local_in_parts=P(L, 1),
      local_out_parts=P(L, 1),
    )
    expect_error(lambda: f(rows), "indivisible local piece on one host")
  elif mode == "device-errors":
    f = sharded_jit(lambda w: w + 1, in_parts=None, out_parts=None, num_partitions=N)
    expect_error(lambda: f(W), "replicated-only needs local_num_partitions")
    between = sharded_jit(lambda x: x, in_parts=P(L + 1, 1), out_parts=P(L + 1, 1))
    expect_error(lambda: between(X), "between local and global device counts")
    fewer = sharded_jit(
      lambda x: x,
      in_parts=P(N, 1),
      out_parts=P(N, 1),
      local_in_parts=P(1, 1),
      local_num_partitions=1,
    )
    expect_error(lambda: fewer(X[mine]), "cross-process must use every local device")
  else:
    raise SystemExit(f"unknown mode {mode!r}")
  print("WORKER DONE", flush=True)


if __name__ == "__main__":
  for each in sys.argv[1].split(","):  # several modes, one after the other, in one job
    main(each)
