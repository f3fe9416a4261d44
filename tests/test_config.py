import json
import re

import pytest

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.errors import ConfigError, ModelLoadError
from engine.models.loader import read_config


def test_defaults_are_moondream2():
    c = ModelConfig()
    assert (c.text.dim, c.text.n_layers, c.text.n_heads, c.text.vocab_size, c.text.max_context) == (
        2048, 24, 32, 51200, 2048)
    assert (c.vision.enc_dim, c.vision.enc_n_layers, c.vision.crop_size, c.vision.max_crops) == (1152, 27, 378, 12)
    assert c.prefix_len == 730
    assert c.text.rot_dim == 32 and c.text.head_dim == 64
    assert c.tokenizer.templates.caption["normal"] == (1, 32708, 2, 6382, 3)
    assert c.tokenizer.templates.query.prefix == (1, 15381, 2)


def test_round_trip_and_wrapper(tmp_path):
    c = ModelConfig.from_dict({"text": {"n_layers": 3}, "tokenizer": {
        "templates": {"query": {"suffix": [3]}}, "question_rewrites": [["how many (?P<w>cats)", r"How many \g<w>?"]]}})
    assert c.text.n_layers == 3 and c.text.dim == 2048
    assert c.tokenizer.question_rewrites == (("how many (?P<w>cats)", r"How many \g<w>?"),)
    c = ModelConfig.from_dict({**c.to_dict(), "tokenizer": {**c.to_dict()["tokenizer"],
                                                            "caption_rewrites": [["describe it", "long"]]}})
    assert c.tokenizer.caption_rewrites == (("describe it", "long"),)
    assert ModelConfig.from_dict(c.to_dict()) == c
    (tmp_path / "config.json").write_text(json.dumps({"config": c.to_dict()}))
    assert read_config(tmp_path) == c
    # The real folder's config.json (vikhyatk/moondream2, 2025-06-21): Hugging Face's keys around
    # an empty "config", which had been refused ("unknown field config.architectures")
    hf = {"architectures": ["HfMoondream"], "auto_map": {"AutoConfig": "hf_moondream.HfConfig",
          "AutoModelForCausalLM": "hf_moondream.HfMoondream"}, "config": {}, "model_type": "moondream1",
          "torch_dtype": "bfloat16", "transformers_version": "4.44.0"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert read_config(tmp_path) == ModelConfig()
    (tmp_path / "config.json").write_text(json.dumps({**hf, "config": c.to_dict()}))
    assert read_config(tmp_path) == c


def test_absent_config_takes_defaults(tmp_path):
    assert read_config(tmp_path) == ModelConfig()


@pytest.mark.parametrize("data, needle", [
    ({"text": {"dimm": 4}}, "text.dimm"),
    ({"textt": {}}, "config.textt"),
    ({"tokenizer": {"templates": {"caption": {"tiny": [1]}}}}, "caption.tiny"),
    ({"tokenizer": {"templates": {"ask": {}}}}, "templates.ask"),
    ({"vision": {"crop_size": "378"}}, "vision.crop_size"),
    ({"text": {"n_heads": 0}}, "text.n_heads"),
    ({"text": {"dim": 100, "n_heads": 3}}, "text.dim"),
    ({"vision": {"proj_out_dim": 1024}}, "proj_out_dim"),
    ({"vision": {"overlap_margin": 14}}, "overlap_margin"),
    ({"tokenizer": {"templates": {"query": {"prefix": "1 2"}}}}, "query.prefix"),
    ({"tokenizer": {"answer_id": 99999}}, "99999"),
    ({"vision": {"resample": "nearest"}}, "vision.resample"),
    ({"tokenizer": {"question_rewrites": {"a": "b"}}}, "tokenizer.question_rewrites"),
    ({"tokenizer": {"question_rewrites": [["a", "b", "c"]]}}, "question_rewrites[0]"),
    ({"tokenizer": {"question_rewrites": [["a", "b"], ["(unclosed", "b"]]}}, "question_rewrites[1]"),
    ({"tokenizer": {"question_rewrites": [["(?P<s>star)", r"\g<shape>"]]}}, "question_rewrites[0]"),
    ({"tokenizer": {"caption_rewrites": [["describe it", "medium"]]}}, "caption_rewrites[0]: 'medium'"),
    ({"tokenizer": {"caption_rewrites": [["describe (it", "long"]]}}, "caption_rewrites[0]"),
    ({"tokenizer": {"templates": {"caption": {"short": []}}}}, "caption.short must not be empty"),
    ({"text": {"n_layers": 10 ** 12}}, "text.n_layers is 1000000000000, more than 1024"),
    ({"text": {"max_context": 10 ** 9}}, "text.max_context is 1000000000, more than 32768"),
    ({"vision": {"enc_dim": 10 ** 7}}, "vision.enc_dim is 10000000, more than 1048576"),
    ({"config": {}, "text": {"n_layers": 2}}, '"text" must go inside "config"'),
    # another model's folder had been "unknown field config.architectures"
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096},
     "model_type 'llama' without Moondream 2's \"config\" object"),
    # each check at its edge: one past it was accepted by a hand mutant of the rule
    ({"text": {"n_kv_heads": 5}}, "text.n_heads (32) must be a multiple of text.n_kv_heads (5)"),
    ({"vision": {"crop_size": 392, "overlap_margin": 14}}, "overlap_margin"),  # a window of 0 patches
    ({"text": {"max_context": 730}}, "leaves no room after the image prefix"),
    ({"tokenizer": {"answer_id": 51200}}, "token id 51200"),
    ({"region": {"size_out_dim": 2047}}, "region.size_out_dim must be even"),
    ({"vision": {"in_channels": 1}}, "vision.in_channels must be 3"),
    ({"text": {"n_layers": 1025}}, "text.n_layers is 1025, more than 1024"),
    ({"text": {"n_layers": True}}, "text.n_layers must be an integer"),
    ({"tokenizer": {"templates": {"query": {"prefx": [1]}}}}, "templates.query.prefx"),
])
def test_invalid_configs_name_the_field(data, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        ModelConfig.from_dict(data)


def test_bad_json_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config(tmp_path)


def test_unknown_field_in_folder_is_a_load_error(tmp_path, small_folder):
    import shutil

    from engine.models.loader import load_model

    folder = tmp_path / "m"
    shutil.copytree(small_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text"]["rope_theta"] = 10000
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="text.rope_theta"):
        load_model(folder)


@pytest.mark.parametrize("field, value", [
    ("pipeline_depth", 0), ("pipeline_depth", 3), ("max_batch_size", 0), ("page_size", 0),
    ("prefill_token_budget", 0), ("max_queue", 0), ("max_draft", True), ("lower_turn", False),
    ("kv_pages", 0),  # `kv_pages or default` would have taken 0 as "size it for me"
])
def test_engine_config_refuses_values_past_each_edge(field, value):
    """A bad EngineConfig is a ConfigError naming the field when it is built, before any model
    loads; each of these had passed a hand mutant of its check."""
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


def test_engine_config_edges_that_are_valid():
    for ok in ({"pipeline_depth": 1}, {"max_draft": 0}, {"lower_turn": 0}, {"lower_turn": 2}, {"max_queue": 1},
               {"kv_pages": 1}):
        EngineConfig(**ok)


def test_engine_config_defaults_are_the_documented_ones():
    """README's Engine API: pipelined (depth 2), a full batch of 32, `max_draft` 16 draft tokens a
    step, one admission in `lower_turn` 4 to lower-priority work. Depth 1 by default would give the
    same tokens, only slower: no other test would notice."""
    c = EngineConfig()
    assert (c.pipeline_depth, c.max_batch_size, c.max_draft, c.lower_turn) == (2, 32, 16, 4)
    assert (c.model, c.device, c.kv_pages) == ("tiny", "cpu", None)


@pytest.mark.parametrize("field, value", [
    ("cpu_script", "false"), ("vision_thread", "no"), ("cuda_graphs", 0), ("triton_kernels", "0"),
    ("debug_checks", "yes"), ("model", None), ("model", 5), ("kv_pages", True),
])
def test_engine_config_refuses_flags_and_model_of_another_type(field, value):
    """A flag given as a string ("false" from a settings file or the environment) had meant yes,
    and model=None was a TypeError from inside the loader: a ConfigError naming the field."""
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


def test_engine_refuses_a_config_that_is_not_an_engine_config():
    """Engine("tiny") or Engine({"model": ...}) had raised AttributeError ('str' object has no
    attribute 'model'): a ConfigError that says how to call it, before any model loads."""
    from engine import Engine

    for config in ("tiny", {"model": "tiny"}):
        with pytest.raises(ConfigError, match="EngineConfig"):
            Engine(config)
