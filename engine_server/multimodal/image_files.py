"""An image file of a chat decoded for the models' image processors: Pillow, its first frame, RGB, refused by name
when it is no image of the formats read or claims more pixels than are read (before it is decoded)."""

from __future__ import annotations

import io
import warnings
from typing import Any

from engine_server.errors import ValidationError

# Pixels one image may decode to (its width times height): a 40-megapixel photo fits; a few kilobytes of PNG that
# claim a billion pixels (a decompression bomb) do not, and are refused before they are decoded.
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def decoded_image(data: bytes, param: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Any:
    """The file `data`'s first frame as an RGB PIL image; ValidationError (naming `param`, the request field it came
    in) for a file that is no image of `FORMATS`, or one of more than `max_pixels` pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as opened:
            width, height = opened.size
            if width * height > max_pixels:
                message = f"the image is {width}x{height} pixels; at most {max_pixels} pixels are read"
                raise ValidationError(message, param)
            with warnings.catch_warnings():  # (Pillow's bomb warning: the size was checked above)
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                return opened.convert("RGB")
    except ValidationError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        raise ValidationError(
            f"the image cannot be read ({error}); send a PNG, JPEG, WebP, GIF or BMP file", param
        ) from None
