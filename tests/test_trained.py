"""training.trained: the final model fed images as the run's test set was, and every
mistake in the images given to predict one line saying what to give."""
import numpy as np
import pytest

from training.models import build_model
from training.trained import TrainedModel


def _trained(shape, test_transforms=()):
    c = shape[0]
    card = {"model": "seed_cnn", "model_options": {"conv1": 4, "conv2": 4, "kernel": 3},
            "input_shape": list(shape), "num_classes": 3, "classes": ["a", "b", "c"], "inputs": "pixels",
            "test_transforms": list(test_transforms), "transform": None, "mean": [0.5] * c, "std": [0.25] * c}
    module = build_model("seed_cnn", tuple(shape), 3, card["model_options"]).eval()
    return TrainedModel(module, card, "/tmp/nowhere")


def test_rgb_images_in_nchw_are_predicted_and_resized_by_the_runs_test_transforms():
    trained = _trained((3, 16, 16), [{"resize": {"size": [16, 16]}}])
    images = np.random.default_rng(0).integers(0, 256, (5, 3, 24, 20), dtype=np.uint8)
    labels = trained.predict(images)
    assert labels.dtype == np.int64 and labels.shape == (5,) and set(labels) <= {0, 1, 2}


@pytest.mark.parametrize("shape, dtype, says", [
    ((5, 16, 16, 3), np.uint8, r"the model takes 3 channel\(s\), got shape \(5, 16, 16, 3\); they look channels-last "
                               r"\(N x H x W x C, as PIL and numpy give\): images.transpose\(0, 3, 1, 2\)$"),
    ((3, 16, 16), np.uint8, r"the model takes 3 channels, got shape \(3, 16, 16\); one image\? give a batch of one: "
                            r"images\[None\]$"),
    ((16, 16, 3), np.uint8, r"the model takes 3 channels, got shape \(16, 16, 3\); one channels-last image \(H x W x "
                            r"C, as PIL gives\)\? give images.transpose\(2, 0, 1\)\[None\]$"),
    ((5, 1, 16, 16), np.uint8, r"the model takes 3 channel\(s\), got shape \(5, 1, 16, 16\)$"),
    ((5, 3, 24, 24), np.uint8, r"images of 24 x 24 pixels come out 24 x 24; the model takes 16 x 16 \(input_shape "
                               r"\[3, 16, 16\]\): resize them to 16 x 16 first$"),
    ((5, 3, 16, 16), np.float32, r"images must be uint8 N x 3 x H x W, got float32 of shape \(5, 3, 16, 16\)$"),
])
def test_images_predict_cannot_take_are_one_line_saying_what_to_give(shape, dtype, says):
    trained = _trained((3, 16, 16))
    with pytest.raises(ValueError, match=says):
        trained.predict(np.zeros(shape, dtype))


def test_a_resize_that_keeps_the_aspect_ratio_is_named_when_it_gives_another_size():
    trained = _trained((3, 16, 16), [{"resize": {"size": 16}}])        # shorter side to 16
    with pytest.raises(ValueError, match=r"images of 24 x 30 pixels come out 16 x 20 after the run's test_transforms "
                                         r"\[\{'resize': \{'size': 16\}\}\]; the model takes 16 x 16"):
        trained.predict(np.zeros((2, 3, 24, 30), np.uint8))


def test_one_channel_images_may_come_without_their_channel_axis():
    trained = _trained((1, 8, 8))
    images = np.random.default_rng(1).integers(0, 256, (4, 8, 8), dtype=np.uint8)
    assert (trained.predict(images) == trained.predict(images[:, None])).all()
