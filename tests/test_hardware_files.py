"""The hardware files (conf/hardware/) and the calibration that writes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipelaunch.pipeline.planner.measure import calibrate

FILES = sorted(p for p in calibrate.HARDWARE_DIR.glob("*.yaml") if p.stem != "local")


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_file_has_each_fact_and_its_source(path: Path):
    hw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert hw["name"] and hw["devices_per_node"] >= 1
    assert hw["memory_bytes"] > 1e9 and hw["memory_bandwidth"] > 1e11
    assert hw["peak_flops"]["bf16"] >= hw["peak_flops"]["fp32"] > 1e12
    assert all(0 < e <= 1 for e in hw["efficiency"]["matmul"].values())
    assert set(hw["efficiency"]["matmul"]) <= set(hw["peak_flops"])
    assert 0 < hw["efficiency"]["memory"] <= 1
    for link in ("intra_node", "inter_node"):
        assert hw[link]["bandwidth"] > 1e9 and 0 < hw[link]["latency_s"] < 1e-3
    assert hw["intra_node"]["bandwidth"] > hw["inter_node"]["bandwidth"]
    for fact in ("peak_flops", "memory", "intra_node", "inter_node", "efficiency", "reserve_bytes"):
        assert hw["sources"][fact], f"{path.name}: no source for {fact}"


def test_calibration_divides_the_best_shape_by_the_datasheet():
    base = calibrate.load_base("h100_sxm", "")
    gemms = [{"dtype": "bf16", "shape": [1, 1, 1], "seconds": 1.0, "flops_per_s": 500e12},
             {"dtype": "bf16", "shape": [2, 2, 2], "seconds": 1.0, "flops_per_s": 742e12}]
    memory = [{"op": "copy", "bytes": 1, "seconds": 1.0, "bytes_per_s": 2.68e12},
              {"op": "add", "bytes": 1, "seconds": 1.0, "bytes_per_s": 3.0e12},
              {"op": "softmax", "bytes": 1, "seconds": 1.0, "bytes_per_s": 1.0e12}]
    out = calibrate.calibrated(base, gemms, memory, 8e-6, "not measured", "NVIDIA H100 80GB HBM3")
    assert out["efficiency"]["matmul"]["bf16"] == pytest.approx(742 / 989, abs=1e-3)
    assert out["efficiency"]["matmul"]["fp32"] == base["efficiency"]["matmul"]["fp32"]  # not measured: kept
    assert out["efficiency"]["memory"] == pytest.approx(2.68 / 3.35, abs=1e-3)  # the median op
    assert out["efficiency"]["memory_ops"]["softmax"] == pytest.approx(1 / 3.35, abs=1e-3)
    assert out["peak_flops"] == base["peak_flops"] and "calibrated" in out["sources"]["efficiency"]
    bare = calibrate.calibrated({}, gemms, memory, 8e-6, "not measured", "some GPU")
    assert bare["peak_flops"] == {"bf16": 742e12} and bare["efficiency"]["matmul"] == {"bf16": 1.0}
    assert bare["memory_bandwidth"] == 2.68e12 and "no datasheet" in bare["calibration"]["source"]


def test_auto_base_is_the_file_naming_the_device():
    assert calibrate.load_base("auto", "NVIDIA H200")["name"] == "h200"
    assert calibrate.load_base("auto", "a GPU nobody filed") == {}


def test_the_command_writes_a_loadable_file(tmp_path):
    out = tmp_path / "cpu.yaml"
    proc = subprocess.run([sys.executable, "-m", "pipelaunch.pipeline.planner.measure.calibrate", "--device", "cpu",
                           "--base", "a100_80gb", "--dtypes", "fp32", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    hw = OmegaConf.load(out)
    assert hw.name == "a100_80gb" and hw.calibration.device == "cpu"
    assert len(hw.calibration.gemm) == len(calibrate.GEMM_SIZES) + len(calibrate.MLP_SHAPES)


def test_every_file_loads_as_a_record_and_names_its_source():
    from pipelaunch.pipeline.core.hardware import known_hardware, load_hardware

    for name in known_hardware():
        hw = load_hardware(name)
        assert hw.matmul_flops("bf16") < hw.peak_flops["bf16"] and hw.bytes_per_s() <= hw.memory_bandwidth
        assert ("calibrated on" in hw.source) == (hw.calibrated is not None)
    assert load_hardware("h200_calibrated").calibrated == "NVIDIA H200, 2026-11-28"


@pytest.mark.parametrize(("change", "words"), [
    ({"efficiency": {"matmul": {"bf16": 1.5}}}, "efficiency.matmul.bf16"),
    ({"memory_bandwidth": -1}, "memory_bandwidth"),
    ({"inter_node": None}, "inter_node"),
    ({"peak_flops": {}}, "peak_flops"),
])
def test_a_bad_hardware_file_is_refused_naming_the_key(change, words):
    from pipelaunch.pipeline.core.errors import ConfigError
    from pipelaunch.pipeline.core.hardware import hardware_from_dict

    data = {**calibrate.load_base("a100_80gb", ""), **change}
    with pytest.raises(ConfigError) as err:
        hardware_from_dict(data, "mine")
    assert err.value.key == "hardware" and words in str(err.value) and "conf/hardware/mine.yaml" in str(err.value)


def test_an_unknown_hardware_name_lists_the_files():
    from pipelaunch.pipeline.core.errors import ConfigError
    from pipelaunch.pipeline.core.hardware import load_hardware

    with pytest.raises(ConfigError, match="valid: a100_80gb, b200"):
        load_hardware("tpu_v9")


def test_a_figure_set_on_the_command_line_shows_in_the_cost_source():
    """`hardware.memory_bytes=1e13` plans on a device of 10 TB: the prediction says so, in the
    stage table's `costs from` line and in plan.json's `cost_source`; the file's own figures say nothing."""
    from pipelaunch.launcher.validate import prepare
    from tests.harness import compose_cfg

    base = ["mode=plan", "model.layers=4", "hardware=h100_sxm", "pp=2"]
    lifted = prepare(compose_cfg([*base, "hardware.memory_bytes=1e13", "hardware.intra_node.bandwidth=1e11"]))
    assert lifted.plan.meta.machine.cost_source.endswith(
        "set on the command line: intra_node.bandwidth=100000000000.0, memory_bytes=10000000000000.0")
    assert "command line" not in prepare(compose_cfg(base)).plan.meta.machine.cost_source
