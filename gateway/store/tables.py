"""The schema: files, batches and the segments of a batch's results, stored responses and conversations, as SQLAlchemy
Core tables.

Every table has an integer `pk` that grows with insertion, which orders lists and pages them (`after`) without
relying on clock resolution. Times are Unix seconds, as OpenAI reports them; a lease's expiry is a float.

A column added after a release must be nullable or have a `server_default`: `database.open_database` adds it to
the tables of an older database with ALTER TABLE.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

DEFAULT_PROJECT = "default"  # the project of --api-key, of every request when no keys are set, of old rows

metadata = MetaData()

files = Table(
    "ladle_files",
    metadata,
    Column("pk", Integer, primary_key=True, autoincrement=True),
    Column("id", String(64), nullable=False, unique=True),
    Column("filename", String(255), nullable=False),
    Column("purpose", String(32), nullable=False, index=True),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    # Where the bytes are, relative to the blob root; always chosen by the gateway, never by a client.
    Column("blob_key", String(255), nullable=False),
    # The project whose key uploaded the file (a batch's result files: the batch's); no other project sees it.
    Column("project", String(64), nullable=False, server_default=DEFAULT_PROJECT, index=True),
    # When the sweeper deletes the file; None: kept until someone deletes it.
    Column("expires_at", BigInteger, nullable=True, index=True),
)

batches = Table(
    "ladle_batches",
    metadata,
    Column("pk", Integer, primary_key=True, autoincrement=True),
    Column("id", String(64), nullable=False, unique=True),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False, index=True),
    Column("completion_window", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("metadata_json", Text, nullable=True),
    Column("errors_json", Text, nullable=True),
    Column("model", String(255), nullable=True),
    Column("output_file_id", String(64), nullable=True),
    Column("error_file_id", String(64), nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("in_progress_at", BigInteger, nullable=True),
    Column("finalizing_at", BigInteger, nullable=True),
    Column("completed_at", BigInteger, nullable=True),
    Column("failed_at", BigInteger, nullable=True),
    Column("expired_at", BigInteger, nullable=True),
    Column("cancelling_at", BigInteger, nullable=True),
    Column("cancelled_at", BigInteger, nullable=True),
    # request_counts and usage: always the sums over the committed prefixes of the batch's segments (kept in
    # `segments` while the batch runs).
    Column("total", Integer, nullable=False, default=0),
    Column("completed", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
    Column("prompt_tokens", BigInteger, nullable=False, default=0),
    Column("completion_tokens", BigInteger, nullable=False, default=0),
    Column("cached_tokens", BigInteger, nullable=False, default=0),
    Column("reasoning_tokens", BigInteger, nullable=False, server_default="0"),  # of completion_tokens
    # The lease: who works on the batch until when. `lease_epoch` grows with every claim and fences writes: a
    # worker whose claim was superseded can no longer commit anything.
    Column("lease_owner", String(128), nullable=True),
    Column("lease_epoch", Integer, nullable=False, default=0),
    Column("lease_expires_at", Float, nullable=True),
    # Attempts at the batch that ended in an error (a failed write, a crash of the work); at the worker's limit
    # the batch ends `failed` instead of being claimed again.
    Column("failures", Integer, nullable=False, server_default="0"),
    Column("last_error", Text, nullable=True),  # what the last of those errors was
    Column("project", String(64), nullable=False, server_default=DEFAULT_PROJECT, index=True),
    # Seconds from their creation until the batch's output and error files expire; None: they never do.
    Column("output_expires_after_s", Integer, nullable=True),
    # When a worker last claimed it: claims go round-robin by project, least recently served first.
    Column("claimed_at", Float, nullable=True),
    # Claims since the batch last made progress or was released cleanly: a worker that dies while holding it
    # (killed for memory, say) never records a failure, so a batch that keeps killing its workers is caught here.
    Column("unfinished_claims", Integer, nullable=False, server_default="0"),
    # Attempts that ended in a storage error (a full disk, a lost database): not the batch's fault, so not counted
    # in `failures`; the batch is claimed again from `next_attempt_at`, backing off exponentially.
    Column("transient_failures", Integer, nullable=False, server_default="0"),
    Column("next_attempt_at", Float, nullable=True),
)

# One per claim that ran lines: results go to this claim's own files, whose committed lengths live here.
segments = Table(
    "ladle_batch_segments",
    metadata,
    Column("batch_id", String(64), primary_key=True),
    Column("epoch", Integer, primary_key=True),
    Column("output_bytes", BigInteger, nullable=False, default=0),
    Column("error_bytes", BigInteger, nullable=False, default=0),
    # What those committed prefixes hold, as absolute numbers: the batch's counts are their sums over its
    # segments, so a commit repeated after a lost acknowledgement cannot count anything twice.
    Column("completed", Integer, nullable=False, server_default="0"),
    Column("failed", Integer, nullable=False, server_default="0"),
    Column("prompt_tokens", BigInteger, nullable=False, server_default="0"),
    Column("completion_tokens", BigInteger, nullable=False, server_default="0"),
    Column("cached_tokens", BigInteger, nullable=False, server_default="0"),
    Column("reasoning_tokens", BigInteger, nullable=False, server_default="0"),
)

# The failed attempts of a running batch's lines that have any (gateway.batches.attempts), so that a line's attempts
# stay bounded across claims: a worker that dies, or loses its lease, hands its count on. Deleted with the batch's
# segments when it ends.
line_failures = Table(
    "ladle_batch_line_failures",
    metadata,
    Column("batch_id", String(64), primary_key=True),
    Column("custom_id", String(512), primary_key=True),
    Column("failures", Integer, nullable=False),
    Column("failures_alone", Integer, nullable=False),
    Column("last_error", Text, nullable=False),
)

Index("ladle_batches_runnable", batches.c.status, batches.c.lease_expires_at)

# Facts about the store as a whole; `blob_store_id` pairs the database with its blob directory (store/pairing).
meta = Table(
    "ladle_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

# Bytes an upload in progress holds against its project's quota (`FileStore.reserve`): taken before any of its
# bytes are written, dropped when its file record is inserted or the upload ends. A row whose `expires_at` has
# passed (its gateway died mid-upload and stopped renewing it) counts for nothing and is deleted by the sweeper.
upload_reservations = Table(
    "ladle_upload_reservations",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("project", String(64), nullable=False, index=True),
    Column("bytes", BigInteger, nullable=False),
    Column("expires_at", Float, nullable=False, index=True),
)

# The orphan sweep looks blobs up by key (`FileStore.unknown_blob_keys`); `database.open_database` adds the index to
# an older database's table.
Index("ladle_files_blob_key", files.c.blob_key)

# Responses of /v1/responses made with `store` (gateway.store.responses). A background one carries its engine request
# until it ends, and is run under a lease like a batch: a worker claims it (`lease_epoch` fences its writes) and
# another one runs it again if that worker dies before it ends.
responses = Table(
    "ladle_responses",
    metadata,
    Column("pk", Integer, primary_key=True, autoincrement=True),
    Column("id", String(64), nullable=False, unique=True),
    Column("project", String(64), nullable=False, index=True),
    Column("created_at", BigInteger, nullable=False),
    Column("status", String(16), nullable=False),
    Column("background", Boolean, nullable=False),
    Column("previous_response_id", String(64), nullable=True),
    Column("input_items_json", Text, nullable=False),  # this response's own input items, not its chain's
    Column("response_json", Text, nullable=False),  # the Response object as GET returns it
    Column("engine_request", LargeBinary, nullable=True),  # a background response's, until it ends
    Column("lease_owner", String(128), nullable=True),
    Column("lease_epoch", Integer, nullable=False, server_default="0"),
    Column("lease_expires_at", Float, nullable=True),
    Column("attempts", Integer, nullable=False, server_default="0"),  # claims of a background response
)
Index("ladle_responses_runnable", responses.c.status, responses.c.lease_expires_at)
# The retention sweep (`ResponseStore.delete_created_before`) reads responses by age.
Index("ladle_responses_created_at", responses.c.created_at)

# Conversations of the Conversations API (gateway.store.conversations): a project's, with their metadata, and their
# items in the order they were added (`pk`); an item's id is unique within its conversation.
conversations = Table(
    "ladle_conversations",
    metadata,
    Column("pk", Integer, primary_key=True, autoincrement=True),
    Column("id", String(64), nullable=False, unique=True),
    Column("project", String(64), nullable=False, index=True),
    Column("created_at", BigInteger, nullable=False),
    Column("metadata_json", Text, nullable=False),
)
conversation_items = Table(
    "ladle_conversation_items",
    metadata,
    Column("pk", Integer, primary_key=True, autoincrement=True),
    Column("conversation_pk", Integer, nullable=False),
    Column("item_id", String(128), nullable=False),
    Column("item_json", Text, nullable=False),
    UniqueConstraint("conversation_pk", "item_id", name="ladle_conversation_items_id"),
)
Index("ladle_conversation_items_order", conversation_items.c.conversation_pk, conversation_items.c.pk)

# LoRA adapters loaded through the gateway's admin route (gateway.adapters), by name: what every engine that turns
# SERVING is given again (an engine restarts with its --lora-modules only).
lora_adapters = Table(
    "ladle_lora_adapters",
    metadata,
    Column("pk", Integer, primary_key=True, autoincrement=True),
    Column("name", String(256), nullable=False, unique=True),
    Column("path", Text, nullable=False),
    Column("loaded_at", BigInteger, nullable=False),
)

# Tokens used per project, UTC day, model and kind ("interactive": the HTTP routes and background responses;
# "batch": batch jobs' lines), summed from the engine's usage as the gateways flush them (gateway/usage.py).
usage = Table(
    "ladle_usage",
    metadata,
    Column("project", String(64), primary_key=True),
    Column("day", BigInteger, primary_key=True),  # the Unix time of the day's UTC midnight
    Column("model", String(255), primary_key=True),
    Column("kind", String(16), primary_key=True),
    Column("requests", BigInteger, nullable=False, server_default="0"),
    Column("input_tokens", BigInteger, nullable=False, server_default="0"),
    Column("cached_tokens", BigInteger, nullable=False, server_default="0"),
    Column("output_tokens", BigInteger, nullable=False, server_default="0"),
    Column("reasoning_tokens", BigInteger, nullable=False, server_default="0"),
)

# Requests and tokens of a project in one minute (`minute`: its first Unix second), counted by every
# gateway on the database before it sends a request on (gateway/rate_limits.py), so replicas enforce one limit.
rate_windows = Table(
    "ladle_rate_windows",
    metadata,
    Column("project", String(64), primary_key=True),
    Column("minute", BigInteger, primary_key=True),
    Column("requests", BigInteger, nullable=False, server_default="0"),
    Column("tokens", BigInteger, nullable=False, server_default="0"),
)
