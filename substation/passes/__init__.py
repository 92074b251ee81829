"""Graph-to-graph optimization passes: fusion (and layout selection)."""
from .fusion import FusionOptions, fuse

__all__ = ["FusionOptions", "fuse"]
