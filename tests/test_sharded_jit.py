"""sharded_jit in one process with 8 CPU devices: every argument, every error."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd import PartitionSpec as P
from spmd import sharded_jit, with_sharding_constraint

X = np.arange(64, dtype=np.float32).reshape(8, 8) / 10
NP = jax.sharding.PartitionSpec


def devices_of(array):
  return sorted(d.id for d in array.sharding.device_set)


def test_partition_spec_is_a_hashable_pytree_leaf():
  spec = P(2, 1)
  assert repr(spec) == "PartitionSpec(2, 1)" and repr(P(4)) == "PartitionSpec(4)"
  assert hash(spec) == hash(P(2, 1)) and spec == P(2, 1) and spec != P(1, 2)
  assert spec.num_partitions == 2
  assert jax.tree_util.tree_leaves({"a": spec, "b": (P(4),)}) == [spec, P(4)]
  with pytest.raises(ValueError, match=r"counts=\(2, 0\)"):
    P(2, 0)
  with pytest.raises(ValueError, match="positive ints"):
    P(2.0)


def test_counts_on_inputs_and_outputs_match_numpy():
  f = sharded_jit(lambda a, b: a @ b, in_parts=(P(2, 2), P(4, 1)), out_parts=P(1, 4))
  out = f(X, X)
  np.testing.assert_allclose(out, X @ X, rtol=1e-5)
  assert devices_of(out) == [0, 1, 2, 3]  # the first 4 local devices
  assert out.sharding.shard_shape(out.shape) == (8, 2)


def test_every_spec_kind_in_one_tree():
  f = sharded_jit(
    lambda d: {"y": d["a"] + d["b"].sum(), "z": d["a"] * 2},
    in_parts=({"a": P(8, 1), "b": None},),
    out_parts={"y": P(2, 4), "z": None},
  )
  out = f({"a": X, "b": X})
  np.testing.assert_allclose(out["y"], X + X.sum(), rtol=1e-5)
  np.testing.assert_allclose(out["z"], X * 2)
  assert out["y"].sharding.shard_shape(X.shape) == (4, 2)
  assert out["z"].sharding.is_fully_replicated


def test_conflicting_products_name_the_specs():
  with pytest.raises(
    ValueError,
    match=r"in_parts: PartitionSpec\(2, 2\) \(product 4\); "
    r"out_parts: PartitionSpec\(8, 1\) \(product 8\)",
  ):
    sharded_jit(lambda a: a, in_parts=P(2, 2), out_parts=P(8, 1))
  with pytest.raises(ValueError, match="num_partitions=2 conflicts"):
    sharded_jit(lambda a: a, in_parts=P(4, 1), out_parts=None, num_partitions=2)


def test_num_partitions_places_replicated_work():
  f = sharded_jit(lambda a: a + 1, in_parts=None, out_parts=None, num_partitions=4)
  out = f(X)
  assert devices_of(out) == [0, 1, 2, 3] and out.sharding.is_fully_replicated


def test_too_few_devices_is_the_original_error():
  f = sharded_jit(lambda a: a, in_parts=P(16, 1), out_parts=P(16, 1))
  with pytest.raises(ValueError, match="requires 16 devices, but only 8 devices are available"):
    f(np.zeros((16, 4)))


def test_bad_spec_types_are_type_errors():
  with pytest.raises(TypeError, match="in_parts must hold"):
    sharded_jit(lambda a: a, in_parts=[2, 1], out_parts=None)
  with pytest.raises(TypeError, match="with_sharding_constraint partitions"):
    sharded_jit(lambda a: with_sharding_constraint(a, (2, 1)), None, None)(X)


def test_in_parts_length_and_out_parts_prefix_are_checked():
  f = sharded_jit(lambda a, b: a + b, in_parts=(P(2, 1),), out_parts=P(2, 1))
  with pytest.raises(ValueError, match="has 1 entries but .* called with 2"):
    f(X, X)
  g = sharded_jit(lambda a: (a, a), in_parts=P(2, 1), out_parts=(P(2, 1), P(2, 1), None))
  with pytest.raises(ValueError, match="out_parts=.* is not a tree prefix"):
    g(X)


def test_local_parts_in_one_process_must_equal_the_global_ones():
  same = sharded_jit(
    lambda a: a * 3,
    in_parts=P(4, 1),
    out_parts=P(4, 1),
    local_in_parts=P(4, 1),
    local_out_parts=P(4, 1),
  )
  np.testing.assert_allclose(same(X), X * 3)
  other = sharded_jit(lambda a: a, in_parts=P(4, 1), out_parts=P(4, 1), local_in_parts=P(2, 1))
  with pytest.raises(ValueError, match=r"local_in_parts=PartitionSpec\(2, 1\) differs"):
    other(X)
  with pytest.raises(ValueError, match="local_in_parts=.* must have the same structure"):
    sharded_jit(lambda a, b: a, in_parts=P(4, 1), out_parts=None, local_in_parts=(P(4, 1), P(4, 1)))


def test_static_argnums_compile_per_value_and_check_arity():
  traces = []

  def scale(a, k):
    traces.append(k)
    return a * k

  f = sharded_jit(scale, in_parts=P(4, 2), out_parts=P(8, 1), static_argnums=1)
  np.testing.assert_allclose(f(X, 3), X * 3)
  f(X, 3)
  np.testing.assert_allclose(f(X, 5), X * 5)
  assert traces == [3, 5]
  with pytest.raises(
    ValueError,
    match=r"static_argnums=\(1,\) but was called with only 1 "
    "positional argument. All static",
  ):
    f(X)


def test_keyword_arguments():
  def affine(a, b, c=None, *, scale, shift=0.0):
    return a * scale + b + shift + (0 if c is None else c)

  f = sharded_jit(affine, in_parts=P(8, 1), out_parts=P(8, 1))
  np.testing.assert_allclose(f(X, b=X, scale=2.0), X * 2 + X)
  np.testing.assert_allclose(f(a=X, b=X, c=X, scale=1.0, shift=1.0), X * 3 + 1)
  g = sharded_jit(affine, in_parts=(P(8, 1), None), out_parts=P(8, 1), static_argnums=())
  np.testing.assert_allclose(g(X, X, scale=3.0), X * 4)


def test_donate_argnums_marks_the_buffer():
  f = sharded_jit(lambda a, b: a + b, in_parts=P(4, 1), out_parts=P(4, 1), donate_argnums=0)
  np.testing.assert_allclose(f(X, X), 2 * X)
  hlo = f.lower(X, X).as_text()
  assert "tf.aliasing_output" in hlo or "jax.buffer_donor" in hlo


def test_grad_and_vjp_through_sharded_jit():
  f = sharded_jit(lambda a: jnp.tanh(a) @ a, in_parts=P(4, 2), out_parts=P(8, 1))
  loss = lambda a: jnp.sum(f(a) ** 2)  # noqa: E731
  reference = lambda a: jnp.sum((jnp.tanh(a) @ a) ** 2)  # noqa: E731
  np.testing.assert_allclose(jax.grad(loss)(X), jax.grad(reference)(X), rtol=1e-4)
  y, vjp = jax.vjp(f, X)
  (ct,) = vjp(jnp.ones_like(y))
  np.testing.assert_allclose(
    ct, jax.vjp(lambda a: jnp.tanh(a) @ a, X)[1](jnp.ones((8, 8)))[0], rtol=1e-4
  )


def test_constraint_transpose_constrains_the_cotangent():
  def body(a):
    return with_sharding_constraint(jnp.sin(a), P(2, 2)) * 3

  f = sharded_jit(body, in_parts=None, out_parts=None)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda a: f(a).sum()))(X))
  assert jaxpr.count("sharding_constraint") == 2, jaxpr
  assert jaxpr.count("spec=P('local0', 'local1')") == 2, jaxpr
  np.testing.assert_allclose(jax.grad(lambda a: f(a).sum())(X), 3 * np.cos(X), rtol=1e-5)


def test_partition_count_discovered_from_constraints():
  def body(a):
    return with_sharding_constraint(a @ a, P(4, 1)) + 1

  f = sharded_jit(body, in_parts=None, out_parts=None)
  out = f(X)
  np.testing.assert_allclose(out, X @ X + 1, rtol=1e-5)
  assert devices_of(out) == [0, 1, 2, 3]
  bad = sharded_jit(
    lambda a: with_sharding_constraint(with_sharding_constraint(a, P(2, 1)), P(4, 1)), None, None
  )
  with pytest.raises(ValueError, match="constraints disagree on the partition count"):
    bad(X)


def test_constraint_product_must_match_the_computation():
  f = sharded_jit(lambda a: with_sharding_constraint(a, P(2, 1)), P(4, 1), P(4, 1))
  with pytest.raises(
    ValueError,
    match=r"with_sharding_constraint partitions=PartitionSpec\(2, 1\)"
    " splits 2 ways, but the computation has 4",
  ):
    f(X)


def test_with_sharding_constraint_outside_is_the_original_error():
  with pytest.raises(NotImplementedError, match=r"should only be called inside sharded_jit\(\)"):
    with_sharding_constraint(X, P(2, 1))
  with pytest.raises(NotImplementedError):
    jax.jit(lambda a: with_sharding_constraint(a, None))(X)


def test_callable_inside_jax_jit():
  f = sharded_jit(lambda a: a @ a, in_parts=P(4, 1), out_parts=P(1, 4))
  np.testing.assert_allclose(jax.jit(lambda a: f(a) + 1)(X), X @ X + 1, rtol=1e-5)


def test_nested_specs_become_constraints():
  inner = sharded_jit(lambda a: a * 2, in_parts=P(1, 4), out_parts=P(4, 1))
  outer = sharded_jit(lambda a: inner(a) + 1, in_parts=P(4, 1), out_parts=None)
  np.testing.assert_allclose(outer(X), X * 2 + 1)
  jaxpr = str(jax.make_jaxpr(outer)(X))
  assert jaxpr.count("sharding_constraint") == 2, jaxpr
  assert "spec=P(None, ('local0', 'local1'))" in jaxpr
  wrong = sharded_jit(lambda a: sharded_jit(lambda b: b, P(2, 1), P(2, 1))(a), P(4, 1), None)
  with pytest.raises(ValueError, match="splits 2 ways but is called inside"):
    wrong(X)


def test_compiles_once_per_signature_and_logs(caplog):
  traces = []

  def body(a):
    traces.append((a.shape, a.dtype))
    return a + 1

  f = sharded_jit(body, in_parts=P(2, 1), out_parts=P(2, 1))
  for _ in range(3):
    f(X)
  f(X.astype(np.int32))
  f(X[:4])
  assert [s for s, _ in traces] == [(8, 8), (8, 8), (4, 8)]
  # Like jax.jit, device arrays and numpy inputs are traced separately, once.
  on_device = jax.device_put(X, f(X).sharding)
  f(on_device)
  f(on_device + 1)
  assert len(traces) == 4
  jax.config.update("jax_log_compiles", True)
  try:
    with caplog.at_level(logging.WARNING, logger="spmd.sharded_jit"):
      f(X[:2])
  finally:
    jax.config.update("jax_log_compiles", False)
  assert (
    "sharded_jit: compiling test_compiles_once_per_signature_and_logs.<locals>.body "
    "for 2 devices with args ['float32[2, 8]']" in caplog.text
  )


def test_an_error_while_tracing_is_raised_at_once_not_traced_again():
  # An error from the traced function is raised as it is: nothing traces the
  # function a second time, so its trace-time side effects run once.
  traces = []

  def body(a):
    traces.append(a.shape)
    if a.shape[0] != 8:
      raise ValueError(f"rows={a.shape[0]} must be 8")
    return a + 1

  f = sharded_jit(body, in_parts=P(2, 1), out_parts=P(2, 1))
  f(X)
  assert f.sharded_jit.fast is not None
  with pytest.raises(ValueError, match="rows=4 must be 8"):
    f(X[:4])
  assert traces == [(8, 8), (4, 8)]
  # The full path does not retry it either, with committed arrays to move.
  traces.clear()
  committed = jax.device_put(X[:4], jax.devices()[5])
  with pytest.raises(ValueError, match="rows=4 must be 8"):
    f.sharded_jit.call((committed,), {})
  assert traces == [(4, 8)]


def test_committed_arrays_with_another_sharding_are_moved_on_device():
  f = sharded_jit(lambda a: a - 1, in_parts=P(4, 1), out_parts=P(4, 1))
  other = jax.device_put(
    X,
    jax.sharding.NamedSharding(
      jax.make_mesh(
        (4,), ("x",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
      ),
      NP(None, "x"),
    ),
  )
  np.testing.assert_allclose(f(other), X - 1)


def test_named_axes_on_a_two_dimensional_mesh():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  f = sharded_jit(
    lambda a, w: a @ w,
    in_parts=(NP("data", None), NP(None, "model")),
    out_parts=NP("data", "model"),
    mesh=mesh,
  )
  out = f(X, X)
  np.testing.assert_allclose(out, X @ X, rtol=1e-5)
  assert out.sharding.spec == NP("data", "model") and out.sharding.mesh == mesh
  mixed = sharded_jit(lambda a: a, in_parts=NP("data"), out_parts=P(8, 1), mesh=mesh)
  assert mixed(X).sharding.spec == NP(("data", "model"), None)
  with pytest.raises(ValueError, match="needs the mesh=... argument"):
    sharded_jit(lambda a: a, in_parts=NP("data"), out_parts=None)
  with pytest.raises(ValueError, match=r"names axes \['rows'\]"):
    sharded_jit(lambda a: a, in_parts=NP("rows"), out_parts=None, mesh=mesh)(X)
  with pytest.raises(ValueError, match="mesh size=8 conflicts"):
    sharded_jit(lambda a: a, in_parts=P(4, 1), out_parts=None, mesh=mesh)


def test_counts_that_fit_no_mesh_grouping_are_reported():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  f = sharded_jit(lambda a: a, in_parts=P(1, 8), out_parts=P(8, 1), mesh=mesh)
  assert f(X).sharding.spec == NP(("data", "model"), None)
  with pytest.raises(ValueError, match="cannot be laid out on mesh axes"):
    spmd.partition.assign_axes((4, 4), [("a", 8), ("b", 2)])


def test_device_order_is_process_then_id():
  order = spmd.device_order()
  assert order == sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  assert spmd.mesh.devices_for_partitions(3) == order[:3]
  with pytest.raises(ValueError, match="num_partitions=0 must be at least 1"):
    spmd.mesh.devices_for_partitions(0)


def test_partition_mesh_has_prime_axes_so_every_spec_fits():
  mesh = spmd.mesh.partition_mesh(jax.devices()[:8])
  assert dict(mesh.shape) == {"local0": 2, "local1": 2, "local2": 2}
  for counts in [(8, 1), (1, 8), (2, 4), (4, 2), (2, 2, 2)]:
    spec = spmd.partition.assign_axes(counts, list(mesh.shape.items()))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    shape = tuple(8 for _ in counts)
    assert sharding.shard_shape(shape) == tuple(8 // c for c in counts)
