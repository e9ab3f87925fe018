"""The code of every model vitpipe logs to MLflow: a pyfunc over a `vit.save_checkpoint` folder.

MLflow copies this file into the logged model ("models from code") next to the
`vit` package and the checkpoint (`model.safetensors` + `config.json`), so the
model holds no pickle and loads with `mlflow.pyfunc.load_model` wherever torch,
safetensors and mlflow install. It must import only vit, torch, numpy and
mlflow: pipelines is not in the model. vitpipe never imports it; it hands
MLflow its path (`pipelines.core.registry.log_vit_model`).
"""

from __future__ import annotations

from typing import Any

import mlflow
import numpy as np
import torch

import vit


class VitCheckpointModel(mlflow.pyfunc.PythonModel):
    """`predict`: a float array shaped as the model's input (patches, or video frames) to its logits."""

    def load_context(self, context: Any) -> None:
        """Rebuild the model from the checkpoint artifact (safetensors weights, JSON config)."""
        self.model = vit.load_checkpoint(context.artifacts["checkpoint"]).eval()

    # MLflow reads predict's type hints as an input schema, except np.ndarray, which it leaves unchecked:
    # the input's shape depends on the checkpoint. Without any hint it warns on every log and load.
    def predict(self, context: Any, model_input: np.ndarray, params: dict[str, Any] | None = None) -> np.ndarray:
        """Logits (float32) for a batch shaped as the model's input."""
        x = torch.as_tensor(np.asarray(model_input, dtype=np.float32))
        with torch.no_grad():
            return self.model(x).float().numpy()


mlflow.models.set_model(VitCheckpointModel())
