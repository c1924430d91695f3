"""Store records as OpenAI's `file` and `batch` objects, and list pages as OpenAI's `list`. Pure functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from gateway.store.batches import BatchRecord
from gateway.store.files import FileRecord

T = TypeVar("T")


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(record: BatchRecord) -> dict[str, Any]:
    errors = {"object": "list", "data": record.errors} if record.errors else None
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "model": record.model,
        "errors": errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.times.get("in_progress_at"),
        "expires_at": record.expires_at,
        "finalizing_at": record.times.get("finalizing_at"),
        "completed_at": record.times.get("completed_at"),
        "failed_at": record.times.get("failed_at"),
        "expired_at": record.times.get("expired_at"),
        "cancelling_at": record.times.get("cancelling_at"),
        "cancelled_at": record.times.get("cancelled_at"),
        "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
        "usage": {
            "input_tokens": record.prompt_tokens,
            "input_tokens_details": {"cached_tokens": record.cached_tokens},
            "output_tokens": record.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": record.reasoning_tokens},
            "total_tokens": record.prompt_tokens + record.completion_tokens,
        },
        "metadata": record.metadata,
    }


def list_object(items: Sequence[T], has_more: bool, render: Callable[[T], dict[str, Any]]) -> dict[str, Any]:
    data = [render(item) for item in items]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
