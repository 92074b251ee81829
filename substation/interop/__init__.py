"""Interoperability with Hugging Face ``transformers`` and PyTorch encoder layers.

* :func:`optimize` replaces, in place, every encoder layer of a supported family inside a model with
  a drop-in layer running Substation's compiled code; checkpoints stay Hugging Face checkpoints.
* :func:`drop_in` makes the drop-in replacement of one layer. A standalone layer with copied weights:
  :meth:`substation.EncoderLayer.from_hf` / :meth:`~substation.EncoderLayer.from_torch`.
* :data:`FAMILIES`: the supported families (docs/huggingface.md).
"""
from .convert import OptimizeSummary, drop_in, layer_config, optimize
from .families import FAMILIES, Family, NotConvertible, activation_name
from .layers import SubstationLayer, drop_in_class, replace_with_drop_in

__all__ = ["FAMILIES", "Family", "NotConvertible", "OptimizeSummary", "SubstationLayer", "activation_name",
           "drop_in", "drop_in_class", "layer_config", "optimize", "replace_with_drop_in"]
