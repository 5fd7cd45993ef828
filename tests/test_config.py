"""ScalingConfig and RunConfig through the Python API: every rule, with the error text users see.
The rules live in C++; these tests check that they reach Python whole."""

import pytest

from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig


def invalid(fragments, **kwargs):
    with pytest.raises(ValueError) as e:
        ScalingConfig(**kwargs)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_defaults_are_one_cpu_worker_packed():
    c = ScalingConfig()
    assert c.num_workers == 1 and not c.use_tpu and not c.use_gpu
    assert c.placement_strategy == "PACK"
    assert c.tpu_slice is None


def test_seed_tpu_config_describes_a_v6e_16_slice_of_four_hosts():
    c = ScalingConfig(num_workers=4, use_tpu=True, topology="4x4", accelerator_type="TPU-V6E",
                      placement_strategy="SPREAD")
    assert c.tpu_slice == {"generation": "v6e", "topology": "4x4", "chips": 16,
                           "chips_per_host": 4, "hosts": 4, "pod_type": "v6e-16"}
    assert c.num_slices == 1


def test_v4_2x2x4_is_v4_32_on_four_hosts():
    c = ScalingConfig(num_workers=4, use_tpu=True, topology="2x2x4", accelerator_type="TPU-V4")
    assert c.tpu_slice["pod_type"] == "v4-32"
    assert c.tpu_slice["hosts"] == 4


def test_worker_count_must_be_whole_slices():
    invalid(["ScalingConfig.num_workers=3", "must be a multiple of 2"],
            num_workers=3, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4")
    invalid(["num_workers=6", "must be a multiple of 4"], num_workers=6, use_tpu=True,
            topology="2x2x1", accelerator_type="TPU-V4", resources_per_worker={"TPU": 1})


def test_multi_host_tpu_needs_topology_and_accelerator_type():
    invalid(["missing: topology, accelerator_type"], num_workers=4, use_tpu=True)
    invalid(["missing: topology"], num_workers=4, use_tpu=True, accelerator_type="TPU-V6E")


def test_bad_topology_lists_the_generations_valid_topologies():
    invalid(["topology='3x3'", "v6e", "1x1, 2x2, 2x4, 2x8, 4x4, 4x8, 8x8, 8x16, 16x16"],
            num_workers=4, use_tpu=True, topology="3x3", accelerator_type="TPU-V6E")


def test_unknown_generation_is_named_with_the_allowed_ones():
    invalid(["accelerator_type='TPU-V9'", "TPU-V6E"], num_workers=4, use_tpu=True,
            topology="4x4", accelerator_type="TPU-V9")


def test_pod_type_must_match_topology():
    invalid(["'v4-16'", "'v4-32'"], num_workers=4, use_tpu=True, topology="2x2x4",
            accelerator_type="v4-16")
    ScalingConfig(num_workers=2, use_tpu=True, topology="2x2x2", accelerator_type="tpu7x-16")
    invalid(["topology='4x4'", "v7x"], num_workers=2, use_tpu=True, topology="4x4",
            accelerator_type="v7x-8")


def test_accelerator_type_needs_use_gpu_or_use_tpu():
    # Ray Train takes it alone as a placement constraint; jaxtrain would ignore it: refused.
    invalid(["ScalingConfig.accelerator_type='H100' is only used with use_gpu=True or "
             "use_tpu=True", "remove accelerator_type"], num_workers=2, accelerator_type="H100")
    assert ScalingConfig(num_workers=2, use_gpu=True, accelerator_type="H100").use_gpu


@pytest.mark.parametrize("field, value, shown", [
    ("progress_timeout_s", -1, "-1"),
    ("progress_timeout_s", 0.0, "0"),
    ("preemption_grace_s", -0.5, "-0.5"),
    ("unreachable_host_timeout_s", -1e-05, "-1e-05"),
    ("unreachable_host_timeout_s", -0.1234567, "-0.1234567"),
])
def test_numbers_in_config_errors_are_echoed_as_given(field, value, shown):
    with pytest.raises(ValueError) as e:
        FailureConfig(**{field: value})
    assert f"FailureConfig.{field}={shown} is not allowed" in str(e.value), str(e.value)


def test_the_progress_watchdog_is_automatic_by_default_and_none_turns_it_off():
    assert FailureConfig().progress_timeout_s == "auto"
    assert FailureConfig(progress_timeout_s=None).progress_timeout_s is None
    assert FailureConfig(progress_timeout_s=30).progress_timeout_s == 30
    with pytest.raises(ValueError) as e:
        FailureConfig(progress_timeout_s="10m")
    assert str(e.value) == ("FailureConfig.progress_timeout_s='10m' is not allowed; give a number "
                            "of seconds > 0, \"auto\" or None")


def test_tpu_and_gpu_are_exclusive():
    invalid(["use_tpu=True and use_gpu=True"], use_tpu=True, use_gpu=True)


def test_placement_strategy_must_be_known():
    invalid(["placement_strategy='RANDOM'", "PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"],
            placement_strategy="RANDOM")


def test_resources_must_be_non_negative_numbers():
    invalid(["resources_per_worker['CPU']=-1", ">= 0"], resources_per_worker={"CPU": -1})
    invalid(["resources_per_worker['CPU']='two'"], resources_per_worker={"CPU": "two"})


def test_tpu_resources_need_use_tpu_and_gpu_resources_need_use_gpu():
    invalid(["resources_per_worker['TPU']=4", "use_tpu=True"], resources_per_worker={"TPU": 4})
    invalid(["resources_per_worker['GPU']=2", "use_gpu=True"], resources_per_worker={"GPU": 2})
    invalid(["resources_per_worker['TPU']=0"], use_tpu=True, resources_per_worker={"TPU": 0})


def test_num_workers_must_be_a_non_negative_int():
    invalid(["ScalingConfig.num_workers=-1", "or 0 for local mode"], num_workers=-1)
    invalid(["ScalingConfig.num_workers='4'"], num_workers="4")
    invalid(["ScalingConfig.num_workers=True"], num_workers=True)


def test_local_mode_refuses_placement_fields():
    assert ScalingConfig(num_workers=0).num_workers == 0
    invalid(["ScalingConfig(num_workers=0, topology='4x4')", "driver's process"],
            num_workers=0, topology="4x4")
    invalid(["resources_per_worker={'CPU': 2}"], num_workers=0, resources_per_worker={"CPU": 2})


def test_flags_must_be_booleans():
    invalid(["ScalingConfig.use_tpu='yes'", "True or False"], use_tpu="yes")


def test_run_config_defaults():
    c = RunConfig()
    assert c.name.startswith("jaxtrain_run-")
    assert c.storage_path.endswith("/jaxtrain_results")


def test_run_config_rejects_a_name_with_a_slash():
    with pytest.raises(ValueError, match="RunConfig.name='a/b'"):
        RunConfig(name="a/b")


def test_trainer_rejects_a_function_with_two_required_arguments():
    with pytest.raises(ValueError, match="takes 2 required arguments"):
        JaxTrainer(lambda a, b: None)


def test_trainer_rejects_config_for_a_function_without_arguments():
    with pytest.raises(ValueError, match="train_loop_per_worker takes no argument"):
        JaxTrainer(lambda: None, train_loop_config={"lr": 1})


def test_trainer_rejects_a_scaling_config_of_the_wrong_type():
    with pytest.raises(ValueError, match="pass a jaxtrain.ScalingConfig"):
        JaxTrainer(lambda: None, scaling_config={"num_workers": 2})


def test_report_outside_a_worker_says_where_it_works():
    from jaxtrain import get_context, report

    with pytest.raises(RuntimeError, match="only inside the training function"):
        report({"x": 1})
    with pytest.raises(RuntimeError, match="only inside the training function"):
        get_context()


def test_elastic_num_workers_is_a_min_max_range():
    c = ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=5)
    assert c.elastic and c.min_workers == 2 and c.max_workers == 4
    assert c.num_workers == (2, 4)
    assert c.elastic_resize_monitor_interval_s == 5
    assert ScalingConfig(num_workers=[2, 4]) == ScalingConfig(num_workers=(2, 4))
    fixed = ScalingConfig(num_workers=4)
    assert not fixed.elastic and fixed.min_workers == fixed.max_workers == 4


def test_elastic_range_is_checked_with_the_field_and_what_is_allowed():
    invalid(["ScalingConfig.num_workers=(0, 4)", "1 <= min <= max"], num_workers=(0, 4))
    invalid(["ScalingConfig.num_workers=(5, 4)", "1 <= min <= max"], num_workers=(5, 4))
    invalid(["ScalingConfig.num_workers=(1, 2, 3)", "(min, max) pair"], num_workers=(1, 2, 3))
    invalid(["ScalingConfig.num_workers=(1, '4')", "(min, max) pair"], num_workers=(1, "4"))
    invalid(["ScalingConfig.elastic_resize_monitor_interval_s=0", "> 0"],
            num_workers=(1, 2), elastic_resize_monitor_interval_s=0)
    invalid(["ScalingConfig.elastic_resize_monitor_interval_s='60'", "> 0"],
            num_workers=(1, 2), elastic_resize_monitor_interval_s="60")


def test_elastic_tpu_range_is_whole_slices():
    tpu = dict(use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4")  # 2 workers a slice
    assert ScalingConfig(num_workers=(2, 4), **tpu).min_workers == 2
    invalid(["ScalingConfig.num_workers=(3, 4)", "multiple of 2", "whole slices"],
            num_workers=(3, 4), **tpu)
    invalid(["ScalingConfig.num_workers=(2, 5)", "max=5", "multiple of 2"],
            num_workers=(2, 5), **tpu)
