"""Encoder-layer configuration: the YAML schema, validation and loading.

A config names the sizes of one transformer encoder layer with the paper's dimension letters
(B batch, L maximum sequence length = J = K, I hidden size, H heads, P = I / H head size, U
feed-forward size) and the variant: activation, normalization (layer norm or RMSNorm) and its
placement, dropout probabilities, normalization eps, dtype, attention mask support and
code-generation target.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Hashable, Mapping

import yaml

from .resources import bundled_file, bundled_names

__all__ = ["ConfigError", "DropoutConfig", "EncoderConfig", "load_config"]

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
LAYER_NORM_PLACEMENTS = ("post", "pre")
NORM_TYPES = ("layer_norm", "rms_norm")
#: dtypes of target ``cpu`` (bfloat16: mixed precision on AVX512-BF16 / AMX; see docs/usage.md).
DTYPES = ("float32", "float64", "bfloat16")
#: dtypes of target ``cuda`` (half precision computes in float32; see docs/cuda.md).
CUDA_DTYPES = ("float32", "float64", "float16", "bfloat16")
#: Bytes per element of each dtype name.
ITEMSIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
MASKS = ("none", "padding", "causal")
TARGETS = ("cpu", "cuda")


class ConfigError(ValueError):
    """An encoder config value breaks a rule; the message names the key and the rule."""


def _yaml_loader() -> type:
    """A safe YAML loader that also reads ``1e-12`` (no dot) as a float, as YAML 1.2 does, and refuses a
    key given twice in one mapping (PyYAML would keep the last one silently)."""

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found the key {key!r} twice", key_node.start_mark)
                if isinstance(key, Hashable):
                    seen.add(key)
            return super().construct_mapping(node, deep)

    float_re = re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    )
    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", float_re, list("-+0123456789."))
    return Loader


_Loader = _yaml_loader()


def _int(key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {value}")
    return value


def _prob(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: must be a number, got {type(value).__name__} {value!r}")
    if not 0.0 <= float(value) < 1.0:
        raise ConfigError(f"{key}: a dropout probability must lie in [0, 1), got {value}")
    return float(value)


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}; got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class DropoutConfig:
    """Dropout probabilities of one encoder layer, each in [0, 1).

    Attributes:
        attention: on the attention probabilities (after softmax), shape [B, H, J, K].
        hidden: on the feed-forward output before its residual addition, shape [B, J, I], and on the
            attention output projection unless ``attention_output`` is set.
        activation: after the feed-forward activation, shape [B, J, U] (0 in BERT).
        attention_output: on the attention output projection before its residual addition, shape
            [B, J, I]; ``None`` (the default) means the same as ``hidden``, as in BERT (DistilBERT: 0).
    """

    attention: float = 0.1
    hidden: float = 0.1
    activation: float = 0.0
    attention_output: float | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "attention_output" or self.attention_output is not None:
                object.__setattr__(self, f.name, _prob(f"dropout.{f.name}", getattr(self, f.name)))

    def probability(self, site: str) -> float:
        """The probability of the dropout ``site`` (a field name; ``attention_output`` resolved)."""
        if site == "attention_output" and self.attention_output is None:
            return self.hidden
        return getattr(self, site)

    def probabilities(self) -> tuple[float, ...]:
        """Every site's probability, ``attention_output`` resolved."""
        return tuple(self.probability(f.name) for f in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """One transformer encoder layer.

    Attributes:
        batch_size: B, the nominal batch size (analysis and benchmarks; any B works at call time).
        max_seq_len: L, the nominal sequence length J = K (any length works at call time).
        hidden_size: I.
        num_heads: H; I must be divisible by H.
        ffn_size: U, the feed-forward (intermediate) size.
        activation: ``gelu`` (erf form), ``gelu_tanh`` (tanh approximation) or ``relu``.
        layer_norm: ``post`` (BERT: residual then layer norm) or ``pre`` (layer norm on each branch input);
            the placement of either ``norm_type``.
        norm_type: ``layer_norm`` (``y = (x - mean) / sqrt(var + eps) * weight + bias`` over I) or
            ``rms_norm`` (``y = x / sqrt(mean(x^2) + eps) * weight``: a weight and no bias, so the layer
            has no ``norm1_bias`` / ``norm2_bias``).
        dropout: the three dropout probabilities.
        layer_norm_eps: epsilon added to the variance (``rms_norm``: to the mean square), > 0 and finite
            (any size, as ``nn.LayerNorm``).
        dtype: ``float32``, ``float64`` or ``bfloat16``; with target ``cuda`` also ``float16``.
            Parameters, activations and gradients all use it (normalization statistics excepted);
            a ``bfloat16`` CPU build is mixed precision (float32 arithmetic, statistics and parameter
            gradients; bf16 activations and GEMM operands) and needs AVX512-BF16.
        mask: ``none`` (no mask input), ``padding`` (additive or boolean key mask [B, K]) or
            ``causal`` (key k > query j masked, plus an optional padding mask).
        target: code-generation target, ``cpu`` or ``cuda`` (NVIDIA GPUs, see docs/cuda.md).
        cuda_arch: GPU architecture of CUDA builds, ``sm_<digits>[letter]`` (default ``sm_90``:
            H100/H200).
        name: a label used in reports and file names.

    Raises:
        ConfigError: a value breaks a rule (the message names the key).
    """

    batch_size: int = 8
    max_seq_len: int = 128
    hidden_size: int = 768
    num_heads: int = 12
    ffn_size: int = 3072
    activation: str = "gelu"
    layer_norm: str = "post"
    norm_type: str = "layer_norm"
    dropout: DropoutConfig = dataclasses.field(default_factory=DropoutConfig)
    layer_norm_eps: float = 1e-12
    dtype: str = "float32"
    mask: str = "padding"
    target: str = "cpu"
    cuda_arch: str = "sm_90"
    name: str = "encoder"

    def __post_init__(self) -> None:
        for key in ("batch_size", "max_seq_len", "hidden_size", "num_heads", "ffn_size"):
            _int(key, getattr(self, key))
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size: must be divisible by num_heads, got I={self.hidden_size}, H={self.num_heads}"
            )
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("layer_norm", self.layer_norm, LAYER_NORM_PLACEMENTS)
        _choice("norm_type", self.norm_type, NORM_TYPES)
        _choice("target", self.target, TARGETS)
        allowed = CUDA_DTYPES if self.target == "cuda" else DTYPES
        if not isinstance(self.dtype, str) or self.dtype not in allowed:
            hint = " (float16 needs target: cuda)" if self.dtype in CUDA_DTYPES else ""
            raise ConfigError(f"dtype: must be one of {', '.join(allowed)} for target {self.target}{hint}; "
                              f"got {self.dtype!r}")
        _choice("mask", self.mask, MASKS)
        if not isinstance(self.cuda_arch, str) or not re.fullmatch(r"sm_\d{2,3}[a-z]?", self.cuda_arch):
            raise ConfigError(f"cuda_arch: must look like sm_90 or sm_90a; got {self.cuda_arch!r}")
        if isinstance(self.dropout, Mapping):
            object.__setattr__(self, "dropout", _dropout_from_mapping(self.dropout))
        if not isinstance(self.dropout, DropoutConfig):
            raise ConfigError(f"dropout: must be a DropoutConfig or a mapping with keys attention, hidden, "
                              f"activation; got {type(self.dropout).__name__}")
        eps = self.layer_norm_eps
        if isinstance(eps, str):
            raise ConfigError(f"layer_norm_eps: must be a positive finite number, got the string {eps!r} (YAML 1.1 "
                              "readers such as yaml.safe_load read 1e-5 without a dot as a string: write 1.0e-5 "
                              "or load the file with substation.load_config)")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 < float(eps) < float("inf"):
            raise ConfigError(f"layer_norm_eps: must be a positive finite number, got {eps!r}")
        object.__setattr__(self, "layer_norm_eps", float(eps))
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
            quote = " (in YAML, quote a name that reads as a number: name: \"123\")" if isinstance(
                self.name, (int, float)) and not isinstance(self.name, bool) else ""
            raise ConfigError(f"name: must be a non-empty string of letters, digits, '_', '.', '-'; got "
                              f"{self.name!r}{quote}")

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return ITEMSIZES[self.dtype]

    @property
    def head_size(self) -> int:
        """P = I / H."""
        return self.hidden_size // self.num_heads

    def sizes(self, batch_size: int | None = None, seq_len: int | None = None) -> dict[str, int]:
        """The dimension sizes by letter: B, J, K, H, P, I, U (and ``T`` = 3, the Q/K/V stack)."""
        b = self.batch_size if batch_size is None else batch_size
        j = self.max_seq_len if seq_len is None else seq_len
        return {"B": b, "J": j, "K": j, "H": self.num_heads, "P": self.head_size,
                "I": self.hidden_size, "U": self.ffn_size, "T": 3}

    def replace(self, **changes: Any) -> "EncoderConfig":
        """A copy with some fields changed (validated again); ``dropout`` may be a mapping.

        Raises:
            ConfigError: an unknown field (of the config or of ``dropout``; the message lists the
                known ones) or a value that breaks a rule.
        """
        known = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ConfigError(f"unknown config key(s) {', '.join(unknown)} (known: {', '.join(known)})")
        if isinstance(changes.get("dropout"), Mapping):
            fields = [f.name for f in dataclasses.fields(self.dropout)]
            bad = sorted(set(changes["dropout"]) - set(fields))
            if bad:
                raise ConfigError(f"unknown dropout key(s) {', '.join(bad)} (known: {', '.join(fields)})")
            changes["dropout"] = dataclasses.replace(self.dropout, **changes["dropout"])
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, in the YAML schema."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EncoderConfig":
        """Build and validate a config from parsed YAML.

        Raises:
            ConfigError: an unknown key, a wrong type or a value out of range.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"config: must be a mapping of keys to values, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown key (known keys: {', '.join(sorted(known))})")
        values = dict(data)
        if "dropout" in values and not isinstance(values["dropout"], Mapping):
            raise ConfigError(f"dropout: must be a mapping with keys attention, hidden, activation; "
                              f"got {values['dropout']!r}")
        return cls(**values)


def _dropout_from_mapping(d: Mapping[str, Any]) -> DropoutConfig:
    """A :class:`DropoutConfig` from a mapping (ConfigError: an unknown key or a bad value)."""
    known = {f.name for f in dataclasses.fields(DropoutConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"dropout.{unknown[0]}: unknown key (known keys: {', '.join(sorted(known))})")
    return DropoutConfig(**d)


def load_config(source: "str | os.PathLike | EncoderConfig | Mapping[str, Any]") -> EncoderConfig:
    """Load an encoder config from a YAML file path, a bundled config name (``bert-base``), a mapping
    or an existing :class:`EncoderConfig`.

    Raises:
        FileNotFoundError: the path does not exist and is not the name of a bundled config.
        ConfigError: the YAML is malformed or breaks a rule, or the path is a folder that is not the name
            of a bundled config (a bundled name is looked up before a folder of that name).
        TypeError: ``source`` is none of these.
    """
    if isinstance(source, EncoderConfig):
        return source
    if isinstance(source, Mapping):
        return EncoderConfig.from_dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"a config is an EncoderConfig, a mapping, a YAML path or a bundled config name "
                        f"(e.g. 'bert-base'); got {type(source).__name__}")
    path = os.fspath(source)
    if not os.path.isfile(path):
        # a bundled name wins over a folder of that name (``compile tiny --out tiny`` makes one)
        bundled = bundled_file(path, ".yaml") if os.path.sep not in path else None
        if bundled is not None:
            path = bundled
        elif os.path.isdir(path):
            raise ConfigError(f"{path} is a folder; give a YAML config file or a bundled config name")
        elif not os.path.exists(path):
            raise FileNotFoundError(f"config file not found: {path} (bundled configs: "
                                    f"{', '.join(bundled_names('.yaml'))})")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.load(f, Loader=_Loader)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); a config is a YAML file") from None
    data = {} if data is None else data  # an empty file: every default
    if isinstance(data, Mapping) and "name" not in data:
        data = dict(data, name=os.path.splitext(os.path.basename(path))[0])
    return EncoderConfig.from_dict(data)

