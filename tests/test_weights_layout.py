from pathlib import Path

from engine.config import ModelConfig
from engine.models.weights import expected_shapes

TSV = Path(__file__).parent / "data" / "moondream2_weights.tsv"


def test_default_layout_is_exactly_the_published_checkpoint():
    published = {}
    for line in TSV.read_text().splitlines():
        key, shape, _dtype = line.split("\t")
        published[key] = tuple(int(x) for x in shape.strip("()").split(",") if x.strip())
    ours = expected_shapes(ModelConfig())
    assert len(published) == 592
    assert ours == published


def test_model_parameters_cover_the_layout():
    import torch

    from engine.models.moondream import MoondreamModel

    config = ModelConfig()
    with torch.device("meta"):
        model = MoondreamModel(config)
    names = {"model." + k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert names == expected_shapes(config)
