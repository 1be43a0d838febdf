"""Image/video loading and patchifying against transformers' Qwen2-VL processors."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex_train.data.synthetic import write_mp4
from rollplex_train.data.vision import (
    load_image,
    load_video,
    patchify_images,
    patchify_video,
    sample_frame_indices,
    sample_frames_by_time,
    smart_resize,
)

MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def _random_image(rng: np.random.Generator, h: int, w: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    for h in (10, 28, 56, 57, 100, 333, 1000):
        for w in (14, 56, 90, 500, 1200):
            for lo, hi in ((56 * 56, 112 * 112), (4 * 28 * 28, 1280 * 28 * 28)):
                assert smart_resize(h, w, 28, lo, hi) == hf_smart_resize(h, w, 28, lo, hi)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000)


def test_patchify_images_matches_qwen2vl_image_processor():
    from transformers import Qwen2VLImageProcessor

    rng = np.random.default_rng(0)
    images = [_random_image(rng, h, w) for h, w in ((56, 56), (100, 37), (300, 200), (20, 20), (112, 112))]
    images += [_random_image(rng, 40, 60, "RGBA"), _random_image(rng, 70, 50, "L")]
    processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    # Without torchvision the class resolves to the PIL backend, the one we reproduce.
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    ref = processor(images=images, return_tensors="np")
    pixel_values, grid = patchify_images(images, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert pixel_values.dtype == torch.float32 and grid.dtype == torch.int64
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    assert pixel_values.shape == ref["pixel_values"].shape == (int(grid.prod(-1).sum()), 1176)
    np.testing.assert_allclose(pixel_values.numpy(), ref["pixel_values"], rtol=0, atol=1e-6)


def test_static_video_equals_image_path(tmp_path: Path):
    rng = np.random.default_rng(1)
    frame = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
    img_values, img_grid = patchify_images([Image.fromarray(frame)], min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    vid_values, vid_grid, seconds = patchify_video(np.stack([frame, frame]), min_pixels=MIN_PIXELS,
                                                   max_pixels=MAX_PIXELS, sample_fps=2.0)
    assert vid_grid.tolist() == img_grid.tolist()
    assert torch.equal(vid_values, img_values)
    assert seconds.dtype == torch.float32 and seconds.tolist() == [1.0]
    # One frame is padded to two by repetition: same result.
    one_values, one_grid, _ = patchify_video(frame[None], min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                             sample_fps=2.0)
    assert torch.equal(one_values, img_values) and torch.equal(one_grid, img_grid)


def test_video_patch_layout_matches_transformers_order():
    """Frames 2t and 2t+1 sit in the temporal slot of each patch, channel-major (C, T, ph, pw)."""
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    values, grid, seconds = patchify_video(frames, min_pixels=MIN_PIXELS, max_pixels=MIN_PIXELS, sample_fps=4.0)
    assert grid.tolist() == [[2, 4, 4]] and seconds.tolist() == [0.5]
    per_frame = [patchify_images([Image.fromarray(f)], min_pixels=MIN_PIXELS, max_pixels=MIN_PIXELS)[0]
                 for f in frames]
    v = values.view(2, 16, 3, 2, 14, 14)
    for t in range(2):
        for slot in range(2):
            expect = per_frame[2 * t + slot].view(16, 3, 2, 14, 14)[:, :, 0]
            assert torch.equal(v[t, :, :, slot], expect)


def test_load_video_frame_count_and_fps(tmp_path: Path):
    frames = np.stack([np.full((56, 56, 3), 20 * i, np.uint8) for i in range(8)])
    path = tmp_path / "clip.mp4"
    write_mp4(path, frames, fps=4)
    got, sample_fps = load_video(path, fps=2.0, max_frames=8)
    assert got.shape == (4, 56, 56, 3) and got.dtype == np.uint8
    assert sample_fps == pytest.approx(2.0)
    got, sample_fps = load_video(path, fps=8.0, max_frames=6)  # capped by max_frames
    assert got.shape[0] == 6 and sample_fps == pytest.approx(3.0)
    got, _ = load_video(path, fps=0.5, max_frames=8)  # at least min_frames
    assert got.shape[0] == 4
    means = [float(f.mean()) for f in load_video(path, fps=4.0, max_frames=8)[0]]
    assert means == sorted(means)  # evenly spread, in order
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        load_video(tmp_path / "missing.mp4", fps=2.0, max_frames=8)
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video at all" * 10)
    with pytest.raises(ValueError, match="bad.mp4"):
        load_video(bad, fps=2.0, max_frames=8)


def _write_vfr_mp4(path: Path) -> np.ndarray:
    """A phone-like variable-frame-rate clip: 30 fps for 1 s, 10 fps for 1 s, 15 fps for 1 s (55
    frames, pts in 1/30 s); frame k is flat grey 4 * k. Returns the frames' start times in seconds."""
    import fractions

    import av

    pts = list(range(30)) + [30 + 3 * i for i in range(10)] + [60 + 2 * i for i in range(15)]
    tb = fractions.Fraction(1, 30)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = tb
        stream.options = {"crf": "10", "threads": "1", "bf": "0"}
        for k, p in enumerate(pts):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 4 * k, np.uint8), format="rgb24")
            frame.pts, frame.time_base = p, tb
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return np.asarray(pts) / 30


def test_variable_frame_rate_sampled_by_timestamp(tmp_path: Path):
    """Index picks (linspace over 55 frames: 0, 18, 36, 54) land up to 0.38 s from the requested
    times 0, 0.978, 1.956, 2.933 s; picking by timestamp takes the nearest frames 0, 29, 40, 54."""
    starts = _write_vfr_mp4(tmp_path / "vfr.mp4")
    frames, sample_fps = load_video(tmp_path / "vfr.mp4", fps=2.0, max_frames=8)
    picked = [int(round(float(f.mean()) / 4)) for f in frames]  # frame k is grey 4 * k
    assert picked == [0, 29, 40, 54]
    requested = np.linspace(starts[0], starts[-1], 4)
    assert np.abs(starts[picked] - requested).max() < 0.05  # within half the 10 fps interval
    import decord

    stamps = decord.VideoReader(str(tmp_path / "vfr.mp4")).get_frame_timestamp(range(55))
    assert sample_fps == pytest.approx(4 / (stamps[-1, 1] - stamps[0, 0]))  # n / duration from timestamps
    _, _, seconds = patchify_video(frames, min_pixels=MIN_PIXELS, max_pixels=MIN_PIXELS, sample_fps=sample_fps)
    assert seconds.item() == pytest.approx(2 / sample_fps)


def test_sample_frames_by_time_on_irregular_stamps():
    starts = np.array([0.0, 0.1, 0.2, 1.0, 1.25, 2.75, 3.0])
    stamps = np.stack([starts, np.append(starts[1:], 3.25)], axis=1)
    indices, sample_fps = sample_frames_by_time(stamps, fps=1.0, max_frames=4, min_frames=4)
    # 4 frames at times 0, 1, 2, 3 s: nearest starts 0.0, 1.0, (1.25 vs 2.75: a tie, the earlier), 3.0
    assert indices == [0, 3, 4, 6] and sample_fps == pytest.approx(4 / 3.25)
    with pytest.raises(ValueError, match="shape"):
        sample_frames_by_time(np.zeros((0, 2)), fps=1.0, max_frames=4)


def test_sample_frame_indices_rules():
    assert sample_frame_indices(8, 4.0, fps=2.0, max_frames=8) == [0, 2, 5, 7]
    assert len(sample_frame_indices(100, 10.0, fps=2.0, max_frames=8)) == 8
    assert len(sample_frame_indices(7, 1.0, fps=1.0, max_frames=64)) == 6  # floored to a multiple of 2
    assert sample_frame_indices(1, 1.0, fps=2.0, max_frames=8) == [0]
    with pytest.raises(ValueError):
        sample_frame_indices(0, 4.0, fps=2.0, max_frames=8)


def exif_rotated_jpeg() -> bytes:
    """A JPEG stored 320x240 (left half red, right half blue) with EXIF Orientation 6 (rotate 90
    degrees clockwise to display): a viewer shows it 240 wide and 320 high, red on top."""
    stored = np.zeros((240, 320, 3), np.uint8)
    stored[:, :160] = (255, 0, 0)
    stored[:, 160:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    buf = io.BytesIO()
    Image.fromarray(stored).save(buf, format="JPEG", quality=95, exif=exif)
    return buf.getvalue()


def test_exif_orientation_applied_on_every_source(tmp_path: Path):
    data = exif_rotated_jpeg()
    (tmp_path / "phone.jpg").write_bytes(data)
    with Image.open(io.BytesIO(data)) as raw:
        assert raw.size == (320, 240) and raw.getexif()[0x0112] == 6  # stored sideways
        from_pil = load_image(raw)
    from_path = load_image("phone.jpg", base_dir=tmp_path)
    from_bytes = load_image({"bytes": data, "path": "phone.jpg"})
    for image in (from_path, from_bytes, from_pil):
        assert image.mode == "RGB" and image.size == (240, 320)
        pixels = np.asarray(image).astype(float)
        np.testing.assert_allclose(pixels[:140].mean((0, 1)), (255, 0, 0), atol=6)  # red on top
        np.testing.assert_allclose(pixels[180:].mean((0, 1)), (0, 0, 255), atol=6)  # blue below
    assert np.array_equal(np.asarray(from_path), np.asarray(from_bytes))
    assert np.array_equal(np.asarray(from_path), np.asarray(from_pil))


def test_sixteen_bit_png_ramp_scaled_to_eight_bits(tmp_path: Path):
    """A 16-bit grayscale ramp (mode I;16) keeps its ramp: convert('RGB') alone clips it to white."""
    ramp = np.tile(np.linspace(0, 65535, 256).round().astype(np.uint16), (16, 1))
    Image.fromarray(ramp).save(tmp_path / "ramp16.png")
    with Image.open(tmp_path / "ramp16.png") as raw:
        assert raw.mode == "I;16"
    image = np.asarray(load_image(tmp_path / "ramp16.png")).astype(float)
    assert image.shape == (16, 256, 3)
    assert image.mean() == pytest.approx(127.5, abs=0.6)
    assert image[:, 0].max() == 0 and image[:, -1].min() == 255
    assert np.all(np.diff(image[0, :, 0]) >= 0)


@pytest.mark.parametrize("mode, fill, expected", [
    ("1", 1, 255), ("L", 128, 128), ("P", 0, 0), ("I;16", 128 * 257, 128), ("I;16B", 128 * 257, 128),
    ("I", 128 * 257, 128), ("I", 128, 128), ("F", 0.5, 128), ("F", 128.0, 128),
    ("LA", (128, 255), 128), ("La", (128, 255), 128), ("RGBa", (128, 128, 128, 255), 128),
    ("CMYK", (0, 0, 0, 127), 128), ("YCbCr", (128, 128, 128), 128), ("HSV", (0, 0, 128), 128),
    ("LAB", (137, 128, 128), 128),  # L* = 53.7 (137/255 * 100), neutral a/b: sRGB mid grey
])
def test_every_pillow_mode_maps_to_sensible_rgb(mode, fill, expected):
    image = load_image(Image.new(mode, (6, 4), fill))
    assert image.mode == "RGB" and image.size == (6, 4)
    np.testing.assert_allclose(np.asarray(image).astype(float), expected, atol=2)


def test_load_image_sources_and_errors(tmp_path: Path):
    img = _random_image(np.random.default_rng(3), 30, 40, "RGBA")
    img.save(tmp_path / "a.png")
    by_rel = load_image("a.png", base_dir=tmp_path)
    assert by_rel.mode == "RGB" and by_rel.size == (40, 30)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    by_bytes = load_image({"bytes": buf.getvalue(), "path": None})
    by_dict_path = load_image({"bytes": None, "path": str(tmp_path / "a.png")})
    assert np.array_equal(np.asarray(by_rel), np.asarray(by_bytes))
    assert np.array_equal(np.asarray(by_rel), np.asarray(by_dict_path))
    with pytest.raises(FileNotFoundError, match="nope.png"):
        load_image("nope.png", base_dir=tmp_path)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(ValueError, match="broken.png"):
        load_image(tmp_path / "broken.png")
    with pytest.raises(ValueError):
        load_image(42)
