"""mla-compile: a torch.compile backend (`mla_dcp`) and op registry for MLA decode context parallelism and
DSA k-only indexing.

Importing the package registers the ops (`torch.ops.mla.*`, `torch.ops.dsa.*`).
"""

from . import layout, ops  # noqa: F401
from .backend import mla_dcp
from .mlir import export_mlir  # torch-mlir itself is imported only when called

__version__ = "0.1.0"
__all__ = ["mla_dcp", "export_mlir", "layout", "ops"]
