"""Images given by `file_id` (a Responses input_image part) as their files' bytes, before the request is translated:
`read_file_images`.

Each file is looked up in the caller's project only (another project's file is answered exactly as one that does
not exist, so its existence is not revealed), must have been uploaded for images (purpose `vision` or
`user_data`, as OpenAI asks), and is read whole from the blob store if it is within the image cap
(`--max-image-mib`, the cap a data: URL's image has). Its bytes are not checked here: they reach the engine as a
data: URL's would, and the engine says whether they are an image. Whatever fails is a 400 naming the field that
gave the file (`FileImageSource.param`), and nothing is sent to the engine. The same file twice is read once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.errors import APIError, invalid
from gateway.store.blobs import BlobStore
from gateway.store.files import FileRecord, FileStore
from gateway.store.ids import FILE_PREFIX, is_id
from gateway.translate.responses_to_engine import FileImageSource, file_image_key

IMAGE_PURPOSES = frozenset({"vision", "user_data"})


async def read_file_images(
    sources: Sequence[FileImageSource], files: FileStore, blobs: BlobStore, project: str, max_bytes: int
) -> dict[str, bytes]:
    """The bytes of each distinct file of `sources`, keyed by `file_image_key` (`translate.media_parts.MediaBytes`);
    APIError (400) naming the first source, in order, whose file is not one of `project`'s, was not uploaded for
    images, is empty or larger than `max_bytes`, or whose bytes are gone."""
    unique: dict[str, FileImageSource] = {}
    for source in sources:
        unique.setdefault(source.file_id, source)
    found: dict[str, bytes] = {}
    for file_id, source in unique.items():
        record = await asyncio.to_thread(files.get, file_id, project) if is_id(file_id, FILE_PREFIX) else None
        if record is None:
            raise _not_found(source)
        _check(record, source, max_bytes)
        data = await asyncio.to_thread(_read, blobs, record)
        if data is None:  # deleted between the lookup and the read
            raise _not_found(source)
        if len(data) > max_bytes:
            raise _too_large(source, max_bytes)
        found[file_image_key(file_id)] = data
    return found


def _check(record: FileRecord, source: FileImageSource, max_bytes: int) -> None:
    if record.purpose not in IMAGE_PURPOSES:
        raise invalid(f"file {source.file_id} was uploaded with purpose {record.purpose!r}; an input_image file "
                      "must be uploaded with purpose 'vision' or 'user_data'", source.param)
    if record.bytes == 0:
        raise invalid(f"the image file {source.file_id} holds no data", source.param)
    if record.bytes > max_bytes:
        raise _too_large(source, max_bytes)


def _read(blobs: BlobStore, record: FileRecord) -> bytes | None:
    try:
        return blobs.path(record.blob_key).read_bytes()
    except FileNotFoundError:
        return None


def _not_found(source: FileImageSource) -> APIError:
    return invalid(f"the image file {source.file_id} was not found", source.param)


def _too_large(source: FileImageSource, max_bytes: int) -> APIError:
    return invalid(f"the image file {source.file_id} is larger than this server takes ({max_bytes} bytes)",
                   source.param)
