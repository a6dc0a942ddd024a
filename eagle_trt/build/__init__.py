"""python -m eagle_trt.build: config -> ONNX graphs -> quantized graphs -> parity -> TensorRT
engines -> Triton model repository, each stage cached by the content hash of its inputs.

    from eagle_trt.build import build, load_config
    manifest = build(load_config("build_configs/smollm2-eagle3.1.yaml"), "artifacts/smollm2")
"""
from .config import (
           BuildConfig,
           BuildConfigError,
           config_from_dict,
           config_to_dict,
           load_config,
)
from .pipeline import (
           STAGES,
           BuildError,
           Manifest,
           ParityFailure,
           StageResult,
           build,
           summary_table,
)

__all__ = ["STAGES", "BuildConfig", "BuildConfigError", "BuildError", "Manifest", "ParityFailure", "StageResult",
           "build", "config_from_dict", "config_to_dict", "load_config", "summary_table"]
