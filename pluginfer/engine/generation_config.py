"""The sampling defaults a checkpoint's ``generation_config.json`` recommends (Qwen3: temperature 0.6, top_p
0.95, top_k 20), which requests that set none take unless the deployment's ``sampling:`` says otherwise.

Read without torch: the server's process calls it too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pluginfer.core.config import BUILTIN_SAMPLING, SamplingDefaults

logger = logging.getLogger(__name__)


def model_sampling_defaults(model_path: Path) -> dict[str, Any]:
    """The sampling fields ``model_path``'s generation_config.json sets (those of ``BUILTIN_SAMPLING``); none
    for a checkpoint without one (a GGUF file). A value a request could not take is left out, with a warning."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("cannot read %s (%s); its sampling defaults are not used", path, exc)
        return {}
    found = {}
    for name in BUILTIN_SAMPLING:
        if name not in data or data[name] is None:
            continue
        try:
            value = getattr(SamplingDefaults.model_validate({name: data[name]}, strict=True), name)
        except ValidationError as exc:
            logger.warning("%s: %s=%r is not a valid default (%s); not used", path, name, data[name],
                           exc.errors()[0]["msg"])
            continue
        found[name] = value
    return found


def sampling_defaults(deployment: SamplingDefaults, model_path: Path) -> SamplingDefaults:
    """The defaults requests get: the deployment's, else the model's generation config's, else built in."""
    return deployment.over(model_sampling_defaults(model_path))


def describe(defaults: SamplingDefaults, deployment: SamplingDefaults, model: dict[str, Any]) -> str:
    """One line for the start-up log: each default and where it comes from."""
    def source(name: str) -> str:
        if name == "max_tokens":  # never from the model: the config's, or its default
            return "config" if name in deployment.model_fields_set else "built-in"
        if getattr(deployment, name) is not None:
            return "config"
        return "generation_config.json" if name in model else "built-in"

    parts = [f"{name}={getattr(defaults, name):g} ({source(name)})" for name in (*BUILTIN_SAMPLING, "max_tokens")]
    return "request defaults: " + ", ".join(parts)
