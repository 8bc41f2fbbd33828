"""The NPU path up to its seam, with torch_npu and MindSpeed absent (they need CANN): selection, environment,
and that MindSpeed's adaptor is imported before any Megatron module. Stand-in torch_npu / mindspeed packages
(written to a temp dir) record the order in which the real ones would be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime_engine.devices.accelerator import NPU, AcceleratorSetupError, prepare_accelerator, resolve_accelerator

ROOT = Path(__file__).resolve().parents[2]
_STANDINS = {
    "torch_npu/__init__.py": (
        "import os, types, torch\n"
        "os.environ['VIMEFLOW_TEST_ORDER'] = os.environ.get('VIMEFLOW_TEST_ORDER', '') + 'torch_npu,'\n"
        "torch.npu = types.SimpleNamespace(set_device=lambda r: os.environ.__setitem__('VIMEFLOW_TEST_NPU', str(r)))\n"
    ),
    "mindspeed/__init__.py": "",
    "mindspeed/megatron_adaptor.py": (
        "import os, sys\n"
        "assert not any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules), 'megatron came first'\n"
        "os.environ['VIMEFLOW_TEST_ORDER'] = os.environ.get('VIMEFLOW_TEST_ORDER', '') + 'mindspeed,'\n"
    ),
}
_PROGRAM = """
import json, os, sys
from vime_engine.devices.accelerator import NPU, prepare_accelerator
prepare_accelerator(NPU, local_rank=3)
import megatron.core
print(json.dumps({k: os.environ.get(k) for k in
    ("VIMEFLOW_TEST_ORDER", "VIMEFLOW_TEST_NPU", "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES")}))
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    for name, text in _STANDINS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND_", "VIMEFLOW_TEST_", "RAY_"))}
    clean["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    return subprocess.run([sys.executable, "-c", _PROGRAM], env={**clean, **env}, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_npu_is_hccl_with_ascend_names():
    npu = resolve_accelerator("npu")
    assert (npu.torch_device, npu.dist_backend, npu.ray_resource) == ("npu", "hccl", "NPU")
    assert npu.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert resolve_accelerator("auto").kind == "cpu"  # here: no GPU, no torch_npu


def test_npu_imports_torch_npu_then_mindspeed_before_megatron(tmp_path):
    done = _run(tmp_path, ASCEND_TOOLKIT_HOME="/usr/local/Ascend/ascend-toolkit/latest")
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["VIMEFLOW_TEST_ORDER"] == "torch_npu,mindspeed,"
    assert seen["VIMEFLOW_TEST_NPU"] == "3"
    assert seen["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"


def test_npu_without_ascend_environment_names_set_env(tmp_path):
    done = _run(tmp_path)
    assert done.returncode != 0
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in done.stderr


def test_npu_after_megatron_import_is_refused():
    import megatron.core  # noqa: F401
    with pytest.raises(AcceleratorSetupError, match="before MindSpeed's adaptor"):
        prepare_accelerator(NPU)
