"""What SGLang's /model_info adds to radixrt's model info: the checkpoint's ``model_type`` and ``architectures``.

SGLang's router reads them (and ``model_path``, ``served_model_name`` from /server_info) when it registers a
worker. They come from the model folder's ``config.json``, read once; a folder without one gives neither.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=4)
def model_card(model_path: str) -> dict[str, Any]:
    card: dict[str, Any] = {"tokenizer_path": model_path}
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return card
    if isinstance(config.get("model_type"), str):
        card["model_type"] = config["model_type"]
    if isinstance(config.get("architectures"), list):
        card["architectures"] = [a for a in config["architectures"] if isinstance(a, str)]
    return card
