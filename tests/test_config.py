"""Config loading and validation: every rule has a test that triggers its message."""
import pytest

from substation.config import ConfigError, EncoderConfig, load_config


def test_bundled_configs():
    base = load_config("bert-base")
    assert (base.batch_size, base.max_seq_len, base.hidden_size, base.num_heads, base.ffn_size) == (8, 128, 768, 12, 3072)
    assert base.head_size == 64 and base.layer_norm_eps == 1e-12 and isinstance(base.layer_norm_eps, float)
    large = load_config("configs/bert-large-b8-l512.yaml")
    assert (large.batch_size, large.max_seq_len, large.hidden_size, large.num_heads, large.ffn_size) == (8, 512, 1024, 16, 4096)
    assert load_config("bert-large-b96-l128").batch_size == 96
    mini = load_config("minilm-l6")
    assert (mini.hidden_size, mini.num_heads, mini.ffn_size, mini.layer_norm_eps) == (384, 12, 1536, 1e-12)
    tiny = load_config("tiny")
    assert tiny.sizes() == {"B": 2, "J": 7, "K": 7, "H": 4, "P": 4, "I": 16, "U": 24, "T": 3}


def test_round_trip_and_replace():
    c = load_config("tiny")
    assert EncoderConfig.from_dict(c.to_dict()) == c
    d = c.replace(dropout={"attention": 0.2})
    assert d.dropout.attention == 0.2 and d.dropout.hidden == c.dropout.hidden


BAD = [
    ({"hidden_size": 30, "num_heads": 4}, "hidden_size: must be divisible by num_heads"),
    ({"batch_size": 0}, "batch_size: must be >= 1"),
    ({"ffn_size": -3}, "ffn_size: must be >= 1"),
    ({"max_seq_len": 1.5}, "max_seq_len: must be an integer"),
    ({"num_heads": True}, "num_heads: must be an integer"),
    ({"hidden_size": "768"}, "hidden_size: must be an integer"),
    ({"dropout": {"attention": 1.0}}, "dropout.attention: a dropout probability must lie in [0, 1)"),
    ({"dropout": {"hidden": -0.1}}, "dropout.hidden: a dropout probability must lie in [0, 1)"),
    ({"dropout": {"activation": "0.1"}}, "dropout.activation: must be a number"),
    ({"dropout": {"residual": 0.1}}, "dropout.residual: unknown key"),
    ({"dropout": 0.1}, "dropout: must be a mapping"),
    ({"activation": "swish"}, "activation: must be one of gelu, gelu_tanh, relu"),
    ({"layer_norm": "middle"}, "layer_norm: must be one of post, pre"),
    ({"dtype": "float16"}, "dtype: must be one of float32, float64"),
    ({"mask": "sliding"}, "mask: must be one of none, padding, causal"),
    ({"target": "tpu"}, "target: must be one of cpu"),
    ({"layer_norm_eps": 0}, "layer_norm_eps: must be a positive finite number"),
    ({"layer_norm_eps": "small"}, "layer_norm_eps: must be a positive finite number"),
    ({"hidden": 768}, "hidden: unknown key"),
    ({"name": "has space"}, "name: must be a non-empty string"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_invalid_values_name_key_and_rule(change, message):
    data = load_config("tiny").to_dict()
    data.update(change)
    with pytest.raises(ConfigError) as err:
        EncoderConfig.from_dict(data)
    assert message in str(err.value)


@pytest.mark.parametrize("content,error,words", [
    (b"hidden_size: [1,\n", ConfigError, "not valid YAML"),
    (b"- 1\n- 2\n", ConfigError, "config: must be a mapping"),
    (b"\xff\xfe\x00", ConfigError, "not UTF-8 text"),
    (b"hidden_size: 16\nnum_heads: 4\nhidden_size: 32\n", ConfigError, "found the key 'hidden_size' twice"),
    (b"dropout: {attention: 0.1, attention: 0.2}\n", ConfigError, "found the key 'attention' twice"),
    (b"name: 123\n", ConfigError, "quote a name that reads as a number"),
])
def test_yaml_errors(tmp_path, content, error, words):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    with pytest.raises(error, match=words):
        load_config(bad)


def test_yaml_files_without_errors_and_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(FileNotFoundError, match=r"config file not found: nope \(bundled configs: bert-base, .*minilm-l6, tiny\)"):
        load_config("nope")
    from substation.passes.layout import load_plan
    with pytest.raises(FileNotFoundError, match=r"no layout plan '/no/such.json': no such file, nor a bundled plan \(bert-base, default\)"):
        load_plan("/no/such.json")
    from substation.pipeline import compile_layer
    started = []
    with pytest.raises(FileNotFoundError, match="no layout plan '/no/such.json'"):
        compile_layer("tiny", progress=started.append, layout="/no/such.json")
    assert started == []  # named before the first pass, not after five
    number = tmp_path / "number.yaml"
    number.write_text('name: "123"\n')
    assert load_config(number).name == "123"
    empty = tmp_path / "empty-file.yaml"
    empty.write_text("# nothing but a comment\n")
    assert load_config(empty).name == "empty-file"  # the file's name, as for any file without a name key


def test_yaml_exponent_without_dot_is_float(tmp_path):
    f = tmp_path / "eps.yaml"
    f.write_text("layer_norm_eps: 1e-5\nhidden_size: 64\nnum_heads: 4\n")
    c = load_config(f)
    assert c.layer_norm_eps == 1e-5 and c.name == "eps"


def test_clear_errors_for_wrong_config_sources_and_replace_keys(tmp_path, monkeypatch):
    import substation
    from substation.config import ConfigError, load_config
    with pytest.raises(TypeError, match="a config is an EncoderConfig, a mapping"):
        load_config(3)
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(str(tmp_path))
    (tmp_path / "tiny").mkdir()  # e.g. made by `substation compile tiny --out tiny`
    monkeypatch.chdir(tmp_path)
    from substation.resources import bundled_file
    assert load_config("tiny") == load_config(bundled_file("tiny", ".yaml"))
    with pytest.raises(ConfigError, match="tiny is a folder"):
        load_config("./tiny")
    with pytest.raises(ConfigError, match="unknown config key\\(s\\) heads"):
        load_config("tiny").replace(heads=5)
    with pytest.raises(ConfigError, match="unknown dropout key\\(s\\) bogus"):
        load_config("tiny").replace(dropout={"bogus": 1})
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        substation.optimize(3)
    assert {"BuildError", "ToolchainError", "LayoutError", "ConfigError"} <= set(substation.__all__)
