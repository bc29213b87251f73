"""Text from a trained run through a KV cache: `sample.py` is the library, `sample_cli.py` is `spmd-sample`."""
