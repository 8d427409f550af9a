"""Dtype-policy presets: dtypes only, parity from the name, the kernel choice from the caller."""

import pytest

from agentrl_jax.precision import DTypePolicy, get_policy, parity_of, policy_names

BF16 = {"compute_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}
EXPECTED = {
    "fp32": DTypePolicy(name="fp32"),
    "bf16": DTypePolicy(name="bf16", **BF16),
    "fp8": DTypePolicy(name="fp8", fp8_matmul=True, **BF16),
    "fp32-parity": DTypePolicy(name="fp32-parity", parity=True),
    "bf16-parity": DTypePolicy(name="bf16-parity", parity=True, **BF16),
    "bf16-int8kv": DTypePolicy(name="bf16-int8kv", compute_dtype="bfloat16", kv_cache_dtype="int8"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets(name):
    assert get_policy(name) == EXPECTED[name]
    assert get_policy(name).parity == parity_of(name) == name.endswith("-parity")
    assert get_policy(name).kernel_impl == "auto"  # no preset chooses kernels


def test_every_preset_is_listed_and_kernel_impl_is_the_callers():
    assert policy_names() == sorted(EXPECTED)
    policy = get_policy("bf16-parity", kernel_impl="xla")
    assert policy == EXPECTED["bf16-parity"].replace(kernel_impl="xla")
    line = policy.describe()
    assert "'bf16-parity'" in line and "compute=bfloat16" in line and "kv_cache=bfloat16" in line
    assert "parity=True (from the policy name)" in line
    assert "kernel_impl='xla' (the kernel_impl key)" in line
    with pytest.raises(ValueError, match="unknown dtype policy 'bf32'"):
        get_policy("bf32")
    with pytest.raises(ValueError, match="kernel_impl='triton'"):
        get_policy("fp32", kernel_impl="triton")
