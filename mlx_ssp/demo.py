"""The bundled demo model (placeholder until the GGUF conversion lands)."""

from mlx_ssp.errors import NotBuiltError


def ensure_demo_model():
    raise NotBuiltError("the demo model conversion is not built yet")
