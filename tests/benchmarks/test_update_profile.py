"""benchmarks/update_profile.py: an RL update's op time by model part and pass, from a trace."""

import pytest

from benchmarks import script

update_profile = script("update_profile")


def test_ops_are_attributed_by_scope_and_pass():
    hlo = "\n".join([
        '  %ynn_fusion.2 = f32[2] fusion(), metadata={op_name="jit(update)/while/body/'
        'jvp(Transformer)/groups/layer_0/mlp/mk,kn->mn/dot_general"}',
        '  %ynn_fusion.3 = f32[2] fusion(), metadata={op_name="jit(update)/while/body/'
        'transpose(jvp(Transformer))/groups/layer_0/mlp/mk,kn->mn/dot_general"}',
        '  %fusion.4 = f32[2] fusion(), metadata={op_name="jit(update)/while/body/'
        'transpose(jvp(Transformer))/groups/layer_1/attn/attn._teacher/dot_general"}',
        '  %dot.5 = f32[2] dot(), metadata={op_name="jit(update)/while/body/'
        'transpose(jvp(Transformer))/embed.decode/mk,nk->mn/dot_general"}',
        '  %fusion.6 = f32[2] fusion(), metadata={op_name="jit(update)/while/body/select_n"}',
        '  %while.7 = (s32[]) while(), metadata={op_name="jit(update)/while"}',
    ])  # fmt: skip
    assert update_profile.op_passes(hlo) == {
        "ynn_fusion.2": ("ffn", "fwd"),
        "ynn_fusion.3": ("ffn", "bwd"),
        "fusion.4": ("attention", "bwd"),
        "dot.5": ("lm_head", "bwd"),
        "fusion.6": ("other", "fwd"),
    }


def test_eigen_threads_reads_the_last_setting_of_the_flag():
    assert update_profile.eigen_threads("") == "pool"
    assert update_profile.eigen_threads("--xla_cpu_multi_thread_eigen=false") == "one"
    flags = "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=8"
    assert update_profile.eigen_threads(flags) == "one"
    assert update_profile.eigen_threads(flags + " --xla_cpu_multi_thread_eigen=true") == "pool"


@pytest.mark.slow  # compiles and traces the benchmark update (about 20 s)
def test_profile_line_of_the_dense_update():
    line = update_profile.profile_line("dense", "DDDD", reps=1)
    assert line["variant"] == "dense-DDDD/fp32" and line["step_ms"] > 0
    # every part shows up in both passes: the scopes match the model's names
    for part in update_profile.PARTS:
        for pass_ in update_profile.PASSES:
            assert line[f"{part}_{pass_}_ms"] > 0, (part, pass_)
    assert 0.5 < line["ops_over_wall"] < 2.5
