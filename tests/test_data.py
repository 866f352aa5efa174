"""Loading data: OpenCV preprocessing modes, tensor folders, batching, config errors."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from qtool.config import PreprocessConfig, load_config
from qtool.data.dataset import batches, model_batch_size, open_data
from qtool.errors import QtoolError
from qtool.graph.modelio import InputSpec
from qtool.data.preprocess import resize_image, to_tensor

SPEC = InputSpec("x", np.dtype("float32"), (None, 3, 8, 8))


def _gradient(h, w):
    """An image whose pixel values tell where they came from: B = row, G = column."""
    img = np.zeros((h, w, 3), np.uint8)
    img[..., 0] = np.arange(h)[:, None]
    img[..., 1] = np.arange(w)[None, :]
    img[..., 2] = 200
    return img


def test_stretch_resizes_to_size():
    out = resize_image(_gradient(40, 80), PreprocessConfig(resize="stretch", interpolation="nearest"), (20, 10))
    assert out.shape == (20, 10, 3)
    assert out[..., 0].max() > 35 and out[..., 1].max() > 70  # the whole image is kept


def test_crop_fraction_is_centred_crop_of_shorter_side():
    img = _gradient(100, 200)
    cfg = PreprocessConfig(resize="crop_fraction", crop_fraction=0.5, interpolation="nearest")
    out = resize_image(img, cfg, (50, 50))
    # crop 50x50 from the centre: rows 25..74, columns 75..124; nearest keeps exact pixels
    assert out[0, 0, 0] == 25 and out[-1, -1, 0] == 74
    assert out[0, 0, 1] == 75 and out[-1, -1, 1] == 124


def test_shorter_side_then_center_crop():
    img = _gradient(100, 200)
    cfg = PreprocessConfig(resize="shorter_side", resize_shorter=50, interpolation="nearest")
    out = resize_image(img, cfg, (40, 40))
    assert out.shape == (40, 40, 3)
    # after the resize to 50x100 the crop starts at row 5, column 30 (of the resized image): x2 in the original
    assert out[0, 0, 0] == 10 and abs(int(out[0, 0, 1]) - 60) <= 2


def test_letterbox_keeps_aspect_and_pads():
    img = np.full((50, 100, 3), 255, np.uint8)
    out = resize_image(img, PreprocessConfig(resize="letterbox", pad_value=114), (64, 64))
    assert out.shape == (64, 64, 3)
    assert np.all(out[0] == 114) and np.all(out[-1] == 114)  # bands above and below
    assert np.all(out[32] == 255)  # image in the middle


def test_to_tensor_channel_order_layout_and_normalisation():
    img = np.zeros((2, 3, 3), np.uint8)
    img[..., 0], img[..., 2] = 10, 250  # B = 10, R = 250
    nchw = to_tensor(img, PreprocessConfig(mean=(127, 127, 127), std=(128, 128, 128)))
    assert nchw.shape == (1, 3, 2, 3) and nchw.dtype == np.float32
    assert nchw[0, 0, 0, 0] == pytest.approx((250 - 127) / 128)  # RGB: red first
    nhwc = to_tensor(img, PreprocessConfig(channel_order="BGR", layout="NHWC", scale=1 / 255, mean=(0.5,) * 3,
                                           std=(0.5,) * 3))
    assert nhwc.shape == (1, 2, 3, 3)
    assert nhwc[0, 0, 0, 0] == pytest.approx((10 / 255 - 0.5) / 0.5, abs=1e-6)


def test_image_folder_recursive_sorted_and_batched(tmp_path):
    for name in ["b/2.png", "a/1.jpg", "c.bmp", "skip.txt"]:
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        cv2.imwrite(str(path), _gradient(16, 16)) if not name.endswith(".txt") else path.write_text("x")
    source = open_data(tmp_path, [SPEC], PreprocessConfig())
    assert [source.key(p) for p in source.files] == ["a/1.jpg", "b/2.png", "c.bmp"]
    got = list(batches(source, batch_size=2))
    assert [len(b) for b in got] == [2, 1] and got[0].feeds["x"].shape == (2, 3, 8, 8)


def test_npz_folder_multi_input_and_variable_shapes(tmp_path):
    specs = [InputSpec("a", np.dtype("float32"), (None, 3, None)), InputSpec("b", np.dtype("int64"), (None,))]
    for i, width in enumerate([4, 4, 6, 4]):
        np.savez(tmp_path / f"{i}.npz", a=np.ones((1, 3, width), np.float32), b=np.array([i]))
    got = list(batches(open_data(tmp_path, specs, PreprocessConfig()), batch_size=8))
    # consecutive samples of one shape share a batch; a new width starts a new one
    assert [b.feeds["a"].shape for b in got] == [(2, 3, 4), (1, 3, 6), (1, 3, 4)]
    assert got[0].feeds["b"].tolist() == [0, 1]


def test_fixed_batch_or_non_leading_batch_feeds_one_at_a_time():
    assert model_batch_size([InputSpec("x", np.dtype("float32"), (1, 3, 8, 8))], 8) == 1
    state = InputSpec("state", np.dtype("float32"), (2, None, 128))
    assert model_batch_size([InputSpec("x", np.dtype("float32"), (None, 512)), state], 8) == 1
    assert model_batch_size([SPEC], 8) == 8


def test_npy_shape_mismatch_names_file(tmp_path):
    np.save(tmp_path / "bad.npy", np.ones((1, 3, 9, 9), np.float32))
    with pytest.raises(QtoolError, match=r"bad\.npy: array 'x' has shape \[1, 3, 9, 9\]"):
        list(batches(open_data(tmp_path, [SPEC], PreprocessConfig()), 1))


def test_empty_folder_is_an_error(tmp_path):
    with pytest.raises(QtoolError, match="no samples found"):
        open_data(tmp_path, [SPEC], PreprocessConfig())


def test_config_unknown_key_names_it_and_the_allowed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preprocess:\n  mena: [1, 2, 3]\n")
    with pytest.raises(QtoolError, match=r"unknown key 'preprocess.mena' \(did you mean 'mean'\?\); allowed: size"):
        load_config(path)
    path.write_text("preprocess:\n  resize: squash\n")
    with pytest.raises(QtoolError, match="resize must be one of stretch"):
        load_config(path)
    path.write_text("preprocess:\n  size: 224\n")
    assert load_config(path).preprocess.size == (224, 224)


def test_a_pass_asked_for_one_sample_decodes_one_file(tmp_path):
    """The first sample alone (the run check's, the speed rule's shapes) is read without decoding
    the files after it ahead of time; a whole pass still reads every file once."""
    from qtool.data.dataset import iter_samples

    for i in range(20):
        np.save(tmp_path / f"s{i:02d}.npy", np.zeros((1, 3, 8, 8), np.float32))
    source = open_data(tmp_path, [SPEC], PreprocessConfig())
    loaded = []
    load = source.load
    source.load = lambda path: loaded.append(path.name) or load(path)
    assert len(list(iter_samples(source, 1))) == 1 and loaded == ["s00.npy"]
    loaded.clear()
    assert len(list(iter_samples(source))) == 20 and sorted(loaded) == [f"s{i:02d}.npy" for i in range(20)]
