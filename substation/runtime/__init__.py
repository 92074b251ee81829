"""The PyTorch binding of compiled layers: loaded libraries (:mod:`.library`), the custom operators
that run them (:mod:`.custom_ops`) and the attention masks they take (:mod:`.masks`)."""
from .custom_ops import run_layer, run_layer_varlen
from .library import (ALL_TORCH_DTYPES, DTYPE_NAMES, PARAMETER_NAMES, TORCH_DTYPES, CompiledGraph, CompiledLayer,
                      parameter_names, release_packed_parameters)
from .masks import check_mask, key_mask

__all__ = ["ALL_TORCH_DTYPES", "CompiledGraph", "CompiledLayer", "DTYPE_NAMES", "PARAMETER_NAMES", "TORCH_DTYPES",
           "check_mask", "key_mask", "parameter_names", "release_packed_parameters", "run_layer", "run_layer_varlen"]
