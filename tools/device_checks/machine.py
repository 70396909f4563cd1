"""Device-check helper: the machine's facts as one `RESULT {json}` line (run_all.py runs it
first). Also proves that the repository's sources import from PYTHONPATH: `pentatron` is a
namespace package merged from every `packages/*/src` and `apps/*/src`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys

import _paths

gpu_mfu = _paths.load_benchmark("gpu_mfu")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda": torch.cuda.is_available(),
        "cpus": os.cpu_count(),
        "transformers": _version("transformers"),
    }
    try:  # reported, not fatal: the checks then fail with the whole traceback
        import pentatron.models
        import pentatron.pretrain

        out["pentatron_models_from"] = os.path.dirname(pentatron.models.__file__)
        out["pentatron_pretrain_from"] = os.path.dirname(pentatron.pretrain.__file__)
    except Exception as e:
        out["pentatron_import_error"] = f"{type(e).__name__}: {e}"
    if out["cuda"]:
        props = torch.cuda.get_device_properties(0)
        out.update(
            device=torch.cuda.get_device_name(0),
            devices=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=props.total_memory / 2**30,
            peak_bf16_tflops=gpu_mfu.device_peak(torch.cuda.get_device_name(0)),
        )
    else:
        out.update(device="cpu", peak_bf16_tflops=None)
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
