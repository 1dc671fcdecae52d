"""Tensor-parallel forward on 4 simulated CPU devices equals the single-device forward.

The device count is fixed when JAX initialises, so the check runs in a subprocess with
``--xla_force_host_platform_device_count=4``.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from eaglepangu_jax import cache as kv_cache
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.engine.decode import Teacher, generate
    from eaglepangu_jax.models import llama, sharding
    from eaglepangu_jax.models.config import LlamaConfig
    from eaglepangu_jax.models.init import random_params

    assert len(jax.devices()) == 4, jax.devices()
    fwd = jax.jit(llama.forward, static_argnames=("config", "feature_layers"))
    mesh = sharding.make_mesh(4)
    report = {}
    configs = {
        # Every dimension divides 4: heads, kv heads, FFN and vocabulary are all split.
        "divisible": LlamaConfig.tiny(num_heads=8, num_kv_heads=4, vocab_size=96),
        # 6 query / 3 kv heads and vocabulary 97 do not divide: those are replicated.
        "replicated_attention": LlamaConfig.tiny(num_heads=6, num_kv_heads=3),
    }
    for name, config in configs.items():
        params = random_params(config, jax.random.PRNGKey(0))
        tokens = jnp.asarray([1, 5, 9, 2, 7, 3], jnp.int32)
        mask = jnp.arange(16)[None, :] <= jnp.arange(6)[:, None]
        cache = kv_cache.init(config.num_layers, 16, config.num_kv_heads, config.head_dim)
        single, feats, c1 = fwd(params, tokens, jnp.arange(6), cache, mask, config=config,
                                feature_layers=(1,))
        sp = sharding.shard_params(params, mesh, config=config)
        sc = sharding.shard_cache(cache, mesh, config=config)
        multi, mfeats, c4 = fwd(sp, tokens, jnp.arange(6), sc, mask, config=config,
                                feature_layers=(1,))
        spec = SpecConfig(max_new_tokens=8)
        greedy1 = generate(Teacher(config, params), None, [1, 5, 9], spec).tokens
        greedy4 = generate(Teacher(config, sp), None, [1, 5, 9], spec).tokens
        report[name] = {
            "logits_diff": float(jnp.abs(single - multi).max()),
            "features_diff": float(jnp.abs(feats - mfeats).max()),
            "cache_diff": float(jnp.abs(c1.k - c4.k).max()),
            "greedy_equal": greedy1 == greedy4,
            "wq_spec": list(sp["layers"][0]["wq"].sharding.spec),
            "wk_spec": list(sp["layers"][0]["wk"].sharding.spec),
            "w_down_spec": list(sp["layers"][0]["w_down"].sharding.spec),
            "lm_head_spec": list(sp["lm_head"].sharding.spec),
            "cache_spec": list(sc.k.sharding.spec),
            "logits_devices": len(multi.sharding.device_set),
        }
    print("REPORT" + json.dumps(report))
""")


@pytest.fixture(scope="module")
def report():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        # The suite's compiler flags (tests/conftest.py) kept, four host devices added.
        XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
        ).strip(),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("REPORT"))
    return json.loads(line[len("REPORT") :])


@pytest.mark.parametrize("name", ["divisible", "replicated_attention"])
def test_sharded_forward_equals_single_device(report, name):
    r = report[name]
    assert r["logits_diff"] < 1e-4
    assert r["features_diff"] < 1e-4
    assert r["cache_diff"] < 1e-5
    assert r["greedy_equal"]
    assert r["logits_devices"] == 4


def test_divisible_dimensions_are_split(report):
    r = report["divisible"]
    assert r["wq_spec"] == [None, "model"]
    assert r["wk_spec"] == [None, "model"]
    assert r["w_down_spec"] == ["model", None]
    assert r["lm_head_spec"] == [None, "model"]
    assert r["cache_spec"] == [None, None, "model", None]


def test_indivisible_dimensions_are_replicated(report):
    r = report["replicated_attention"]
    assert r["wq_spec"] == [None, None]
    assert r["wk_spec"] == [None, None]
    assert r["w_down_spec"] == ["model", None]  # FFN 64 still divides
    assert r["lm_head_spec"] == [None, None]
    assert r["cache_spec"] == [None, None, None, None]
