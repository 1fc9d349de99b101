"""Built-in model zoo by name, and ``factory="module:function"`` for users' own."""

from .zoo import MODELS, build_model, import_object

__all__ = ["MODELS", "build_model", "import_object"]
