"""spmd._jit: `sharded_jit`'s internals, not API.

`spmd/sharded_jit.py` is the transform; these modules are the parts it is
built from, and nothing else in the product imports them:

  * `arguments`: the options about arguments and outputs, checked once;
  * `placement`: the plan, each spec resolved onto one mesh;
  * `fast_path`: when a plain call can be the `jax.jit` call itself;
  * `cross_process`: pieces in, pieces out, one agreement record per signature;
  * `tracing`: what a function sees while JAX traces it.

Their names, signatures and split may change in any release. Import the
public API from `spmd` (its `__all__`; see docs/sharded_jit.md).
"""
