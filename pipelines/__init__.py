"""quantgate: validate quantized LLM checkpoints before release (see README.md)."""

from pipelines.core.logs import apply_library_env

apply_library_env()  # before any library import: GPTQModel reads its worker count once, at import
