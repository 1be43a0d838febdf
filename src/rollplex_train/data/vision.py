"""Image/video loading and Qwen2-VL patchifying, without torchvision.

Legend: T frames, H/W pixels, C = 3 channels, Np patches, D = C * temporal_patch_size * patch_size**2
patch features (1176 for Qwen2-VL: 3 * 2 * 14 * 14).

Images are first turned the way they are displayed (EXIF ``Orientation`` applied with
``ImageOps.exif_transpose``, as browsers and phone galleries do) and brought to 8-bit RGB from any
mode Pillow opens (16-bit and 32-bit integer and float grayscale scaled to 8 bits, premultiplied alpha
un-premultiplied). Then they follow transformers'
``Qwen2VLImageProcessorPil`` step by step (RGB conversion compositing alpha on white, ``smart_resize`` with factor ``patch_size * merge_size``, PIL BICUBIC resize,
rescale by 1/255 in float64 then float32, OPENAI CLIP mean/std normalisation, patch layout
``(t, h/m, w/m, m, m, C, tp, p, p)``), so the output equals the processor's to float32 rounding.

Videos: frames are counted as qwen-vl-utils does (``fps`` frames per second of video, at least
``min_frames``, at most ``max_frames``, a multiple of ``temporal_patch_size``) and picked by
presentation timestamp: the frame nearest to each of ``n`` times evenly spread from the first to the
last frame (for a constant frame rate these are qwen-vl-utils' rounded-linspace indices; for a
variable one, e.g. a phone recording, index picks would drift from the requested times). The clip's
duration comes from the timestamps too, and the sampled rate is qwen-vl-utils' ``n / duration``.
Each frame is then resized exactly like an image (PIL BICUBIC,
where qwen-vl-utils uses torchvision's antialiased bicubic); the per-frame pixel cap is ``max_pixels``
as given (qwen-vl-utils additionally shrinks it by a total-pixel budget over all frames). The patch
layout is that of ``Qwen2VLVideoProcessor``; a static video therefore gives the image path's patches.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200

ImageItem = Union[str, os.PathLike, dict, Image.Image]


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of ``factor``, area within [min_pixels, max_pixels].

    The aspect ratio is kept as closely as the rounding allows (same algorithm as transformers).

    Args:
        height, width: input size in pixels.
        factor: side granularity in pixels (``patch_size * merge_size``).
        min_pixels, max_pixels: bounds on ``h * w`` in pixels.

    Returns:
        ``(h, w)`` in pixels.

    Raises:
        ValueError: the aspect ratio exceeds 200 or a side is not positive.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width}: sides must be positive")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image size {height}x{width}: aspect ratio above {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def _to_8bit_gray(image: Image.Image) -> Image.Image:
    """Mode ``L`` copy of a high-bit-depth grayscale image (``I;16*``, ``I``, ``F``).

    ``convert("L")`` clips these at 255, so a 16-bit ramp comes out almost all white. Instead:
    16-bit modes map 0..65535 to 0..255 (divide by 257); ``I`` (32-bit, what older Pillow gives
    16-bit PNGs) is taken as 16-bit when a value exceeds 255, else as 8-bit; ``F`` is taken as
    0..1 when no value exceeds 1, else as 0..255. Values outside the range are clipped.
    """
    values = np.asarray(image).astype(np.float64)
    top = float(values.max()) if values.size else 0.0
    if image.mode in _SIXTEEN_BIT or (image.mode == "I" and top > 255):
        values = np.clip(values, 0, 65535) / 257.0
    elif image.mode == "F" and top <= 1.0:
        values = values * 255.0
    return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8))


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB copy of ``image`` in any mode Pillow opens; transparency is composited onto white
    (as transformers does). High-bit-depth grayscale is scaled to 8 bits (``_to_8bit_gray``),
    premultiplied ``La``/``RGBa`` are un-premultiplied first (Pillow cannot convert ``La`` to RGB)."""
    if image.mode in _SIXTEEN_BIT + ("I", "F"):
        image = _to_8bit_gray(image)
    elif image.mode in ("La", "RGBa"):
        image = image.convert("LA" if image.mode == "La" else "RGBA")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resolve_path(path: Union[str, os.PathLike], base_dir: Optional[Union[str, os.PathLike]]) -> Path:
    """``path`` itself if absolute (or no base), else ``base_dir / path``."""
    p = Path(path)
    if p.is_absolute() or base_dir is None:
        return p
    return Path(base_dir) / p


def _image_source(item: ImageItem, base_dir: Optional[Union[str, os.PathLike]]) -> tuple[Any, str]:
    """``(path or BytesIO, display name)`` of an image item (see :func:`load_image`)."""
    if isinstance(item, dict):
        if item.get("bytes") is not None:
            return io.BytesIO(item["bytes"]), f"<bytes of {item.get('path') or 'image'}>"
        if item.get("path"):
            source = resolve_path(item["path"], base_dir)
        else:
            raise ValueError(f"image item {item!r}: expected a 'bytes' or 'path' entry")
    elif isinstance(item, (str, os.PathLike)):
        source = resolve_path(item, base_dir)
    else:
        raise ValueError(f"image item of type {type(item).__name__}: expected a path, a dict or a PIL image")
    if not source.is_file():
        raise FileNotFoundError(f"image file not found: {source}")
    return source, str(source)


@contextlib.contextmanager
def _open_image(item: ImageItem, base_dir: Optional[Union[str, os.PathLike]]) -> Iterator[Image.Image]:
    """The item opened with PIL (lazily); PIL's errors on bad data, while opening or while the
    body reads the pixels, become ``ValueError("corrupt image <name>: ...")``."""
    source, name = _image_source(item, base_dir)
    try:
        with Image.open(source) as img:
            yield img
    except (UnidentifiedImageError, OSError, SyntaxError) as err:  # PIL raises all three on bad data
        raise ValueError(f"corrupt image {name}: {str(err).replace(repr(source), name)}") from err


def load_image(item: ImageItem, base_dir: Optional[Union[str, os.PathLike]] = None) -> Image.Image:
    """Open one image as a decoded 8-bit RGB ``PIL.Image``, oriented as displayed.

    The EXIF ``Orientation`` tag is applied (``ImageOps.exif_transpose``): a JPEG stored 320x240
    with Orientation 6 comes out 240x320, as a viewer shows it, from a path, bytes or a PIL image
    alike. Every mode is mapped to RGB by :func:`to_rgb`.

    Args:
        item: a path (relative paths are resolved against ``base_dir``), a dict in the HF datasets
            ``Image`` style (``{"bytes": ..., "path": ...}``; bytes win when present), or a PIL image.
        base_dir: directory that relative paths are relative to (usually the manifest's directory).

    Raises:
        FileNotFoundError: the path does not exist (the message names the resolved path).
        ValueError: the file or bytes cannot be decoded as an image, or ``item`` has another type.
    """
    if isinstance(item, Image.Image):
        return to_rgb(ImageOps.exif_transpose(item))
    with _open_image(item, base_dir) as img:
        img.load()
        return to_rgb(ImageOps.exif_transpose(img))


def image_size(item: ImageItem, base_dir: Optional[Union[str, os.PathLike]] = None) -> tuple[int, int]:
    """``(height, width)`` in pixels of an image item from its header, without decoding the pixels
    (PIL opens lazily); EXIF rotation is ignored (it swaps the sides, which leaves the token count
    of :func:`image_grid` unchanged). Same items as :func:`load_image`.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the header is not an image PIL can identify (a truncated body is only found
            when :func:`load_image` decodes it).
    """
    if isinstance(item, Image.Image):
        return item.height, item.width
    with _open_image(item, base_dir) as img:
        return img.height, img.width


def image_grid(height: int, width: int, *, min_pixels: int, max_pixels: int, patch_size: int = 14,
               merge_size: int = 2) -> tuple[int, int, int]:
    """``(1, h, w)`` patch grid of an image of ``height x width`` pixels, as :func:`patchify_images`
    makes it (``smart_resize`` with factor ``patch_size * merge_size``).

    Raises:
        ValueError: a side is not positive or the aspect ratio exceeds 200.
    """
    h, w = smart_resize(height, width, factor=patch_size * merge_size, min_pixels=min_pixels, max_pixels=max_pixels)
    return 1, h // patch_size, w // patch_size


def _normalize(frames_thwc: np.ndarray) -> np.ndarray:
    """uint8 (T, H, W, C) -> float32 (T, C, H, W): rescale 1/255 (float64, then float32), CLIP mean/std."""
    x = (frames_thwc.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.asarray(OPENAI_CLIP_MEAN, dtype=np.float32)) / np.asarray(OPENAI_CLIP_STD, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def _patchify(frames: np.ndarray, patch_size: int, temporal_patch_size: int,
              merge_size: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float32 (T, C, H, W), T a multiple of temporal_patch_size -> ((Np, D) float32, (t, h, w) grid)."""
    num_frames, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // temporal_patch_size, height // patch_size, width // patch_size
    patches = frames.reshape(grid_t, temporal_patch_size, channels, grid_h // merge_size, merge_size, patch_size,
                             grid_w // merge_size, merge_size, patch_size)
    # -> (t, h/m, w/m, mh, mw, C, tp, ph, pw): the Qwen2-VL processors' order
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size)
    return flat, (grid_t, grid_h, grid_w)


def _resize_frame(frame: Image.Image, min_pixels: int, max_pixels: int, factor: int) -> np.ndarray:
    """PIL image -> (H', W', 3) uint8 resized with BICUBIC to Qwen2-VL's ``smart_resize`` target."""
    height, width = frame.height, frame.width
    new_h, new_w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return np.asarray(frame.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))


def patchify_images(images: list[Image.Image], *, min_pixels: int, max_pixels: int, patch_size: int = 14,
                    temporal_patch_size: int = 2, merge_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Resize, normalise and patchify images exactly like ``Qwen2VLImageProcessorPil``.

    Args:
        images: PIL images (any mode; converted to RGB with alpha composited on white).
        min_pixels, max_pixels: bounds on the resized area, pixels.
        patch_size, temporal_patch_size, merge_size: the vision tower's geometry.

    Returns:
        pixel_values: (Np, D) float32, images concatenated in order.
        image_grid_thw: (num_images, 3) int64, ``(1, h, w)`` patches per image.

    Raises:
        ValueError: ``images`` is empty, or an image's aspect ratio exceeds 200.
    """
    if not images:
        raise ValueError("patchify_images: no images given")
    factor = patch_size * merge_size
    all_patches, grids = [], []
    for image in images:
        resized = _resize_frame(to_rgb(image), min_pixels, max_pixels, factor)
        frames = np.broadcast_to(_normalize(resized[None]), (temporal_patch_size, 3, *resized.shape[:2]))
        patches, grid = _patchify(frames, patch_size, temporal_patch_size, merge_size)
        all_patches.append(patches)
        grids.append(grid)
    pixel_values = torch.from_numpy(np.concatenate(all_patches, axis=0))
    return pixel_values, torch.tensor(grids, dtype=torch.int64)


def sample_frames_by_time(timestamps: np.ndarray, *, fps: float, max_frames: int, min_frames: int = 4,
                          temporal_patch_size: int = 2) -> tuple[list[int], float]:
    """Frames to read, picked by presentation time; the count follows qwen-vl-utils' ``smart_nframes``.

    ``n = duration * fps`` clamped to ``[min_frames, max_frames]`` (rounded up / down to multiples
    of ``temporal_patch_size``) and to the number of frames, then floored to a multiple of
    ``temporal_patch_size``; ``duration`` is the end of the last frame minus the start of the first.
    The frame whose start is nearest to each of ``np.linspace(first start, last start, n)`` is taken
    (ties to the earlier frame). A clip shorter than ``temporal_patch_size`` frames gives all its
    frames (``patchify_video`` pads by repeating the last one).

    Args:
        timestamps: (T, 2) float seconds, ``[start, end]`` of each frame in decode order (decord's
            ``VideoReader.get_frame_timestamp``).

    Returns:
        ``(indices, sample_fps)``: sorted frame indices and ``n / duration`` frames per second
        (qwen-vl-utils' ``sample_fps``; ``patchify_video`` turns it into ``second_per_grid_ts``).

    Raises:
        ValueError: no frames, timestamps not (T, 2), or a duration that is not positive.
    """
    stamps = np.asarray(timestamps, dtype=np.float64)
    if stamps.ndim != 2 or stamps.shape[0] == 0 or stamps.shape[1] != 2:
        raise ValueError(f"video with frame timestamps of shape {stamps.shape}: expected (T > 0, 2)")
    total = stamps.shape[0]
    duration = float(stamps[-1, 1] - stamps[0, 0])
    if not duration > 0:
        raise ValueError(f"video with {total} frames lasting {duration} s: nothing to sample")
    if total < temporal_patch_size:
        return list(range(total)), total / duration
    factor = temporal_patch_size
    lo = math.ceil(min_frames / factor) * factor
    hi = max(factor, math.floor(max_frames / factor) * factor)
    n = min(max(duration * fps, lo), hi, total)
    n = max(factor, math.floor(n / factor) * factor)
    starts = stamps[:, 0]
    targets = np.linspace(starts[0], starts[-1], n)
    right = np.clip(np.searchsorted(starts, targets), 1, total - 1)  # starts[right - 1] <= target <~ starts[right]
    nearer_left = np.abs(targets - starts[right - 1]) <= np.abs(starts[right] - targets)
    return np.where(nearer_left, right - 1, right).astype(np.int64).tolist(), n / duration


def sample_frame_indices(total_frames: int, video_fps: float, *, fps: float, max_frames: int,
                         min_frames: int = 4, temporal_patch_size: int = 2) -> list[int]:
    """Frame indices of a constant-rate clip: :func:`sample_frames_by_time` on frames ``i / video_fps``.

    Raises:
        ValueError: ``total_frames`` or ``video_fps`` is not positive.
    """
    if total_frames <= 0 or not video_fps > 0:
        raise ValueError(f"video with {total_frames} frames at {video_fps} fps: nothing to sample")
    starts = np.arange(total_frames) / video_fps
    return sample_frames_by_time(np.stack([starts, starts + 1 / video_fps], axis=1), fps=fps, max_frames=max_frames,
                                 min_frames=min_frames, temporal_patch_size=temporal_patch_size)[0]


def load_video(path: Union[str, os.PathLike], *, fps: float, max_frames: int, min_frames: int = 4,
               temporal_patch_size: int = 2) -> tuple[np.ndarray, float]:
    """Read frames evenly spread in presentation time (:func:`sample_frames_by_time`) with decord.

    Args:
        path: video file (mp4 etc.).
        fps: frames to sample per second of video.
        max_frames, min_frames: bounds on the number of sampled frames.
        temporal_patch_size: the sampled count is a multiple of this (unless the clip is shorter).

    Returns:
        frames: (T, H, W, 3) uint8 RGB.
        sample_fps: frames per second of the sampled sequence, ``T / duration`` with the duration
            from the frames' timestamps (``T / total_frames * video_fps`` for a constant rate).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: decord cannot decode the file, or it holds no frames.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"video file not found: {path}")
    import decord  # imported late: decord must come after torch (segfaults otherwise, per qwen-vl-utils users)

    try:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
        if len(reader) == 0:
            raise ValueError("no frames")
        timestamps = reader.get_frame_timestamp(range(len(reader)))
        indices, sample_fps = sample_frames_by_time(timestamps, fps=fps, max_frames=max_frames,
                                                    min_frames=min_frames, temporal_patch_size=temporal_patch_size)
        frames = reader.get_batch(indices).asnumpy()
    except ValueError as err:
        raise ValueError(f"corrupt video {path}: {err}") from err
    except Exception as err:  # decord raises its own DECORDError (a RuntimeError) on bad data
        raise ValueError(f"corrupt video {path}: {type(err).__name__}: {err}") from err
    return np.ascontiguousarray(frames, dtype=np.uint8), sample_fps


def patchify_video(frames: np.ndarray, *, min_pixels: int, max_pixels: int, sample_fps: float,
                   patch_size: int = 14, temporal_patch_size: int = 2,
                   merge_size: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resize, normalise and patchify one video in the ``Qwen2VLVideoProcessor`` layout.

    Args:
        frames: (T, H, W, 3) uint8 RGB; T is padded to a multiple of ``temporal_patch_size`` by
            repeating the last frame.
        min_pixels, max_pixels: bounds on each resized frame's area, pixels.
        sample_fps: frames per second of ``frames`` (from ``load_video``).
        patch_size, temporal_patch_size, merge_size: the vision tower's geometry.

    Returns:
        pixel_values_videos: (Np, D) float32.
        video_grid_thw: (1, 3) int64 ``(t, h, w)``.
        second_per_grid_ts: (1,) float32, ``temporal_patch_size / sample_fps`` seconds.

    Raises:
        ValueError: ``frames`` is not (T>0, H, W, 3) uint8, or ``sample_fps`` is not positive.
    """
    if frames.ndim != 4 or frames.shape[0] == 0 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"patchify_video: expected frames (T, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    if not sample_fps > 0:
        raise ValueError(f"patchify_video: sample_fps={sample_fps} must be positive")
    if pad := -frames.shape[0] % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)], axis=0)
    factor = patch_size * merge_size
    resized = np.stack([_resize_frame(Image.fromarray(f), min_pixels, max_pixels, factor) for f in frames])
    patches, grid = _patchify(_normalize(resized), patch_size, temporal_patch_size, merge_size)
    return (
        torch.from_numpy(np.ascontiguousarray(patches)),
        torch.tensor([grid], dtype=torch.int64),
        torch.tensor([temporal_patch_size / sample_fps], dtype=torch.float32),
    )
